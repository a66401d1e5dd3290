"""The `gradsync` command: flag errors, serve lifecycle (health, SIGTERM), demo."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

GRADSYNC = [sys.executable, "-m", "gradsync.cli"]


def run_cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*GRADSYNC, *args], capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["serve"], "--world-size"),
        (["serve", "--world-size", "0"], "must be >= 1"),
        (["serve", "--world-size", "2", "--port", "70000"], "0..65535"),
        (["serve", "--world-size", "2", "--chunk-mb", "0.001"], "chunk size"),
        (["worker", "--rank", "0", "--world-size", "2"], "--coordinator"),
        (["worker", "--coordinator", "h:1", "--rank", "3", "--world-size", "2"], "out of range"),
        (["demo", "--workers", "-1"], "must be >= 1"),
        (["bogus"], "invalid choice"),
    ],
)
def test_bad_flags_exit_nonzero_with_a_clear_message(args: list[str], needle: str) -> None:
    result = run_cli(*args)
    assert result.returncode == 2
    assert needle in result.stderr


def test_serve_reports_health_and_drains_on_sigterm(coordinator_factory) -> None:
    coordinator = coordinator_factory(3, "--shutdown-grace-s", "1")
    banner = "".join(coordinator.startup_lines)
    assert "world size 3" in banner and "chunk 1 MiB" in banner and "max buffered" in banner
    with grpc.insecure_channel(coordinator.address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        for service in ("", "gradsync.v1.Coordinator"):
            reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
    started = time.monotonic()
    coordinator.process.send_signal(signal.SIGTERM)
    code, log = coordinator.stop(signal_first=False)
    assert code == 0, log
    assert "shutting down" in log
    assert time.monotonic() - started < 20


def test_worker_fails_clearly_when_no_coordinator_listens() -> None:
    # Port 1 on loopback: nothing listens there (and binding it needs root).
    result = run_cli(
        "worker",
        "--coordinator",
        "127.0.0.1:1",
        "--rank",
        "0",
        "--world-size",
        "1",
        "--timeout-s",
        "2",
        "--no-progress",
    )
    assert result.returncode == 1
    assert "could not reach the coordinator at 127.0.0.1:1" in result.stderr


@pytest.mark.timeout(180)
def test_demo_trains_and_matches_single_process() -> None:
    result = run_cli("demo", "--workers", "2", "--epochs", "2", timeout=170)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "OK: 2 workers trained the same model as a single process" in result.stdout
    accuracy = float(result.stdout.split("distributed test accuracy: ")[1].split()[0])
    assert accuracy > 0.8
    assert "rank 0 training" in result.stderr  # the progress bar is on rank 0
