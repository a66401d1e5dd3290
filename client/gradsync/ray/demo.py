"""`gradsync demo --ray`: the demo's digits job on a Ray cluster, checked against one process.

The coordinator and every worker are Ray actors (`start_coordinator`, `run`); each rank
runs the example job's own training (`gradsync.example.train_worker`), with its rank and
the coordinator's address from the environment, as it would have them under torchrun. Rank 0 reports
its loss every few steps, and the result is compared with single-process training.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from gradsync.demo import INIT_SEED, describe_sync, matches_one_process
from gradsync.example import TrainSettings
from gradsync.ray.coordinator import start_coordinator
from gradsync.ray.workers import Report, report, run

#: Rank 0 reports its loss to the driver every this many steps.
REPORT_EVERY_STEPS = 20


def train_digits(config: dict[str, Any]) -> dict[str, np.ndarray]:
    """One rank of the digits job (the example's own loop); its parameters and accuracy."""
    from gradsync.config import ENV_COORDINATOR
    from gradsync.example import train_worker

    settings: TrainSettings = config["settings"]
    rank = int(os.environ["RANK"])

    def on_step(step: int, loss: float) -> None:
        if rank == 0 and step % REPORT_EVERY_STEPS == 0:
            report({"step": step, "loss": round(loss, 4)})

    with tempfile.TemporaryDirectory(prefix="gradsync-demo-") as scratch:
        saved = Path(scratch) / "params.npz"
        train_worker(
            os.environ[ENV_COORDINATOR],
            rank,
            settings,
            init_seed=INIT_SEED + rank,
            timeout_s=config["timeout_s"],
            save_path=saved,
            on_step=on_step,
        )
        return dict(np.load(saved))


def run_ray_demo(settings: TrainSettings, timeout_s: float, address: str | None) -> int:
    """Run the demo on the Ray cluster at `address` (None: $RAY_ADDRESS or a local one)."""
    import ray

    workers = settings.world_size
    if not ray.is_initialized():
        if address is None and "RAY_ADDRESS" not in os.environ:
            # A local cluster: one CPU for the coordinator and one per worker, whatever
            # this machine has (Ray's CPUs are what it schedules by, not cores it pins).
            ray.init(num_cpus=max(workers + 1, os.cpu_count() or 1), log_to_driver=False)
        else:
            ray.init(address=address, log_to_driver=False)
    print(
        f"gradsync demo --ray: 1 coordinator actor + {workers} worker actors on the digits "
        f"data set ({settings.epochs} epochs, {settings.batch_size} samples per rank per step, "
        f"{describe_sync(settings)})"
    )
    coordinator = start_coordinator(workers, name=f"demo-{os.getpid()}")
    print(f"coordinator actor listening on {coordinator.address}")
    try:
        result = run(
            train_digits,
            num_workers=workers,
            config={"settings": settings, "timeout_s": timeout_s},
            coordinator=coordinator,
            on_report=_print_report,
            timeout_s=timeout_s * 3,
        )
    finally:
        coordinator.stop(grace_s=1.0)
    if not matches_one_process(settings, result.results, "gradsync demo --ray"):
        return 1
    print(f"OK: {workers} Ray worker actors trained the same model as a single process")
    return 0


def _print_report(report: Report) -> None:
    print(f"rank {report.rank}: {dict(report.metrics)}", flush=True)
