"""Shared fixtures (real coordinator processes, real Redis servers) and the test tiers.

Tests live in one folder per tier, and each folder is also a marker, so a
tier runs alone with either `pytest tests/unit` or `pytest -m unit`:

- unit: pure logic, no sockets or processes.
- protocol: an in-process `grpc.aio` coordinator on a free port, real gRPC.
- multiprocess: real `gradsync serve` and worker processes, real signals.
- system: real Redis, Prometheus, network namespaces, the benchmarks.
"""

from __future__ import annotations

import signal
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from support.processes import CoordinatorProcess
from support.redisserver import NO_REDIS_SERVER, REDIS_SERVER, RedisServer


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


TIERS = ("unit", "protocol", "multiprocess", "system")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark every test with its tier, taken from the folder it lives in."""
    for item in items:
        tier = item.path.parent.name
        if tier not in TIERS:
            raise pytest.UsageError(
                f"{item.nodeid}: tests belong in one of the tier folders {TIERS}"
            )
        item.add_marker(getattr(pytest.mark, tier))
