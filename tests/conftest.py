"""Shared fixtures: real coordinator processes on free ports, worker launchers."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
from redisserver import NO_REDIS_SERVER, REDIS_SERVER, RedisServer

BANNER = re.compile(r"listening on (\S+):(\d+)")
WORKER_SCRIPT = Path(__file__).parent / "workers" / "train_worker.py"


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
            match = BANNER.search(line)
            if match:
                self.port = int(match.group(2))
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


@pytest.fixture
def coordinator_factory() -> Iterator[type[CoordinatorProcess]]:
    """Start coordinators on demand; every one is stopped after the test."""
    started: list[CoordinatorProcess] = []

    def start(world_size: int, *extra: str) -> CoordinatorProcess:
        coordinator = CoordinatorProcess(world_size, *extra)
        started.append(coordinator)
        return coordinator

    yield start  # type: ignore[misc]
    for coordinator in started:
        coordinator.stop()


def run_workers(
    address: str,
    world_size: int,
    scenario: str,
    out_dir: Path,
    *extra: str,
    timeout_s: float = 90.0,
) -> list[dict[str, np.ndarray]]:
    """Run `world_size` worker processes of tests/workers/train_worker.py; return their outputs."""
    env = dict(os.environ, PYTHONWARNINGS="error")
    processes = [
        subprocess.Popen(
            [
                sys.executable,
                str(WORKER_SCRIPT),
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


@pytest.fixture
def redis_server_factory(tmp_path: Path) -> Iterator[Callable[..., RedisServer]]:
    """Start real redis-servers on demand; every one is stopped after the test."""
    if REDIS_SERVER is None:
        pytest.skip(NO_REDIS_SERVER)
    pytest.importorskip("redis", reason="the redis package is not installed: gradsync[redis]")
    started: list[RedisServer] = []

    def start(name: str = "redis", *durability_args: str) -> RedisServer:
        server = RedisServer(tmp_path / name, *durability_args)
        started.append(server)
        return server

    yield start
    for server in started:
        if server.process is not None and server.process.poll() is None:
            server.process.send_signal(signal.SIGCONT)  # in case a test left it stopped
        server.stop()


@pytest.fixture
def redis_server(redis_server_factory: Callable[..., RedisServer]) -> RedisServer:
    """A redis-server with the append-only file fsync'd on every write."""
    return redis_server_factory()
