"""Drivers of the Ray tests (tests/system/test_ray_integration.py), one per scenario.

Each scenario is a Ray driver of its own, run as a subprocess against a real cluster:

    python -c "from support.ray_jobs import main; main()" SCENARIO --address GCS --out JSON

It writes what it saw to JSON (reports, parameters, actor names, pids) and the test asserts
on that file, so a driver never decides whether the test passes. The training functions it
hands to Ray live in `support.ray_training`, a module the workers import.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from support.ray_training import (
    RUN_TIMEOUT_S,
    WORLD_SIZE,
    elastic_train,
    failing_train,
    parity_train,
    ray_train_loop,
    reference_training,
)


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
    """A sharded coordinator (leader + 1 shard actor), the two ranks spread over two nodes."""
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
            # One rank per node ("SPREAD"), and each node is a host of its own for gradsync
            # (GRADSYNC_HOST_ID): under "auto" neither forms a local group, and the
            # coordinator checks LOCAL_WORLD_SIZE=1 against the one rank of each host.
            env={"GRADSYNC_HIERARCHICAL": "auto"},
            scheduling_strategy="SPREAD",
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
    errors["failed_run"], pids = failed_run(coordinator)
    actors_before = named_actors()
    coordinator.stop()
    return {
        "address": coordinator.address,
        "world_size": coordinator.world_size,
        "status": status,
        "errors": errors,
        "actors_before_stop": actors_before,
        "actors_after_stop": named_actors(),
        "failed_run_pids": pids,
        "failed_run_pids_left": wait_gone(pids, 15.0),
    }


def failed_run(coordinator: Any) -> tuple[dict[str, Any], list[int]]:
    """A run whose rank 1 raises at once: the error, its delay, and every rank's pid."""
    import gradsync.ray

    pids: list[int] = []
    started = time.monotonic()
    try:
        gradsync.ray.run(
            failing_train,
            num_workers=WORLD_SIZE,
            config={"model": "single_bucket", "fail_rank": 1},
            coordinator=coordinator,
            on_report=lambda report: pids.append(int(report.metrics["pid"])),
        )
    except gradsync.ray.WorkerFailedError as exc:
        return {
            "type": type(exc).__name__,
            "rank": exc.rank,
            "message": str(exc),
            "seconds": time.monotonic() - started,
        }, pids
    return {"type": None}, pids


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
        # Both workers on one node (the cluster has two): they form one local group.
        scaling_config=ScalingConfig(num_workers=WORLD_SIZE, placement_strategy="STRICT_PACK"),
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
