"""Ranks of a torch.distributed script over one backend, for the backend's tests.

A script under support/workers runs once over "gloo" and once over "gradsync";
`start_backend_ranks` starts every rank of one run (the highest rank first, each
`start_apart_s` after the one above it, its output captured), and
`finish_backend_runs` waits for one or more runs, fails naming every rank that
exited otherwise than expected (with its output), and returns what each rank
saved to <out>/rank<r>.npz.
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gradsync_proto.net.launch import free_port

from support.processes import launch_captured, launch_ranks, reap


@dataclass(frozen=True)
class BackendRun:
    """The started ranks of one run of a script over one backend."""

    backend: str
    out: Path
    world: int
    processes: dict[int, subprocess.Popen[str]]


def start_backend_ranks(
    script: Path,
    backend: str,
    scenario: str,
    world: int,
    out: Path,
    coordinator: str,
    *extra: str,
    start_apart_s: float,
    per_rank: dict[int, list[str]] | None = None,
) -> BackendRun:
    """Start every rank of `script`'s `scenario` over `backend`, the highest rank first.

    Args:
        script: a worker taking --coordinator, --rank, --world-size, --out, --backend,
            --scenario, --master-port (torch's TCPStore) and --start-delay-s.
        backend: "gloo" or "gradsync".
        world: the group's size.
        out: the folder the ranks save to (made here).
        coordinator: the coordinator's "host:port" ("unused:1" over gloo).
        extra: flags every rank gets.
        start_apart_s: rank r starts (world - 1 - r) * start_apart_s after the first.
        per_rank: further flags of single ranks.
    """
    out.mkdir(parents=True, exist_ok=True)
    order = list(reversed(range(world)))
    more = per_rank or {}
    started = launch_ranks(
        script,
        coordinator,
        world,
        lambda rank: out / f"rank{rank}.npz",
        "--backend",
        backend,
        "--scenario",
        scenario,
        "--master-port",
        str(free_port()),
        *extra,
        per_rank={
            r: [
                "--start-delay-s",
                str(start_apart_s * (world - 1 - r)),
                *more.get(r, []),
            ]
            for r in order
        },
        ranks=order,
        launch=launch_captured,
    )
    return BackendRun(backend, out, world, dict(zip(order, started, strict=True)))


def finish_backend_runs(
    *runs: BackendRun, timeout_s: float = 180, expect_exit: dict[int, int] | None = None
) -> list[list[dict[str, Any]]]:
    """Wait for every rank of `runs` (each within `timeout_s`); return, run by run, what
    each rank saved, in rank order (an empty dict for a rank that saved nothing).

    Args:
        expect_exit: a rank's expected exit status by rank, in every run (default 0).

    Raises:
        AssertionError: a rank exited with another status (its output is in the message).
    """
    try:
        texts = {
            (index, rank): process.communicate(timeout=timeout_s)[0]
            for index, run in enumerate(runs)
            for rank, process in run.processes.items()
        }
    finally:
        reap(process for run in runs for process in run.processes.values())
    expected = expect_exit or {}
    failed = [
        f"{run.backend} rank {rank} (exit {process.returncode}):\n{texts[index, rank]}"
        for index, run in enumerate(runs)
        for rank, process in run.processes.items()
        if process.returncode != expected.get(rank, 0)
    ]
    assert not failed, "\n".join(failed)
    saved = []
    for run in runs:
        ranks: list[dict[str, Any]] = []
        for rank in range(run.world):
            path = run.out / f"rank{rank}.npz"
            if path.exists():
                with np.load(path) as data:
                    ranks.append(dict(data))
            else:
                ranks.append({})
        saved.append(ranks)
    return saved
