"""The container health probe (`python -m gradsync.healthcheck`) against real grpc.aio servers:
serving, not serving, unknown service, no health service, nothing listening, and a hung peer."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future
from typing import Any

import grpc
import pytest
from gradsync.healthcheck import COORDINATOR_SERVICE, check, main
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

pytestmark = pytest.mark.timeout(60)

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class AioHealthServer:
    """A grpc.aio server on a free loopback port, on its own loop in a background thread
    (the probe under test is synchronous and blocks its caller)."""

    def __init__(self, with_health_service: bool = True) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.health: health.aio.HealthServicer | None = None
        self.server: grpc.aio.Server
        self.port = self._call(self._start(with_health_service))

    def _call(self, coroutine: Any) -> Any:
        future: Future[Any] = asyncio.run_coroutine_threadsafe(coroutine, self.loop)
        return future.result(timeout=10)

    async def _start(self, with_health_service: bool) -> int:
        self.server = grpc.aio.server()
        if with_health_service:
            self.health = health.aio.HealthServicer()
            health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        port = self.server.add_insecure_port("127.0.0.1:0")
        await self.server.start()
        return port

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def set(self, service: str, status: int) -> None:
        assert self.health is not None
        self._call(self.health.set(service, status))

    def stop(self) -> None:
        self._call(self.server.stop(None))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)
        self.loop.close()


@pytest.fixture
def health_server() -> Iterator[AioHealthServer]:
    server = AioHealthServer()
    yield server
    server.stop()


def probe(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gradsync.healthcheck", *args],
        capture_output=True,
        text=True,
        timeout=30,
    )


def test_the_probe_asks_about_the_service_the_contract_names() -> None:
    assert COORDINATOR_SERVICE == "gradsync.v1.Coordinator"


def test_serving_coordinator_is_healthy(health_server: AioHealthServer) -> None:
    health_server.set(COORDINATOR_SERVICE, SERVING)
    result = check(health_server.address)
    assert result.healthy
    assert (
        result.message == f"service {COORDINATOR_SERVICE!r} at {health_server.address} is SERVING"
    )
    assert main([health_server.address]) == 0
    completed = probe(health_server.address, "--timeout-s", "5")
    assert completed.returncode == 0, completed.stderr
    assert completed.stdout.startswith("healthy:")


def test_draining_coordinator_is_unhealthy(health_server: AioHealthServer) -> None:
    health_server.set(COORDINATOR_SERVICE, SERVING)
    health_server.set(COORDINATOR_SERVICE, NOT_SERVING)
    result = check(health_server.address)
    assert not result.healthy
    assert result.message.endswith("is NOT_SERVING")
    completed = probe(health_server.address)
    assert completed.returncode == 1
    assert "unhealthy:" in completed.stderr and "NOT_SERVING" in completed.stderr


def test_whole_server_status_can_be_asked_for(health_server: AioHealthServer) -> None:
    # grpc's HealthServicer reports the server ("") as SERVING from the start.
    result = check(health_server.address, service="")
    assert result.healthy and "the server" in result.message
    assert probe(health_server.address, "--service", "").returncode == 0


def test_unknown_service_is_unhealthy(health_server: AioHealthServer) -> None:
    # The coordinator's service was never registered: a server that is not a coordinator.
    result = check(health_server.address)
    assert not result.healthy
    assert "NOT_FOUND" in result.message and "is it a gradsync coordinator?" in result.message


def test_server_without_health_service_is_unhealthy() -> None:
    server = AioHealthServer(with_health_service=False)
    try:
        result = check(server.address)
    finally:
        server.stop()
    assert not result.healthy
    assert "has no gRPC health service (UNIMPLEMENTED)" in result.message


def test_nothing_listening_is_unhealthy_at_once() -> None:
    with socket.socket() as placeholder:  # a port nobody listens on
        placeholder.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{placeholder.getsockname()[1]}"
        started = time.monotonic()
        result = check(address, timeout_s=10)
    assert not result.healthy
    assert result.message.startswith(f"cannot reach {address} (UNAVAILABLE")
    assert time.monotonic() - started < 5
    completed = probe(address)
    assert completed.returncode == 1 and "cannot reach" in completed.stderr


def test_hung_peer_fails_within_the_deadline() -> None:
    # Accepts TCP connections and never speaks HTTP/2: only the deadline ends the probe.
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        address = f"127.0.0.1:{listener.getsockname()[1]}"
        started = time.monotonic()
        result = check(address, timeout_s=0.5)
        elapsed = time.monotonic() - started
    assert not result.healthy
    assert result.message == f"no answer from {address} within 0.5s (DEADLINE_EXCEEDED)"
    assert elapsed < 5


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["localhost"], "address 'localhost' has no port"),
        ([":50051"], "address ':50051' has an empty host"),
        (["127.0.0.1:50051", "--timeout-s", "0"], "argument --timeout-s: must be > 0"),
        ([], "the following arguments are required: address"),
    ],
)
def test_bad_arguments_exit_2(args: list[str], needle: str) -> None:
    completed = probe(*args)
    assert completed.returncode == 2
    assert needle in completed.stderr
