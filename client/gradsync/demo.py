"""`gradsync demo`: the whole system on one machine, checked against one process.

Starts a coordinator and N worker processes (each with different initial
weights, to show that rank 0's state is broadcast), trains the digits example,
then trains the same model in this process on whole global batches and
compares the parameters.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
from gradsync_proto.net.launch import gradsync_argv, start_coordinator

from gradsync import defaults
from gradsync.example import TrainSettings, max_relative_difference, train_reference

#: Parity bound between the distributed and the single-process result.
PARITY_TOLERANCE = 1e-5
#: The reference's initial weights: rank 0's (`gradsync worker` seeds rank r with 1000 + r,
#: and rank 0's weights are broadcast).
INIT_SEED = 1000


def run_demo(settings: TrainSettings, timeout_s: float = defaults.EXAMPLE_TIMEOUT_S) -> int:
    """Run the demo; return 0 when the distributed result matches one process."""
    workers = settings.world_size
    how = describe_sync(settings)
    print(
        f"gradsync demo: 1 coordinator + {workers} workers on the digits data set "
        f"({settings.epochs} epochs, {settings.batch_size} samples per rank per step, {how})"
    )
    coordinator, port = start_coordinator(workers, timeout_s=30.0)
    print(f"coordinator listening on 127.0.0.1:{port}")
    processes: list[subprocess.Popen[bytes]] = []
    # Whatever ends the run (a failure, SIGINT, SIGTERM), no process outlives the demo.
    try:
        with tempfile.TemporaryDirectory(prefix="gradsync-demo-") as scratch:
            outputs = [Path(scratch) / f"rank{rank}.npz" for rank in range(workers)]
            for rank in range(workers):
                processes.append(
                    subprocess.Popen(_worker_argv(settings, port, rank, timeout_s, outputs[rank]))
                )
            try:
                codes = [p.wait(timeout=timeout_s * 3) for p in processes]
            except subprocess.TimeoutExpired:
                print("gradsync demo: workers did not finish in time", file=sys.stderr)
                codes = [1]
            if any(codes):
                print(f"gradsync demo: FAILED, worker exit codes {codes}", file=sys.stderr)
                return 1
            saved = [dict(np.load(path)) for path in outputs]
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait()
        coordinator.terminate()
        coordinator.wait(timeout=30)
    if not matches_one_process(settings, saved, "gradsync demo"):
        return 1
    print(f"OK: {workers} workers trained the same model as a single process")
    if settings.sync_every:
        print("(the single process simulates the DiLoCo replicas and the outer optimizer)")
    return 0


def describe_sync(settings: TrainSettings) -> str:
    """How the demo's workers synchronize, for its banner."""
    if settings.sync_every:
        return f"DiLoCo, a round every {settings.sync_every} steps"
    return "synchronized every step"


def matches_one_process(
    settings: TrainSettings, saved: list[dict[str, np.ndarray]], command: str
) -> bool:
    """Train the reference in this process, print how the ranks compare, and judge.

    `saved` holds each rank's parameters and its "__accuracy__" (`save_parameters`).
    """
    reference, reference_accuracy = train_reference(settings, init_seed=INIT_SEED)
    differences = [max_relative_difference(reference, params) for params in saved]
    accuracy = float(saved[0]["__accuracy__"])
    print(f"distributed test accuracy: {accuracy:.4f} (single process: {reference_accuracy:.4f})")
    print(
        "max relative parameter difference vs single-process training: "
        + ", ".join(f"rank {r} {d:.2e}" for r, d in enumerate(differences))
    )
    if max(differences) > PARITY_TOLERANCE:
        print(f"{command}: FAILED, difference above {PARITY_TOLERANCE:g}", file=sys.stderr)
        return False
    return True


def _worker_argv(
    settings: TrainSettings, port: int, rank: int, timeout_s: float, save: Path
) -> list[str]:
    values: dict[str, object] = {
        "--coordinator": f"127.0.0.1:{port}",
        "--rank": rank,
        "--world-size": settings.world_size,
        "--epochs": settings.epochs,
        "--batch-size": settings.batch_size,
        "--lr": settings.lr,
        "--timeout-s": timeout_s,
        "--save": save,
    }
    if settings.sync_every:
        values["--diloco"] = settings.sync_every
    return gradsync_argv("gradsync.cli", "--log-level", "WARNING", "worker", flags=values)
