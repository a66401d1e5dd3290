"""The benchmark suites behind `gradsync bench`: each returns rows of measured numbers.

- loopback: one sync of N MB, gradsync vs gloo `all_reduce`, alternating A B A B;
  with hierarchy, a hierarchical gradsync job (all W ranks one local group: they
  sum in shared memory, one upload) joins the rotation, A B C A B C.
- train: end-to-end training samples/s, gradsync vs torchrun + torch DDP (gloo),
  against a no-communication baseline and gradsync with overlap switched off;
  with hierarchy, also gradsync with `hierarchical=True` (torchrun's LOCAL_* env).
- netns (in `gradsync_bench.sharded`): the loopback measurement on an emulated
  cluster (network namespaces, every host link shaped to B Mbit/s), per
  coordinator layout, each time set against its analytic bound.

Every figure that is compared is measured in the same run, side by side.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from gradsync_proto.net.launch import Launcher, free_port, local_launch, start_coordinator

from gradsync_bench.procs import flag_args, stop_process, wait_ranks
from gradsync_bench.wire_report import DDP_FP32, LOCAL

MIB = 1 << 20
Row = dict[str, Any]
#: The train suite's runs: no communication, gradsync, gradsync without overlap, torch DDP.
TRAIN_MODES = ("local", "gradsync", "sequential", "ddp")
#: The train suite's run of the same stock DDP over the c10d backend "gradsync".
BACKEND = "ddp-backend"
#: The extra train mode with hierarchy: gradsync with `hierarchical=True`.
HIERARCHICAL = "hierarchical"


def _summarize_sync(
    records: list[dict[str, list[dict[str, Any]]]], megabytes: float, cores: int
) -> dict[str, dict[str, float]]:
    """Median wall time, algorithm bandwidth and CPU use for each method.

    CPU counts every process: the workers and (for gradsync) the coordinator's processes,
    which rank 0 samples. `server_cores` is the coordinator processes' CPU time over the wall
    time (1.0 = one core busy throughout); `busiest_server_cores` the same for the busiest one
    of them, so `server_cores` well above `busiest_server_cores` means the shards spread the
    work over several cores.
    """
    summary = {}
    gigabytes = megabytes / 1024
    for method in records[0]:
        reps = len(records[0][method])
        walls = [max(r[method][i]["wall_s"] for r in records) for i in range(reps)]
        cpu = sum(x["cpu_s"] + x["coordinator_cpu_s"] for r in records for x in r[method])
        server = sum(x["coordinator_cpu_s"] for r in records for x in r[method])
        by_process: dict[str, float] = {}
        for rep in (x for r in records for x in r[method]):
            for pid, seconds in rep.get("server_cpu_s", {}).items():
                by_process[pid] = by_process.get(pid, 0.0) + seconds
        median = statistics.median(walls)
        summary[method] = {
            "median_ms": median * 1e3,
            "algbw_mb_s": megabytes / median,
            "cpu_s_per_gb": cpu / (reps * gigabytes),
            "cpu_s_per_sync": cpu / reps,
            "cpu_utilisation": cpu / (sum(walls) * cores),
            "server_cores": server / sum(walls),
            "busiest_server_cores": max(by_process.values(), default=0.0) / sum(walls),
        }
    return summary


def run_sync_workers(
    world_size: int,
    megabytes: float,
    reps: int,
    *,
    workdir: Path,
    address: str,
    gloo: str,
    launchers: Sequence[Launcher],
    server_pids: Sequence[int],
    timeout_s: float | None = None,
    methods: Sequence[str] = ("gradsync",),
    link_stats: str | None = None,
) -> dict[str, dict[str, float]]:
    """Run the W sync workers against a running coordinator at `address`; summarize.

    `server_pids` are the coordinator's processes (leader first, then its shards), whose CPU
    time rank 0 samples around every gradsync sync. `timeout_s` bounds the whole run
    (default: 120 s plus one second per MB, repetition and method). `methods` are the
    gradsync jobs timed besides gloo ("gradsync" flat, "hierarchical"); with `link_stats`
    each rank also records that interface's byte counters (`read_sync_records`).
    """
    processes = [
        launchers[rank](
            [
                *(sys.executable, "-m", "gradsync_bench.sync_worker"),
                *flag_args(coordinator=address, gloo_master=gloo, rank=rank, world_size=world_size),
                *flag_args(megabytes=megabytes, reps=reps),
                *flag_args(server_pids=",".join(map(str, server_pids)) if rank == 0 else ""),
                *flag_args(out=workdir / f"sync-{rank}.json", methods=",".join(methods)),
                *flag_args(link_stats=link_stats or None),
            ]
        )
        for rank in range(world_size)
    ]
    if timeout_s is None:
        timeout_s = 120 + reps * megabytes * len(methods)
    wait_ranks(
        processes,
        timeout_s,
        lambda _, code, err: f"sync benchmark worker failed (exit {code}): {err[-2000:]}",
    )
    return _summarize_sync(read_sync_records(workdir, world_size), megabytes, os.cpu_count() or 1)


def read_sync_records(workdir: Path, world_size: int) -> list[dict[str, list[dict[str, Any]]]]:
    """What each sync worker recorded, by rank: {method: [one dict per repetition]}."""
    return [json.loads((workdir / f"sync-{r}.json").read_text()) for r in range(world_size)]


def loopback_suite(
    sizes_mb: Sequence[float],
    worlds: Sequence[int],
    reps: int,
    shards: Sequence[int] = (1,),
    hierarchy: bool = False,
) -> list[Row]:
    """Suite (a): loopback sync, gradsync vs gloo; with S > 1, `serve --shards S`.

    With `hierarchy`, rows with S = 1 also time a hierarchical job (key "hierarchical",
    its bandwidth over gloo's in "hierarchical_bandwidth_ratio").
    """
    rows = []
    for shard_count in shards:
        methods: tuple[str, ...] = ("gradsync",)
        if hierarchy and shard_count == 1:
            methods += (HIERARCHICAL,)
        # The compute inside every gradsync time (not inside gloo's all_reduce), and torch
        # DDP doing that same compute and its own sync: the like-for-like reference.
        methods += (LOCAL, DDP_FP32)
        serve_flags = ("--shards", str(shard_count)) if shard_count > 1 else ()
        for world_size in worlds:
            for megabytes in sizes_mb:
                coordinator, port = start_coordinator(world_size, *serve_flags)
                try:
                    with tempfile.TemporaryDirectory() as scratch:
                        result = run_sync_workers(
                            world_size,
                            megabytes,
                            reps,
                            workdir=Path(scratch),
                            address=f"127.0.0.1:{port}",
                            gloo=f"127.0.0.1:{free_port()}",
                            launchers=[local_launch] * world_size,
                            server_pids=[coordinator.pid],
                            methods=methods,
                        )
                finally:
                    stop_process(coordinator)
                row = {
                    "world_size": world_size,
                    "shards": shard_count,
                    "megabytes": megabytes,
                    "reps": reps,
                    **result,
                    "bandwidth_ratio": result["gradsync"]["algbw_mb_s"]
                    / result["gloo"]["algbw_mb_s"],
                }
                if HIERARCHICAL in result:
                    row["hierarchical_bandwidth_ratio"] = (
                        result[HIERARCHICAL]["algbw_mb_s"] / result["gloo"]["algbw_mb_s"]
                    )
                    row["hierarchical_to_ddp"] = (
                        result[DDP_FP32]["median_ms"] / result[HIERARCHICAL]["median_ms"]
                    )
                rows.append(row)
    return rows


def _torchrun(
    world_size: int, mode: str, out: Path, model_mb: float, steps: int, env: dict[str, str]
) -> dict[str, Any]:
    argv = [
        *(sys.executable, "-m", "torch.distributed.run"),
        *flag_args(nproc_per_node=world_size, master_port=free_port()),
        *("-m", "gradsync_bench.train_worker"),
        *flag_args(mode=mode, model_mb=model_mb, steps=steps, out=out),
    ]
    result = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=300 + 10 * steps)
    if result.returncode != 0:
        raise RuntimeError(f"torchrun {mode} failed: {result.stderr[-2000:]}")
    return dict(json.loads(out.read_text()))


def train_suite(
    worlds: Sequence[int], model_mb: float, steps: int, hierarchy: bool = False
) -> list[Row]:
    """Suite (b): samples/s of gradsync vs torchrun + DDP, local and no-overlap baselines,
    and stock DDP over the "gradsync" backend; with `hierarchy` also gradsync with
    `hierarchical=True` (one local group of W)."""
    modes = (*TRAIN_MODES, BACKEND, *((HIERARCHICAL,) if hierarchy else ()))
    rows = []
    for world_size in worlds:
        coordinator, port = start_coordinator(world_size, launch=local_launch)
        env = dict(os.environ, GRADSYNC_COORDINATOR=f"127.0.0.1:{port}", OMP_NUM_THREADS="1")
        try:
            with tempfile.TemporaryDirectory() as scratch:
                results = {
                    mode: _torchrun(
                        world_size, mode, Path(scratch) / f"{mode}.json", model_mb, steps, env
                    )
                    for mode in modes
                }
        finally:
            stop_process(coordinator)
        step_ms = {m: r["seconds"] / r["steps"] * 1e3 for m, r in results.items()}
        row: Row = {
            "world_size": world_size,
            "model_mb": model_mb,
            "steps": steps,
            "samples_per_s": {m: r["samples_per_s"] for m, r in results.items()},
            "step_ms": step_ms,
            "ratio_to_ddp": results["gradsync"]["samples_per_s"] / results["ddp"]["samples_per_s"],
            "exposed_comm_ms": step_ms["gradsync"] - step_ms["local"],
            "ddp_exposed_comm_ms": step_ms["ddp"] - step_ms["local"],
            "overlap_gain": step_ms["sequential"] / step_ms["gradsync"],
            "backend_ratio_to_gradsync": (
                results[BACKEND]["samples_per_s"] / results["gradsync"]["samples_per_s"]
            ),
        }
        if HIERARCHICAL in results:
            row["hierarchical_ratio_to_ddp"] = (
                results[HIERARCHICAL]["samples_per_s"] / results["ddp"]["samples_per_s"]
            )
            row["hierarchical_exposed_comm_ms"] = step_ms[HIERARCHICAL] - step_ms["local"]
        rows.append(row)
    return rows
