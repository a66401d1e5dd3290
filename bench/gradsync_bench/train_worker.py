"""One rank of the end-to-end training benchmark, launched by torchrun.

Modes (same model, same per-rank batch, one CPU thread per rank):
  local       no communication at all: the ceiling.
  gradsync    gradsync.DistributedDataParallel (flat: hierarchical=False), uploads
              overlapped with backward.
  sequential  gradsync (flat) with overlap off: every bucket uploaded after backward.
  hierarchical  gradsync with hierarchical=True: the ranks torchrun started on this
              host (LOCAL_RANK, LOCAL_WORLD_SIZE) sum in shared memory, one uploads.
  ddp         torch.nn.parallel.DistributedDataParallel over gloo.
Rank 0 writes {"mode", "steps", "seconds", "samples_per_s"} as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from gradsync_bench.procs import exit_now


def build_model(megabytes: float) -> nn.Module:
    """An MLP of roughly `megabytes` of fp32 parameters (three square-ish layers)."""
    width = max(64, int(((megabytes * (1 << 20) / 4) / 3) ** 0.5))
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(width, width),
        nn.ReLU(),
        nn.Linear(width, width),
        nn.ReLU(),
        nn.Linear(width, width),
    )


def fixed_batch_step(model: nn.Module, batch: int, width: int, rank: int) -> Callable[[], None]:
    """One SGD step of `model` on this rank's fixed random batch (seeded by the rank), MSE."""
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    loss_fn = nn.MSELoss()
    generator = torch.Generator().manual_seed(rank)
    x = torch.randn(batch, width, generator=generator)
    y = torch.randn(batch, width, generator=generator)

    def step() -> None:
        optimizer.zero_grad()
        loss_fn(model(x), y).backward()
        optimizer.step()

    return step


def leave(models: Sequence[object], gloo: bool) -> None:
    """Close every model that has a `close` (gradsync's); with `gloo`, leave its group.

    Without a final barrier a fast rank tears gloo down while a slow one still talks to
    it, and gloo aborts the slow process (seen under load): the ranks leave together.
    """
    for model in models:
        close = getattr(model, "close", None)
        if close is not None:
            close()
    if gloo:
        dist.barrier()
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument(
        "--mode",
        choices=["local", "gradsync", "sequential", "hierarchical", "ddp", "ddp-backend"],
        required=True,
    )
    parser.add_argument("--model-mb", type=float, default=32.0)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])

    module = build_model(args.model_mb)
    width = module[0].in_features  # type: ignore[index]
    model: nn.Module = module
    if args.mode == "ddp":
        dist.init_process_group("gloo")
        model = nn.parallel.DistributedDataParallel(module)
    elif args.mode == "ddp-backend":  # the same stock DDP over the c10d backend "gradsync"
        import gradsync.distributed

        options = gradsync.distributed.GradsyncOptions(job_id=f"bench-{args.mode}")
        dist.init_process_group("gradsync", pg_options=options)
        model = nn.parallel.DistributedDataParallel(module)
    elif args.mode in ("gradsync", "sequential", "hierarchical"):
        import gradsync

        model = gradsync.DistributedDataParallel(
            module,
            overlap=args.mode != "sequential",
            hierarchical=args.mode == "hierarchical",
            timeout_s=600,
            join_timeout_s=120,
            job_id=f"bench-{args.mode}",
        )
    train_step = fixed_batch_step(model, args.batch, width, rank)
    started = 0.0
    for step in range(args.warmup + args.steps):
        if step == args.warmup:
            started = time.perf_counter()
        train_step()
    seconds = time.perf_counter() - started
    leave([model], gloo=args.mode in ("ddp", "ddp-backend"))
    if rank == 0:
        args.out.write_text(
            json.dumps(
                {
                    "mode": args.mode,
                    "steps": args.steps,
                    "seconds": seconds,
                    "samples_per_s": world * args.batch * args.steps / seconds,
                }
            )
        )


if __name__ == "__main__":
    main()
    exit_now()
