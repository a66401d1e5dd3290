"""Launching tests/workers/fault_worker.py ranks: shared by the fault and service tests."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

FAULT_WORKER = Path(__file__).parent / "workers" / "fault_worker.py"


def start_workers(
    address: str,
    world_size: int,
    out: Path,
    steps: int,
    per_rank: dict[int, list[str]] | None = None,
    *extra: str,
    launch: Callable[[int, list[str]], subprocess.Popen[bytes]] | None = None,
    ranks: list[int] | None = None,
) -> list[subprocess.Popen[bytes]]:
    processes = []
    for rank in range(world_size) if ranks is None else ranks:
        argv = [
            sys.executable,
            str(FAULT_WORKER),
            "--coordinator",
            address,
            "--rank",
            str(rank),
            "--world-size",
            str(world_size),
            "--steps",
            str(steps),
            "--out",
            str(out / f"rank{rank}.json"),
            *extra,
            *(per_rank or {}).get(rank, []),
        ]
        if launch is not None:
            processes.append(launch(rank, argv))
        else:
            processes.append(
                subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            )
    return processes
