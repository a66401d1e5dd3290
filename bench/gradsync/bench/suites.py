"""The benchmark suites behind `gradsync bench`: each returns rows of measured numbers.

- loopback: one sync of N MB, gradsync vs gloo `all_reduce`, alternating A B A B.
- train: end-to-end training samples/s, gradsync vs torchrun + torch DDP (gloo),
  against a no-communication baseline and gradsync with overlap switched off.
- netns: the loopback suite on an emulated cluster (network namespaces, every
  host link shaped to B Mbit/s), each time set against its analytic bound.

Every figure that is compared is measured in the same run, side by side.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from gradsync.bench.netns import Cluster, LinkShape, available
from gradsync.launch import Launcher, free_port, local_launch, start_coordinator

MIB = 1 << 20
Row = dict[str, Any]
#: The train suite's runs: no communication, gradsync, gradsync without overlap, torch DDP.
TRAIN_MODES = ("local", "gradsync", "sequential", "ddp")


def _wait_all(processes: Sequence[subprocess.Popen[str]], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    try:
        for process in processes:
            remaining = max(1.0, deadline - time.monotonic())
            _, err = process.communicate(timeout=remaining)
            if process.returncode != 0:
                raise RuntimeError(f"{what} failed (exit {process.returncode}): {err[-2000:]}")
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait()


def _stop(process: subprocess.Popen[str]) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _summarize_sync(
    records: list[dict[str, list[dict[str, float]]]], megabytes: float, cores: int
) -> dict[str, dict[str, float]]:
    """Median wall time, algorithm bandwidth and CPU-s per GB for each method."""
    summary = {}
    gigabytes = megabytes / 1024
    for method in ("gradsync", "gloo"):
        reps = len(records[0][method])
        walls = [max(r[method][i]["wall_s"] for r in records) for i in range(reps)]
        cpu = sum(x["cpu_s"] + x["coordinator_cpu_s"] for r in records for x in r[method])
        median = statistics.median(walls)
        summary[method] = {
            "median_ms": median * 1e3,
            "algbw_mb_s": megabytes / median,
            "cpu_s_per_gb": cpu / (reps * gigabytes),
            "cpu_utilisation": cpu / (sum(walls) * cores),
        }
    return summary


def run_sync_pair(
    world_size: int,
    megabytes: float,
    reps: int,
    *,
    workdir: Path,
    launch: Launcher = local_launch,
    coordinator_host: str = "127.0.0.1",
    worker_launchers: Sequence[Launcher] | None = None,
    coordinator_address: str | None = None,
    gloo_address: str = "127.0.0.1",
    coordinator_bind: str = "127.0.0.1",
) -> dict[str, dict[str, float]]:
    """One (W, N) point of the sync micro-benchmark; hosts are given by launchers."""
    coordinator, port = start_coordinator(
        world_size,
        launch=launch,
        host=coordinator_bind,
        port=0 if coordinator_address is None else 50051,
    )
    try:
        address = f"{coordinator_address or coordinator_host}:{port}"
        gloo = f"{gloo_address}:{free_port() if gloo_address == '127.0.0.1' else 29500}"
        launchers = worker_launchers or [local_launch] * world_size
        processes = [
            launchers[rank](
                [
                    sys.executable,
                    "-m",
                    "gradsync.bench.sync_worker",
                    "--coordinator",
                    address,
                    "--gloo-master",
                    gloo,
                    "--rank",
                    str(rank),
                    "--world-size",
                    str(world_size),
                    "--megabytes",
                    str(megabytes),
                    "--reps",
                    str(reps),
                    "--coordinator-pid",
                    str(coordinator.pid if rank == 0 else 0),
                    "--out",
                    str(workdir / f"sync-{rank}.json"),
                ]
            )
            for rank in range(world_size)
        ]
        _wait_all(processes, timeout_s=120 + reps * megabytes, what="sync benchmark worker")
    finally:
        _stop(coordinator)
    records = [json.loads((workdir / f"sync-{r}.json").read_text()) for r in range(world_size)]
    return _summarize_sync(records, megabytes, os.cpu_count() or 1)


def loopback_suite(sizes_mb: Sequence[float], worlds: Sequence[int], reps: int) -> list[Row]:
    """Suite (a): loopback sync, gradsync vs gloo."""
    rows = []
    for world_size in worlds:
        for megabytes in sizes_mb:
            with tempfile.TemporaryDirectory() as scratch:
                result = run_sync_pair(world_size, megabytes, reps, workdir=Path(scratch))
            rows.append(
                {
                    "world_size": world_size,
                    "megabytes": megabytes,
                    "reps": reps,
                    **result,
                    "bandwidth_ratio": result["gradsync"]["algbw_mb_s"]
                    / result["gloo"]["algbw_mb_s"],
                }
            )
    return rows


def _torchrun(
    world_size: int, mode: str, out: Path, model_mb: float, steps: int, env: dict[str, str]
) -> dict[str, Any]:
    argv = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        str(world_size),
        "--master-port",
        str(free_port()),
        "-m",
        "gradsync.bench.train_worker",
        "--mode",
        mode,
        "--model-mb",
        str(model_mb),
        "--steps",
        str(steps),
        "--out",
        str(out),
    ]
    result = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=300 + 10 * steps)
    if result.returncode != 0:
        raise RuntimeError(f"torchrun {mode} failed: {result.stderr[-2000:]}")
    return dict(json.loads(out.read_text()))


def train_suite(worlds: Sequence[int], model_mb: float, steps: int) -> list[Row]:
    """Suite (b): samples/s of gradsync vs torchrun + DDP, local and no-overlap baselines."""
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
                    for mode in TRAIN_MODES
                }
        finally:
            _stop(coordinator)
        step_ms = {m: r["seconds"] / r["steps"] * 1e3 for m, r in results.items()}
        rows.append(
            {
                "world_size": world_size,
                "model_mb": model_mb,
                "steps": steps,
                "samples_per_s": {m: r["samples_per_s"] for m, r in results.items()},
                "step_ms": step_ms,
                "ratio_to_ddp": results["gradsync"]["samples_per_s"]
                / results["ddp"]["samples_per_s"],
                "exposed_comm_ms": step_ms["gradsync"] - step_ms["local"],
                "ddp_exposed_comm_ms": step_ms["ddp"] - step_ms["local"],
                "overlap_gain": step_ms["sequential"] / step_ms["gradsync"],
            }
        )
    return rows


def _on(cluster: Cluster, host: str) -> Launcher:
    """A launcher that runs a command on one emulated host."""
    # gloo finds its own address through the hostname, which names the
    # machine's real interface; inside a namespace only eth0 exists.
    env = dict(os.environ, GLOO_SOCKET_IFNAME="eth0")
    return lambda argv: cluster.popen(host, argv, stderr=subprocess.PIPE, text=True, env=env)


def netns_suite(
    worlds: Sequence[int], sizes_mb: Sequence[float], reps: int, rate_mbit: float
) -> tuple[list[Row], str]:
    """Suite (c): sync on an emulated cluster, each result against its analytic bound.

    Returns (rows, reason); rows are empty and reason says why when namespaces
    cannot be built here.
    """
    ok, reason = available()
    if not ok:
        return [], reason
    bytes_per_s = rate_mbit * 1e6 / 8
    rows = []
    for world_size in worlds:
        hosts = ["coord"] + [f"w{rank}" for rank in range(world_size)]
        with Cluster(hosts, LinkShape(rate_mbit=rate_mbit)) as cluster:
            for megabytes in sizes_mb:
                with tempfile.TemporaryDirectory() as scratch:
                    result = run_sync_pair(
                        world_size,
                        megabytes,
                        reps,
                        workdir=Path(scratch),
                        launch=_on(cluster, "coord"),
                        worker_launchers=[_on(cluster, f"w{r}") for r in range(world_size)],
                        coordinator_address=cluster.address("coord"),
                        gloo_address=cluster.address("w0"),
                        coordinator_bind="0.0.0.0",
                    )
                size = megabytes * MIB
                ring_bound_ms = 2 * (world_size - 1) / world_size * size / bytes_per_s * 1e3
                coordinator_bound_ms = world_size * size / bytes_per_s * 1e3
                rows.append(
                    {
                        "world_size": world_size,
                        "megabytes": megabytes,
                        "reps": reps,
                        "rate_mbit": rate_mbit,
                        **result,
                        "gloo_bound_ms": ring_bound_ms,
                        "gradsync_bound_ms": coordinator_bound_ms,
                        "gloo_of_bound": ring_bound_ms / result["gloo"]["median_ms"],
                        "gradsync_of_bound": coordinator_bound_ms / result["gradsync"]["median_ms"],
                    }
                )
    return rows, ""
