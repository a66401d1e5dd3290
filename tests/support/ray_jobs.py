"""Drivers and training functions of the Ray tests (tests/system/test_ray_integration.py).

Each scenario is a Ray driver of its own, run as a subprocess against a real cluster:

    python -c "from support.ray_jobs import main; main()" SCENARIO --address GCS --out JSON

It writes what it saw to JSON (reports, parameters, actor names, pids) and the test asserts
on that file, so a driver never decides whether the test passes. The training functions
live here, in a module the workers can import, because Ray pickles a function of an
importable module by reference: the cluster runs with PYTHONPATH=tests, so every worker
imports `support.ray_jobs` itself, exactly as a user's workers import their own code.

Every model here is tiny and every run a few steps: the whole tier shares a 2-core
machine with the rest of the suite. Single-process references are computed in the
driver, with the same seeds, data and optimizer as the ranks.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import tempfile
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

#: The ranks of every run here.
WORLD_SIZE = 2
#: Samples per step over all ranks; each rank trains on its contiguous slice.
GLOBAL_BATCH = 8
IN_FEATURES = 8
#: Bound on every wait of a rank for the others (a lost peer fails a test, not hangs it).
RANK_TIMEOUT_S = 30.0
#: Bound on a whole `gradsync.ray.run` (the test's own timeout is longer).
RUN_TIMEOUT_S = 90.0
#: The torchrun variables every rank reports, as its training function saw them.
TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")

Parameters = list[Any]  # one nested list of floats per parameter, in module order


# ------------------------------------------------------------------ models and data
def two_layer_model() -> nn.Module:
    """Two Linear layers and no buffers: several parameters, a nonlinear loss surface."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(IN_FEATURES, 16), nn.Tanh(), nn.Linear(16, 4))


def single_bucket_model() -> nn.Module:
    """18 parameters: one gradient bucket, so a step's contributors hold for all of it."""
    torch.manual_seed(0)
    return nn.Linear(IN_FEATURES, 2)


MODELS: dict[str, Callable[[], nn.Module]] = {
    "two_layer": two_layer_model,
    "single_bucket": single_bucket_model,
}


def make_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    """SGD with momentum: the optimizer has state, which a rejoining rank must receive."""
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def global_batch(data_step: int, out_features: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The seeded global batch (inputs, targets) of one step, the same in every process."""
    generator = torch.Generator().manual_seed(1000 + data_step)
    inputs = torch.randn(GLOBAL_BATCH, IN_FEATURES, generator=generator)
    targets = torch.randn(GLOBAL_BATCH, out_features, generator=generator)
    return inputs, targets


def rank_slice(tensor: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """Rank `rank`'s contiguous share of a global batch."""
    rows = tensor.shape[0] // world_size
    return tensor[rank * rows : (rank + 1) * rows]


def out_features(model: nn.Module) -> int:
    """Width of the model's output (the targets' width)."""
    last = [module for module in model.modules() if isinstance(module, nn.Linear)][-1]
    return int(last.out_features)


def parameters_of(model: nn.Module) -> Parameters:
    """Every parameter as nested lists (float32 values are exact as JSON floats)."""
    return [param.detach().tolist() for param in model.parameters()]


def reference_training(
    model_name: str, plan: Sequence[tuple[int, int]], *, average_slices: bool = False
) -> Parameters:
    """Single-process training through `plan`, the parameters after it.

    Args:
        model_name: a key of MODELS.
        plan: one (data step, contributors) per applied step: with all WORLD_SIZE ranks
            the whole global batch, with fewer the slices of the first `contributors`
            ranks (the survivors when the last ranks are lost). Every rank's loss is a
            mean over its slice, so the average of the ranks' gradients is the gradient
            of the mean over their slices together.
        average_slices: compute each contributing slice's gradient on its own and average
            them in float32, as the coordinator does, instead of one pass over the rows
            together. The two differ only by float32 rounding (~1e-7), but over a long
            run momentum SGD carries such a difference along and can grow it to ~1e-6;
            averaging slices gives the ranks' own numbers, however long the run.
    """
    model = MODELS[model_name]()
    optimizer = make_optimizer(model)
    width = out_features(model)
    for data_step, contributors in plan:
        inputs, targets = global_batch(data_step, width)
        rows = GLOBAL_BATCH // WORLD_SIZE
        optimizer.zero_grad()
        if not average_slices:
            loss = nn.functional.mse_loss(
                model(inputs[: rows * contributors]), targets[: rows * contributors]
            )
            loss.backward()
        else:
            params = list(model.parameters())
            total = [torch.zeros_like(param) for param in params]
            for rank in range(contributors):
                output = model(rank_slice(inputs, rank, WORLD_SIZE))
                loss = nn.functional.mse_loss(output, rank_slice(targets, rank, WORLD_SIZE))
                grads = torch.autograd.grad(loss, params)
                total = [summed + grad for summed, grad in zip(total, grads, strict=True)]
            for param, summed in zip(params, total, strict=True):
                param.grad = summed / contributors
        optimizer.step()
    return parameters_of(model)


def local_ranks(ddp: Any) -> list[int]:
    """The ranks of this rank's local group ([] when flat): whether hierarchy engaged.

    Introspection, as tests/support/workers/hier_worker.py does: no public API says it.
    """
    group = ddp._session.local_group
    return [] if group is None else list(group.ranks)


def torchrun_environment() -> dict[str, str]:
    """The torchrun variables of this process."""
    return {name: os.environ[name] for name in TORCHRUN_VARIABLES}


# ------------------------------------------------------------- training functions
def parity_train(config: dict[str, Any]) -> Parameters:
    """A torchrun-style training function, unchanged: ranks from the environment only."""
    import gradsync
    from gradsync.ray import report

    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    model = MODELS[config["model"]]()
    ddp = gradsync.DistributedDataParallel(model, timeout_s=RANK_TIMEOUT_S)
    optimizer = make_optimizer(ddp)
    width = out_features(model)
    with ddp:
        while ddp.step < config["steps"]:
            inputs, targets = global_batch(ddp.step, width)
            optimizer.zero_grad()
            output = ddp(rank_slice(inputs, rank, world_size))
            loss = nn.functional.mse_loss(output, rank_slice(targets, rank, world_size))
            loss.backward()
            optimizer.step()
            report(
                {
                    "step": ddp.step,
                    "loss": loss.item(),
                    "contributors": ddp.last_contributors,
                    "env": torchrun_environment(),
                    "local_ranks": local_ranks(ddp),
                }
            )
    return parameters_of(model)


def elastic_train(config: dict[str, Any]) -> dict[str, Any]:
    """Train until `steps` are done with every rank; a lost rank's step is skipped.

    Rank `hold_rank` stops after step `hold_step` on its first attempt and waits there
    to be killed (the driver kills it when that step's report arrives): however late the
    driver polls the reports, the kill lands at a known step. Every rank also sleeps
    `pace_s` per step, so the survivor runs dozens of steps alone while the lost rank's
    actor restarts (it imports torch anew), not thousands.
    """
    import gradsync
    from gradsync.ray import get_context, report

    context = get_context()
    if context is None:
        raise RuntimeError("elastic_train runs under gradsync.ray.run only")
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    model = MODELS[config["model"]]()
    ddp = gradsync.DistributedDataParallel(model, timeout_s=RANK_TIMEOUT_S)
    optimizer = make_optimizer(ddp)
    ddp.register_optimizer(optimizer)  # a restarted rank receives the momentum too
    width = out_features(model)
    deadline = time.monotonic() + config["deadline_s"]
    with ddp:
        while not (ddp.step >= config["steps"] and ddp.last_contributors == world_size) and (
            time.monotonic() < deadline
        ):
            data_step = ddp.step
            inputs, targets = global_batch(data_step, width)
            optimizer.zero_grad()
            try:
                output = ddp(rank_slice(inputs, rank, world_size))
                nn.functional.mse_loss(output, rank_slice(targets, rank, world_size)).backward()
            except gradsync.StepAbortedError:
                continue  # the step lost a rank mid-way: nobody applies it
            optimizer.step()
            report(
                {
                    "step": ddp.step,
                    "data_step": data_step,
                    "contributors": ddp.last_contributors,
                    "pid": os.getpid(),
                }
            )
            if (rank, context.attempt, ddp.step) == (config["hold_rank"], 1, config["hold_step"]):
                time.sleep(config["hold_s"])
                raise RuntimeError(
                    f"rank {rank} was not killed within {config['hold_s']} s of step {ddp.step}"
                )
            time.sleep(config["pace_s"])
    return {"parameters": parameters_of(model), "step": ddp.step, "attempt": context.attempt}


def ray_train_loop(config: dict[str, Any]) -> None:
    """A Ray Train loop: gradsync for the gradients, Ray Train for metrics and checkpoints."""
    import gradsync
    import ray.train

    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    model = MODELS[config["model"]]()
    ddp = gradsync.DistributedDataParallel(model, timeout_s=RANK_TIMEOUT_S)
    optimizer = make_optimizer(ddp)
    width = out_features(model)
    loss = torch.zeros(())
    with ddp:
        while ddp.step < config["steps"]:
            inputs, targets = global_batch(ddp.step, width)
            optimizer.zero_grad()
            output = ddp(rank_slice(inputs, rank, world_size))
            loss = nn.functional.mse_loss(output, rank_slice(targets, rank, world_size))
            loss.backward()
            optimizer.step()
        metrics = {
            "step": ddp.step,
            "loss": loss.item(),
            "env": torchrun_environment(),
            "local_ranks": local_ranks(ddp),
        }
        with tempfile.TemporaryDirectory() as directory:
            checkpoint = None
            if rank == 0:  # every rank holds the same parameters; one copy is enough
                torch.save(model.state_dict(), Path(directory) / "model.pt")
                checkpoint = ray.train.Checkpoint.from_directory(directory)
            ray.train.report(metrics, checkpoint=checkpoint)


# --------------------------------------------------------------------- scenarios
def named_actors() -> list[str]:
    """The names of every named actor in the cluster, all namespaces (no dashboard needed)."""
    import ray

    return sorted(str(actor["name"]) for actor in ray.util.list_named_actors(all_namespaces=True))


def alive(pid: int) -> bool:
    """Whether process `pid` exists (the cluster runs on this machine)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def wait_gone(pids: Sequence[int], timeout_s: float) -> list[int]:
    """Wait (bounded) for `pids` to exit; return those still alive."""
    deadline = time.monotonic() + timeout_s
    left = [pid for pid in pids if alive(pid)]
    while left and time.monotonic() < deadline:
        time.sleep(0.1)
        left = [pid for pid in left if alive(pid)]
    return left


def status_summary(reply: Any) -> dict[str, Any]:
    """What the tests check of a coordinator's StatusReply."""
    return {
        "jobs": {
            job.job_id: {"steps_completed": job.steps_completed, "world_size": job.world_size}
            for job in reply.jobs
        },
        "shards": [
            {"index": shard.index, "alive": shard.alive, "buckets": shard.buckets_completed}
            for shard in reply.shards
        ],
    }


def settled_status(coordinator: Any, timeout_s: float) -> dict[str, Any]:
    """The coordinator's status once every shard's counters caught up with the leader's.

    A shard reports its counters to the leader with its heartbeats, so right after a
    run the leader may not have heard the last ones yet (bounded wait).
    """
    deadline = time.monotonic() + timeout_s
    while True:
        status = status_summary(coordinator.status())
        counts = [shard["buckets"] for shard in status["shards"]]
        if (counts and len(set(counts)) == 1) or time.monotonic() > deadline:
            return status
        time.sleep(0.2)


def report_rows(reports: Sequence[Any]) -> list[dict[str, Any]]:
    """`gradsync.ray.Report`s as JSON rows, in the order the driver received them."""
    return [
        {"rank": item.rank, "attempt": item.attempt, "metrics": dict(item.metrics)}
        for item in reports
    ]


def scenario_parity(args: argparse.Namespace) -> dict[str, Any]:
    """A sharded coordinator (leader + 1 shard actor), two hierarchical ranks on one node."""
    import gradsync.ray

    steps, model = 6, "two_layer"
    name = f"parity-{uuid.uuid4().hex[:8]}"
    job_id = f"parity-{uuid.uuid4().hex[:8]}"
    coordinator = gradsync.ray.start_coordinator(WORLD_SIZE, shards=2, name=name)
    pids = coordinator.pids()
    actors_running = [actor for actor in named_actors() if name in actor]
    try:
        result = gradsync.ray.run(
            parity_train,
            num_workers=WORLD_SIZE,
            config={"steps": steps, "model": model},
            coordinator=coordinator,
            # Both ranks share this node: with "auto" they sum locally and the coordinator
            # checks LOCAL_WORLD_SIZE against the ranks that share the host.
            env={"GRADSYNC_HIERARCHICAL": "auto"},
            timeout_s=RUN_TIMEOUT_S,
            job_id=job_id,
        )
        status = settled_status(coordinator, 10.0)
    finally:
        coordinator.stop()
    return {
        "job_id": job_id,
        "results": result.results,
        "reports": report_rows(result.reports),
        "restarts": result.restarts,
        "run_coordinator": result.coordinator,
        "address": coordinator.address,
        "status": status,
        "pids": pids,
        "actors_running": actors_running,
        "actors_after_stop": [actor for actor in named_actors() if name in actor],
        "pids_alive_after_stop": wait_gone(list(pids.values()), 10.0),
        "reference": reference_training(model, [(step, WORLD_SIZE) for step in range(steps)]),
    }


def scenario_kill(args: argparse.Namespace) -> dict[str, Any]:
    """`run` with restarts: SIGKILL rank 1's actor at step 3; it restarts and rejoins."""
    import gradsync.ray

    hold_rank, hold_step, model = 1, 3, "single_bucket"
    killed: list[dict[str, Any]] = []

    def kill_at_hold(report: Any) -> None:
        if (
            report.rank == hold_rank
            and report.attempt == 1
            and report.metrics["step"] == hold_step
            and not killed
        ):
            os.kill(report.metrics["pid"], signal.SIGKILL)
            killed.append({"pid": report.metrics["pid"], "at": time.monotonic()})

    started = time.monotonic()
    result = gradsync.ray.run(
        elastic_train,
        num_workers=WORLD_SIZE,
        config={
            "model": model,
            "steps": 8,
            "hold_rank": hold_rank,
            "hold_step": hold_step,
            "hold_s": 30.0,
            "pace_s": 0.05,
            "deadline_s": 75.0,
        },
        max_restarts=2,
        # Flat: every rank uploads its own gradients, so a step's contributors are ranks.
        env={"GRADSYNC_HIERARCHICAL": "0"},
        on_report=kill_at_hold,
        timeout_s=RUN_TIMEOUT_S,
    )
    plan = [
        (row.metrics["data_step"], row.metrics["contributors"])
        for row in result.reports
        if row.rank == 0
    ]
    return {
        "results": result.results,
        "reports": report_rows(result.reports),
        "restarts": result.restarts,
        "killed": killed,
        "run_s": time.monotonic() - started,
        "reference": reference_training(model, plan, average_slices=True),
        "run_coordinators_left": [
            actor for actor in named_actors() if actor.startswith("gradsync-coordinator:run-")
        ],
    }


def scenario_named_start(args: argparse.Namespace) -> dict[str, Any]:
    """Driver A: start a detached coordinator and exit, leaving it running."""
    import gradsync.ray

    coordinator = gradsync.ray.start_coordinator(WORLD_SIZE, name=args.name, detached=True)
    return {"address": coordinator.address, "pids": coordinator.pids()}


def scenario_named_stop(args: argparse.Namespace) -> dict[str, Any]:
    """Driver B: find driver A's coordinator by name, query it, refuse misuse, stop it."""
    import gradsync.ray

    coordinator = gradsync.ray.get_coordinator(args.name)
    status = status_summary(coordinator.status())
    errors: dict[str, Any] = {}
    try:
        gradsync.ray.get_coordinator(f"{args.name}-unknown")
    except LookupError as exc:
        errors["unknown"] = {"type": type(exc).__name__, "message": str(exc)}
    try:
        gradsync.ray.start_coordinator(WORLD_SIZE, name=args.name)
    except ValueError as exc:
        errors["taken"] = {"type": type(exc).__name__, "message": str(exc)}
    actors_before = named_actors()
    coordinator.stop()
    return {
        "address": coordinator.address,
        "world_size": coordinator.world_size,
        "status": status,
        "errors": errors,
        "actors_before_stop": actors_before,
        "actors_after_stop": named_actors(),
    }


def scenario_train(args: argparse.Namespace) -> dict[str, Any]:
    """Ray Train V2's DataParallelTrainer with the gradsync backend."""
    from gradsync.ray import GradsyncConfig
    from ray.train import RunConfig, ScalingConfig
    from ray.train.v2.api.data_parallel_trainer import DataParallelTrainer

    steps, model = 5, "two_layer"
    # The controller polls its workers this often (2 s by default); every phase of a
    # run waits for a poll, and Ray Train passes the variable on to the controller.
    os.environ["RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"] = "0.25"
    trainer = DataParallelTrainer(
        ray_train_loop,
        train_loop_config={"steps": steps, "model": model},
        # "auto", the default outside this test suite: Ray Train's local ranks are
        # then checked by the coordinator against the ranks that share the node.
        backend_config=GradsyncConfig(env={"GRADSYNC_HIERARCHICAL": "auto"}),
        scaling_config=ScalingConfig(num_workers=WORLD_SIZE),
        run_config=RunConfig(storage_path=str(args.storage), name="gradsync-train"),
    )
    result = trainer.fit()
    return {
        "metrics": dict(result.metrics or {}),
        "checkpoint": None if result.checkpoint is None else result.checkpoint.path,
        "error": None if result.error is None else repr(result.error),
        "reference": reference_training(model, [(step, WORLD_SIZE) for step in range(steps)]),
        "coordinators_left": [
            actor
            for actor in named_actors()
            if actor.startswith(("gradsync-coordinator:train-", "gradsync-shard:train-"))
        ],
    }


SCENARIOS: dict[str, Callable[[argparse.Namespace], dict[str, Any]]] = {
    "parity": scenario_parity,
    "kill": scenario_kill,
    "named-start": scenario_named_start,
    "named-stop": scenario_named_stop,
    "train": scenario_train,
}


def main(argv: Sequence[str] | None = None) -> None:
    """Connect to the cluster, run one scenario, write its JSON result."""
    import ray

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("scenario", choices=sorted(SCENARIOS))
    parser.add_argument("--address", required=True, help="the cluster's GCS address")
    parser.add_argument("--out", type=Path, required=True, help="where the JSON result goes")
    parser.add_argument("--name", default="", help="the coordinator's name (named-*)")
    parser.add_argument("--storage", type=Path, help="Ray Train's storage_path (train)")
    args = parser.parse_args(argv)
    ray.init(address=args.address, logging_level=logging.WARNING)
    try:
        outcome = SCENARIOS[args.scenario](args)
    finally:
        ray.shutdown()
    args.out.write_text(json.dumps(outcome))
