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
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn


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


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument(
        "--mode", choices=["local", "gradsync", "sequential", "hierarchical", "ddp"], required=True
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
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    loss_fn = nn.MSELoss()
    generator = torch.Generator().manual_seed(rank)
    x = torch.randn(args.batch, width, generator=generator)
    y = torch.randn(args.batch, width, generator=generator)
    started = 0.0
    for step in range(args.warmup + args.steps):
        if step == args.warmup:
            started = time.perf_counter()
        optimizer.zero_grad()
        loss = loss_fn(model(x), y)
        loss.backward()
        optimizer.step()
    seconds = time.perf_counter() - started
    close = getattr(model, "close", None)
    if close is not None:
        close()
    if args.mode == "ddp":
        # Without a final barrier a fast rank tears gloo down while a slow one still
        # talks to it, and gloo aborts the slow process (seen under load).
        dist.barrier()
        dist.destroy_process_group()
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
    # torch + gloo sometimes abort in their own thread teardown at interpreter exit
    # under CPU contention ("terminate called without an active exception"), after
    # the results are written; leave without that teardown.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
