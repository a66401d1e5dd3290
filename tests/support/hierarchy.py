"""Helpers of the hierarchical-aggregation tests: emulated hosts, a private tmpfs, reports.

A rank's host is emulated with `$GRADSYNC_HOST_ID` (loopback) or is a real network
namespace (`gradsync_bench.netns.Cluster`); its shared-memory segment goes to
`$GRADSYNC_SHM_DIR`, which the fault tests point at a tmpfs of their own, so that
"nothing is left" can be checked on a filesystem nobody else writes to.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from support.processes import WORKERS, launch_ranks, reap

HIER_WORKER = WORKERS / "hier_worker.py"
#: Starts one rank's argv with Popen keyword arguments (here, or on an emulated host).
Popen = Callable[..., "subprocess.Popen[Any]"]
#: The shared-memory directory a run without $GRADSYNC_SHM_DIR uses.
DEV_SHM = Path("/dev/shm")


def rank_env(host_id: str | None, shm_dir: Path | None = None) -> dict[str, str]:
    """The environment of a rank on emulated host `host_id` (None: no emulation)."""
    env = dict(os.environ, PYTHONWARNINGS="error")
    env.pop("GRADSYNC_HOST_ID", None)
    env.pop("GRADSYNC_SHM_DIR", None)
    if host_id is not None:
        env["GRADSYNC_HOST_ID"] = host_id
    if shm_dir is not None:
        env["GRADSYNC_SHM_DIR"] = str(shm_dir)
    return env


def _here(rank: int, argv: list[str], **kwargs: Any) -> subprocess.Popen[Any]:
    return subprocess.Popen(argv, **kwargs)


def start_job(
    address: str,
    world_size: int,
    out: Path,
    *extra: str,
    hosts: Sequence[str | None],
    shm_dir: Path | None = None,
    per_rank: dict[int, list[str]] | None = None,
    popen: Popen | None = None,
) -> list[subprocess.Popen[Any]]:
    """Start the ranks of one hier-worker job; rank r runs on emulated host hosts[r].

    Each rank's output goes to out/rank<r>.log (quoted by `finish` when a rank fails),
    its report to out/rank<r>.json. `popen(rank, argv, **kwargs)` starts a rank
    elsewhere (a network namespace); by default it runs here.
    """
    out.mkdir(parents=True, exist_ok=True)

    def launch(rank: int, argv: list[str]) -> subprocess.Popen[Any]:
        with (out / f"rank{rank}.log").open("wb") as log:
            return (popen or _here)(
                rank,
                argv,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=rank_env(hosts[rank], shm_dir),
            )

    return launch_ranks(
        HIER_WORKER,
        address,
        world_size,
        lambda rank: out / f"rank{rank}.json",
        "--job-id",
        out.name,
        *extra,
        per_rank=per_rank,
        launch=launch,
    )


def finish(
    processes: Sequence[subprocess.Popen[Any]], out: Path, timeout_s: float = 90
) -> list[list[dict[str, Any]] | None]:
    """Wait for every rank (reaping them all whatever happens); each rank's run reports
    (None for a rank that wrote none: it was killed), in rank order."""
    deadline = time.monotonic() + timeout_s
    reports: list[list[dict[str, Any]] | None] = []
    try:
        for rank, process in enumerate(processes):
            try:
                process.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise AssertionError(f"rank {rank} hung:\n{log_of(out, rank)}") from None
            path = out / f"rank{rank}.json"
            reports.append(json.loads(path.read_text())["runs"] if path.exists() else None)
    finally:
        reap(processes)
    return reports


def log_of(out: Path, rank: int) -> str:
    """The last lines a rank printed (for assertion messages)."""
    path = out / f"rank{rank}.log"
    return path.read_text(errors="replace")[-3000:] if path.exists() else "(no log)"


def run_of(
    reports: Sequence[list[dict[str, Any]] | None], index: int, out: Path
) -> list[dict[str, Any]]:
    """Run `index` of every rank, asserting each rank finished it."""
    found = []
    for rank, runs in enumerate(reports):
        assert runs is not None, f"rank {rank} wrote no report\n{log_of(out, rank)}"
        run = runs[index]
        assert run["status"] == "ok", (
            f"rank {rank}, run {index} ({run['run']}): {run['status']}: {run['message']}\n"
            + log_of(out, rank)
        )
        found.append(run)
    return found


def params_of(report: dict[str, Any]) -> dict[str, np.ndarray]:
    return {name: np.array(values) for name, values in report["params"].items()}


def max_relative_difference(a: dict[str, Any], b: dict[str, Any]) -> float:
    """The largest |a - b| / max|b| over the parameters of two reports."""
    worst = 0.0
    for name, value in params_of(b).items():
        got = params_of(a)[name]
        scale = max(float(np.abs(value).max(initial=0.0)), 1e-12)
        worst = max(worst, float(np.abs(got - value).max(initial=0.0)) / scale)
    return worst


def assert_ranks_identical(reports: Sequence[dict[str, Any]]) -> None:
    """Every rank ended with bitwise the same parameters."""
    first = params_of(reports[0])
    for rank, report in enumerate(reports[1:], start=1):
        for name, value in params_of(report).items():
            np.testing.assert_array_equal(value, first[name], err_msg=f"rank {rank}: {name}")


@contextlib.contextmanager
def private_tmpfs(path: Path, size: str) -> Iterator[Path]:
    """A tmpfs of `size` (mount's syntax, e.g. "256k") mounted at `path` for the block.

    Needs root (CAP_SYS_ADMIN); the caller skips when `mount` refuses.
    """
    path.mkdir(parents=True, exist_ok=True)
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size},mode=1777", "tmpfs", str(path)],
        capture_output=True,
        text=True,
        timeout=10,
    )
    if mounted.returncode != 0:
        raise PermissionError(f"cannot mount a tmpfs at {path}: {mounted.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "--lazy", str(path)], capture_output=True, timeout=10)


def used_bytes(path: Path) -> int:
    """Bytes in use on the filesystem holding `path` (0 on an empty tmpfs)."""
    stats = os.statvfs(path)
    return (stats.f_blocks - stats.f_bfree) * stats.f_frsize


def can_mount_tmpfs(scratch: Path) -> tuple[bool, str]:
    """Whether this process may mount a tmpfs (root in CI); else the skip reason."""
    try:
        with private_tmpfs(scratch / "probe", "64k"):
            return True, ""
    except PermissionError as exc:
        return False, f"needs root to mount a private tmpfs: {exc}"
