"""`gradsync demo --ray`: the demo's digits job on a Ray cluster, checked against one process.

The coordinator and every worker are Ray actors (`start_coordinator`, `run`); the
training function is the example job's, unchanged: it reads its rank and the
coordinator's address from the environment, as it would under torchrun. Rank 0 reports
its loss every few steps, and the result is compared with single-process training.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from gradsync.example import TrainSettings, max_relative_difference, train_reference
from gradsync.ray.coordinator import start_coordinator
from gradsync.ray.workers import Report, run

#: Parity bound between the distributed and the single-process result (as `gradsync demo`).
PARITY_TOLERANCE = 1e-5
#: Initial weights of every rank (different per rank would be broadcast from rank 0 anyway).
INIT_SEED = 1000


def train_digits(config: dict[str, Any]) -> dict[str, np.ndarray]:
    """One rank of the digits job; returns its parameters and test accuracy."""
    import torch
    from torch import nn

    import gradsync
    from gradsync.example import accuracy as test_accuracy
    from gradsync.example import build_model, global_batches, load_digits

    settings: TrainSettings = config["settings"]
    rank = int(os.environ["RANK"])
    data = load_digits(settings.data_seed)
    model = gradsync.DistributedDataParallel(
        build_model(INIT_SEED + rank), timeout_s=config["timeout_s"]
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=settings.lr)
    model.register_optimizer(optimizer)
    loss_fn = nn.CrossEntropyLoss()
    batches = global_batches(len(data.train_y), settings)
    with model:
        for indices in batches[model.step :]:
            mine = indices[rank * settings.batch_size : (rank + 1) * settings.batch_size]
            optimizer.zero_grad(set_to_none=True)
            loss = loss_fn(model(data.train_x[mine]), data.train_y[mine])
            loss.backward()
            optimizer.step()
            if rank == 0 and model.step % 20 == 0:
                from gradsync.ray.workers import report

                report({"step": model.step, "loss": round(loss.item(), 4)})
    result = {name: p.detach().numpy().copy() for name, p in model.module.named_parameters()}
    result["__accuracy__"] = np.array(test_accuracy(model.module, data.test_x, data.test_y))
    return result


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
        f"data set ({settings.epochs} epochs, {settings.batch_size} samples per rank per step)"
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
    reference, reference_accuracy = train_reference(settings, init_seed=INIT_SEED)
    differences = [max_relative_difference(reference, params) for params in result.results]
    accuracy = float(result.results[0]["__accuracy__"])
    print(f"distributed test accuracy: {accuracy:.4f} (single process: {reference_accuracy:.4f})")
    print(
        "max relative parameter difference vs single-process training: "
        + ", ".join(f"rank {r} {d:.2e}" for r, d in enumerate(differences))
    )
    if max(differences) > PARITY_TOLERANCE:
        print(f"gradsync demo --ray: FAILED, difference above {PARITY_TOLERANCE:g}")
        return 1
    print(f"OK: {workers} Ray worker actors trained the same model as a single process")
    return 0


def _print_report(report: Report) -> None:
    print(f"rank {report.rank}: {dict(report.metrics)}", flush=True)
