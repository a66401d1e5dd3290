"""One rank of the sync micro-benchmark: gradsync vs gloo all_reduce, alternating.

Run by `gradsync bench` (suites "loopback" and "netns"), never by hand. Each
repetition times one gradsync synchronization of N bytes of gradients (a
backward pass through a trivially cheap graph, so the time is the sync) and
one gloo `all_reduce` of a tensor of the same size, A B A B, so machine drift
hits both alike. With `--methods gradsync,hierarchical` a second gradsync job
(own parameters, job id <job>-hier, `hierarchical=True`: ranks on one host
sum in shared memory and only the local leader uploads) joins the rotation,
A B C A B C; the plain "gradsync" job is flat (`hierarchical=False`), so its
numbers mean the same as before hierarchy existed. The 16-bit wire methods
"bf16" and "fp16" are flat jobs with `wire_dtype` (the coordinator sums in
fp32, the average comes back in 16 bits); "ddp-bf16" is torch DDP over the same
gloo group with its `bf16_compress_hook` (a bf16 ring all-reduce of every
bucket), the reference a 16-bit gradsync wire is measured against. "ddp-backend" is
stock torch DDP (fp32, its default buckets) over a group of the c10d backend "gradsync"
(`dist.new_group(backend="gradsync")`, job id <job>-backend, at its default layout: the
ranks of a host sum in shared memory when two of them share it), the backend timed
against the wrapper in the same layout. "local" times the same
forward and backward on parameters of its own with no synchronization at all: the compute
every gradsync time includes and the gloo time (an `all_reduce` alone) does not, about 10-16
ms for 25 MB on one core of the development machine; "ddp" is torch DDP (fp32) over the
same gloo group on that same forward and backward, the like-for-like reference for a
gradsync time. `--link-stats IFACE` records
the interface's tx/rx byte counters around every timed operation (between the
barriers), i.e. this host's traffic for it.

CPU time is process-wide (all threads); rank 0 also samples
the CPU time of the coordinator's processes (the leader, its shards, and their
children, all on this machine: network namespaces share one process table)
from /proc, so the coordinator's work is counted, process by process.
"""

from __future__ import annotations

import argparse
import functools
import json
import time
from pathlib import Path
from typing import Any

import gradsync
import torch
import torch.distributed as dist

from gradsync_bench.procs import exit_now, link_bytes, server_cpu_s
from gradsync_bench.train_worker import leave
from gradsync_bench.wire_report import DDP_BF16, DDP_FP32, LOCAL

MIB = 1 << 20
#: The gradsync methods a worker can time: their `hierarchical=` and `wire_dtype=`.
GRADSYNC_METHODS: dict[str, tuple[bool, torch.dtype | None]] = {
    "gradsync": (False, None),
    "hierarchical": (True, None),
    "bf16": (False, torch.bfloat16),
    "fp16": (False, torch.float16),
}
#: Stock torch DDP (fp32) over a group of the c10d backend "gradsync".
DDP_BACKEND = "ddp-backend"
#: What each gradsync method appends to the job id ("gradsync" is the job id itself).
JOB_SUFFIX = {"gradsync": "", "hierarchical": "-hier", "bf16": "-bf16", "fp16": "-fp16"}


class SumOfParameters(torch.nn.Module):
    """sum(p * x) over the parameters: torch DDP needs a forward to run its hooks."""

    def __init__(self, parameters: list[torch.nn.Parameter]) -> None:
        super().__init__()
        self.pieces = torch.nn.ParameterList(parameters)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return sum(((p * x).sum() for p in self.pieces), torch.zeros(()))


def _bf16_hook_over_gloo() -> Any:
    """torch DDP's `bf16_compress_hook`, which torch refuses by name off CUDA + NCCL.

    gloo reduces bf16 tensors, so this is the built-in's own body
    (`default_hooks._compress_hook(torch.bfloat16, ...)`: cast, divide, all-reduce,
    cast back), bound with functools.partial so that DDP sees the original's
    signature, under another name.
    """
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    hook = functools.partial(default_hooks._compress_hook, torch.bfloat16)
    # DDP reads both names (its check, its logging); a partial has neither.
    hook.__name__ = hook.__qualname__ = "bf16_hook_over_gloo"  # type: ignore[attr-defined]
    return hook


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--coordinator", required=True)
    parser.add_argument("--gloo-master", required=True, help="host:port for gloo's TCP store")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--megabytes", type=float, required=True)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument(
        "--server-pids", default="", help="comma-separated pids of the shards (rank 0 samples them)"
    )
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--job-id", default="bench")
    parser.add_argument(
        "--methods",
        default="gradsync",
        help="methods to time besides gloo: gradsync (flat), hierarchical, bf16, fp16, "
        "ddp-bf16, ddp (fp32), ddp-backend (stock DDP over the backend), local",
    )
    parser.add_argument("--link-stats", default=None, help="interface to count bytes on")
    args = parser.parse_args()
    torch.set_num_threads(1)

    elements = int(args.megabytes * MIB) // 4
    # Four parameters, like a model of a few layers: several buckets, overlapped.
    pieces = [elements // 4] * 3 + [elements - 3 * (elements // 4)]
    methods = args.methods.split(",")
    params: dict[str, list[torch.nn.Parameter]] = {}
    models: list[torch.nn.Module] = []
    for method in methods:
        params[method] = [torch.nn.Parameter(torch.zeros(n)) for n in pieces]
        if method in (DDP_BF16, DDP_FP32, DDP_BACKEND, LOCAL):
            continue  # torch DDP: wrapped once gloo's group exists; LOCAL: never wrapped
        hierarchical, wire_dtype = GRADSYNC_METHODS[method]
        models.append(
            gradsync.DistributedDataParallel(
                torch.nn.ParameterList(params[method]),
                coordinator=args.coordinator,
                rank=args.rank,
                world_size=args.world_size,
                job_id=args.job_id + JOB_SUFFIX[method],
                timeout_s=600,
                join_timeout_s=120,
                hierarchical=hierarchical,
                wire_dtype=wire_dtype,
            )
        )
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://{args.gloo_master}",
        rank=args.rank,
        world_size=args.world_size,
    )
    references: dict[str, torch.nn.parallel.DistributedDataParallel] = {}
    for name in (DDP_BF16, DDP_FP32):
        if name in methods:
            reference = torch.nn.parallel.DistributedDataParallel(SumOfParameters(params[name]))
            if name == DDP_BF16:
                reference.register_comm_hook(None, _bf16_hook_over_gloo())
            references[name] = reference
            models.append(reference)
    backend_group = None
    if DDP_BACKEND in methods:
        from gradsync.distributed import GradsyncOptions  # (registers the backend)

        options = GradsyncOptions(coordinator=args.coordinator, job_id=args.job_id + "-backend")
        backend_group = dist.new_group(backend="gradsync", pg_options=options)
        references[DDP_BACKEND] = torch.nn.parallel.DistributedDataParallel(
            SumOfParameters(params[DDP_BACKEND]), process_group=backend_group
        )
    tensor = torch.ones(elements)
    ones = torch.ones(1)
    servers = [int(pid) for pid in args.server_pids.split(",") if pid]
    records: dict[str, list[dict[str, Any]]] = {method: [] for method in [*methods, "gloo"]}

    def timed(name: str, operation: object) -> None:
        dist.barrier()
        sample = servers if name in GRADSYNC_METHODS or name == DDP_BACKEND else []
        servers_before = server_cpu_s(sample)
        link_before = link_bytes(args.link_stats)
        cpu_before, wall_before = time.process_time(), time.perf_counter()
        operation()  # type: ignore[operator]
        wall = time.perf_counter() - wall_before
        cpu = time.process_time() - cpu_before
        dist.barrier()
        link_after = link_bytes(args.link_stats)
        # Per server process, so a report can tell whether the shards spread over the cores.
        by_process = {
            pid: after - servers_before.get(pid, 0.0) for pid, after in server_cpu_s(sample).items()
        }
        records[name].append(
            {
                "wall_s": wall,
                "cpu_s": cpu,
                "coordinator_cpu_s": sum(by_process.values()),
                "server_cpu_s": by_process,
                **{f"link_{d}": link_after[d] - link_before[d] for d in link_after},
            }
        )

    def gradsync_sync(method: str) -> None:
        if method in references:
            references[method](ones).backward()
            return
        loss = sum((p * ones).sum() for p in params[method])
        loss.backward()  # type: ignore[union-attr]

    def gloo_sync() -> None:
        dist.all_reduce(tensor)

    # One untimed round each: connections, allocations, page faults.
    for method in methods:
        gradsync_sync(method)
    gloo_sync()
    for _ in range(args.reps):
        for method in methods:
            timed(method, lambda method=method: gradsync_sync(method))
        timed("gloo", gloo_sync)
    if backend_group is not None:
        dist.destroy_process_group(backend_group)  # leaves its job; gloo's group stays
    leave(models, gloo=True)
    args.out.write_text(json.dumps(records))


if __name__ == "__main__":
    main()
    exit_now()
