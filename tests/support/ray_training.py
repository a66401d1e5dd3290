"""Training functions and references of the Ray tests: what the worker actors import.

Ray pickles a function of an importable module by reference, and the test cluster runs
with PYTHONPATH=tests, so every worker imports `support.ray_training` itself, exactly as a
user's workers import their own code. The drivers (`support.ray_jobs`) pass these
functions to `gradsync.ray.run` and Ray Train, and compute the single-process references
with the same seeds, data and optimizer as the ranks.

Every model here is tiny and every run a few steps: the whole tier shares a 2-core
machine with the rest of the suite.
"""

from __future__ import annotations

import os
import tempfile
import time
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


def ray_node() -> str:
    """The id of the Ray node this rank runs on."""
    import ray

    return str(ray.get_runtime_context().get_node_id())


def torchrun_environment() -> dict[str, str]:
    """The torchrun variables of this process."""
    return {name: os.environ[name] for name in TORCHRUN_VARIABLES}


# ------------------------------------------------------------- training functions
def wrapped(config: dict[str, Any]) -> tuple[int, int, nn.Module, Any, torch.optim.Optimizer]:
    """Rank and world size from the environment (as torchrun), the model wrapped, its optimizer."""
    import gradsync

    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    model = MODELS[config["model"]]()
    ddp = gradsync.DistributedDataParallel(model, timeout_s=RANK_TIMEOUT_S)
    return rank, world_size, model, ddp, make_optimizer(ddp)


def train_step(
    ddp: Any, optimizer: torch.optim.Optimizer, rank: int, world_size: int, width: int
) -> torch.Tensor:
    """One synchronized step on this rank's slice of the step's global batch; its loss."""
    inputs, targets = global_batch(ddp.step, width)
    optimizer.zero_grad()
    output = ddp(rank_slice(inputs, rank, world_size))
    loss = nn.functional.mse_loss(output, rank_slice(targets, rank, world_size))
    loss.backward()
    optimizer.step()
    return loss


def parity_train(config: dict[str, Any]) -> Parameters:
    """A torchrun-style training function, unchanged: ranks from the environment only."""
    from gradsync.ray import report

    rank, world_size, model, ddp, optimizer = wrapped(config)
    width = out_features(model)
    with ddp:
        while ddp.step < config["steps"]:
            loss = train_step(ddp, optimizer, rank, world_size, width)
            report(
                {
                    "step": ddp.step,
                    "loss": loss.item(),
                    "contributors": ddp.last_contributors,
                    "env": torchrun_environment(),
                    "local_ranks": local_ranks(ddp),
                    "node": ray_node(),
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
    rank, world_size, model, ddp, optimizer = wrapped(config)
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
    import ray.train

    rank, world_size, model, ddp, optimizer = wrapped(config)
    width = out_features(model)
    loss = torch.zeros(())
    with ddp:
        while ddp.step < config["steps"]:
            loss = train_step(ddp, optimizer, rank, world_size, width)
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


def failing_train(config: dict[str, Any]) -> None:
    """Rank `fail_rank` raises at once; the others join their job and wait for it.

    Without `run` ending the run at the first failure, the waiting ranks would sit in
    their join until `join_timeout_s` (300 s).
    """
    import gradsync
    from gradsync.ray import report

    rank = int(os.environ["RANK"])
    report({"pid": os.getpid()})
    if rank == config["fail_rank"]:
        time.sleep(1.0)  # the other rank's report reaches the driver first
        raise ValueError(f"rank {rank} fails on purpose")
    gradsync.DistributedDataParallel(MODELS[config["model"]](), timeout_s=RANK_TIMEOUT_S)
