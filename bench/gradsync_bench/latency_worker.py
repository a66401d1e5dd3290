"""One rank of the latency suite: a tiny model whose step is all fixed per-step cost.

The model is one `Linear(256, 256)` (257 KiB of fp32 gradients), trained with SGD on a
per-rank batch of 32 with one torch thread, so a step's compute is tens of microseconds
and its time is what the synchronization costs per step, not per byte.

Modes (same model, same seeds, same per-rank batches):
  flat     gradsync.DistributedDataParallel with hierarchical=False (every rank uploads).
  default  gradsync.DistributedDataParallel with the default, hierarchical="auto" (the
           ranks of this host sum in shared memory, one uploads).
  ddp      torch.nn.parallel.DistributedDataParallel over gloo.
  ddp-backend  the same stock DistributedDataParallel over the c10d backend "gradsync"
           (`gradsync.distributed`), on the coordinator at $GRADSYNC_COORDINATOR.

Every rank runs `--warmup` steps, meets the others at a barrier, then times `--steps`
steps; each rank writes {"mode", "rank", "steps", "seconds", "cpu_s"} (its process's CPU
time over the timed steps) to `--out`-<rank>.json. With `--coordinator-pid`, rank 0 also
writes "coordinator_cpu_s": the coordinator's CPU over its own timed steps, read from
/proc, so that the coordinator's start and the joins stay out of the per-step figure.
Launched by `gradsync_bench.latency` with RANK, WORLD_SIZE, LOCAL_RANK,
LOCAL_WORLD_SIZE (and MASTER_ADDR / MASTER_PORT for gloo) in the environment.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from gradsync_bench.procs import exit_now, process_cpu_s
from gradsync_bench.train_worker import fixed_batch_step, leave

MODES = ("flat", "default", "ddp", "ddp-backend")
WIDTH = 256


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=MODES, required=True)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--job-id", default="latency")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--coordinator-pid", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])

    torch.manual_seed(0)
    module = nn.Linear(WIDTH, WIDTH)
    model: nn.Module
    barrier: Callable[[], object]
    if args.mode == "ddp":
        dist.init_process_group("gloo")
        model = nn.parallel.DistributedDataParallel(module)
        barrier = dist.barrier
    elif args.mode == "ddp-backend":
        import gradsync.distributed

        options = gradsync.distributed.GradsyncOptions(job_id=args.job_id)
        dist.init_process_group("gradsync", pg_options=options)
        model = nn.parallel.DistributedDataParallel(module)
        barrier = dist.barrier
    else:
        import gradsync

        wrapped = gradsync.DistributedDataParallel(
            module,
            hierarchical=False if args.mode == "flat" else "auto",
            timeout_s=300,
            join_timeout_s=300,
            job_id=args.job_id,
        )
        model, barrier = wrapped, wrapped.barrier
    train_step = fixed_batch_step(model, args.batch, WIDTH, rank)
    for _ in range(args.warmup):
        train_step()
    barrier()  # every rank starts its clock together
    watch_coordinator = rank == 0 and args.coordinator_pid > 0
    coordinator_started = process_cpu_s(args.coordinator_pid) if watch_coordinator else 0.0
    started, cpu_started = time.perf_counter(), time.process_time()
    for _ in range(args.steps):
        train_step()
    seconds = time.perf_counter() - started
    coordinator_cpu_s = None
    if watch_coordinator:
        coordinator_cpu_s = process_cpu_s(args.coordinator_pid) - coordinator_started
    # All of this process's threads (gradsync's transport thread too): the per-step fixed
    # cost, which a loaded machine stretches less than it stretches the wall time.
    cpu_s = time.process_time() - cpu_started
    leave([model], gloo=args.mode in ("ddp", "ddp-backend"))
    record: dict[str, object] = {
        "mode": args.mode,
        "rank": rank,
        "steps": args.steps,
        "seconds": seconds,
        "cpu_s": cpu_s,
    }
    if coordinator_cpu_s is not None:
        record["coordinator_cpu_s"] = coordinator_cpu_s
    args.out.with_name(f"{args.out.name}-{rank}.json").write_text(json.dumps(record))


if __name__ == "__main__":
    main()
    exit_now()
