"""One rank of the sync micro-benchmark: gradsync vs gloo all_reduce, alternating.

Run by `gradsync bench` (suites "loopback" and "netns"), never by hand. Each
repetition times one gradsync synchronization of N bytes of gradients (a
backward pass through a trivially cheap graph, so the time is the sync) and
one gloo `all_reduce` of a tensor of the same size, A B A B, so machine drift
hits both alike. CPU time is process-wide (all threads); rank 0 also samples
the coordinator's CPU time from /proc, so the coordinator's work is counted.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import gradsync
import torch
import torch.distributed as dist

MIB = 1 << 20


def process_cpu_s(pid: int) -> float:
    """user + system CPU seconds of another process, from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--coordinator", required=True)
    parser.add_argument("--gloo-master", required=True, help="host:port for gloo's TCP store")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--megabytes", type=float, required=True)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--coordinator-pid", type=int, default=0)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--job-id", default="bench")
    args = parser.parse_args()
    torch.set_num_threads(1)

    elements = int(args.megabytes * MIB) // 4
    # Four parameters, like a model of a few layers: several buckets, overlapped.
    pieces = [elements // 4] * 3 + [elements - 3 * (elements // 4)]
    params = [torch.nn.Parameter(torch.zeros(n)) for n in pieces]
    model = gradsync.DistributedDataParallel(
        torch.nn.ParameterList(params),
        coordinator=args.coordinator,
        rank=args.rank,
        world_size=args.world_size,
        job_id=args.job_id,
        timeout_s=600,
        join_timeout_s=120,
    )
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://{args.gloo_master}",
        rank=args.rank,
        world_size=args.world_size,
    )
    tensor = torch.ones(elements)
    ones = torch.ones(1)
    records: dict[str, list[dict[str, float]]] = {"gradsync": [], "gloo": []}

    def timed(name: str, operation: object) -> None:
        dist.barrier()
        coordinator_before = process_cpu_s(args.coordinator_pid) if args.coordinator_pid else 0.0
        cpu_before, wall_before = time.process_time(), time.perf_counter()
        operation()  # type: ignore[operator]
        wall = time.perf_counter() - wall_before
        cpu = time.process_time() - cpu_before
        dist.barrier()
        coordinator = (
            process_cpu_s(args.coordinator_pid) - coordinator_before
            if args.coordinator_pid and name == "gradsync"
            else 0.0
        )
        records[name].append({"wall_s": wall, "cpu_s": cpu, "coordinator_cpu_s": coordinator})

    def gradsync_sync() -> None:
        loss = sum((p * ones).sum() for p in params)
        loss.backward()  # type: ignore[union-attr]

    def gloo_sync() -> None:
        dist.all_reduce(tensor)

    # One untimed round each: connections, allocations, page faults.
    gradsync_sync()
    gloo_sync()
    for _ in range(args.reps):
        timed("gradsync", gradsync_sync)
        timed("gloo", gloo_sync)
    model.close()
    dist.barrier()  # see train_worker: gloo aborts a rank whose peer tore down first
    dist.destroy_process_group()
    args.out.write_text(json.dumps(records))


if __name__ == "__main__":
    main()
    # See train_worker: skip torch/gloo's exit-time thread teardown, which can abort.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
