"""Real processes for tests: a `gradsync serve` coordinator and worker ranks.

One launcher for worker ranks (`launch_workers`), one banner parser (the
library's own, `gradsync.launch.parse_banner`) and one `free_port`
(`gradsync.launch.free_port`), shared by every tier that starts processes.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
from gradsync.launch import parse_banner

WORKERS = Path(__file__).parent / "workers"
TRAIN_WORKER = WORKERS / "train_worker.py"
FAULT_WORKER = WORKERS / "fault_worker.py"


class CoordinatorProcess:
    """A `gradsync serve` subprocess bound to a free loopback port."""

    def __init__(self, world_size: int, *extra: str) -> None:
        self.process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "gradsync.cli",
                "serve",
                "--world-size",
                str(world_size),
                "--host",
                "127.0.0.1",
                "--port",
                "0",
                *extra,
            ],
            stderr=subprocess.PIPE,
            text=True,
        )
        assert self.process.stderr is not None
        self.startup_lines: list[str] = []
        for line in self.process.stderr:
            self.startup_lines.append(line)
            banner = parse_banner(line)
            if banner is not None:
                self.port = banner[1]
                break
        else:
            raise RuntimeError(f"coordinator exited early: {''.join(self.startup_lines)}")
        self.address = f"127.0.0.1:{self.port}"

    def stop(self, signal_first: bool = True) -> tuple[int, str]:
        """SIGTERM (unless already sent), wait, and return (exit code, rest of stderr)."""
        if signal_first and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            _, rest = self.process.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            _, rest = self.process.communicate()
        return self.process.returncode, rest


def run_workers(
    address: str,
    world_size: int,
    scenario: str,
    out_dir: Path,
    *extra: str,
    timeout_s: float = 90.0,
) -> list[dict[str, np.ndarray]]:
    """Run `world_size` ranks of `TRAIN_WORKER` to completion; return their saved outputs."""
    env = dict(os.environ, PYTHONWARNINGS="error")
    processes = [
        subprocess.Popen(
            [
                sys.executable,
                str(TRAIN_WORKER),
                "--coordinator",
                address,
                "--rank",
                str(rank),
                "--world-size",
                str(world_size),
                "--scenario",
                scenario,
                "--out",
                str(out_dir / f"rank{rank}.npz"),
                *extra,
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
        )
        for rank in range(world_size)
    ]
    outputs = []
    try:
        texts = [process.communicate(timeout=timeout_s)[0] for process in processes]
        failed = [rank for rank, process in enumerate(processes) if process.returncode != 0]
        assert not failed, "\n".join(f"rank {rank} failed:\n{texts[rank]}" for rank in failed)
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait()
    for rank in range(world_size):
        with np.load(out_dir / f"rank{rank}.npz") as data:
            outputs.append(dict(data))
    return outputs
