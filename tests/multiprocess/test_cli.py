"""The `gradsync` command: flag errors, signals, status, serve lifecycle (health, SIGTERM), demo.

Every flag error exits 2 at once naming the flag, with no traceback; every
exit path (a flag error, SIGINT or SIGTERM while a worker waits, a status
query to a dead address) is free of asyncio's leaked-task noise.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
from gradsync.status import query_status
from gradsync_proto.net.launch import free_port
from grpc_health.v1 import health_pb2, health_pb2_grpc
from support.faults import wait_for
from support.logwatch import WatchedProcess, assert_quiet

GRADSYNC = [sys.executable, "-m", "gradsync.cli"]
#: Env vars that would change what a flag defaults to; every test starts without them.
FLAG_ENV = ("GRADSYNC_COORDINATOR", "GRADSYNC_JOB_ID", "RANK", "WORLD_SIZE", "LOCAL_RANK")


def clean_env(**extra: str) -> dict[str, str]:
    env = {key: value for key, value in os.environ.items() if key not in FLAG_ENV}
    env.update(extra)
    return env


def run_cli(
    *args: str, timeout: float = 60, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*GRADSYNC, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env if env is not None else clean_env(),
    )


WORKER = ["worker", "--coordinator", "127.0.0.1:1", "--rank", "0", "--world-size", "1"]
SERVE = ["serve", "--world-size", "2"]

#: (argv, the flag the error must name, another phrase it must contain)
FLAG_ERRORS = [
    # global
    (["--log-level", "LOUD", "status"], "--log-level", "invalid choice"),
    (["bogus"], "command", "invalid choice"),
    # serve
    (["serve"], "--world-size", "required"),
    (["serve", "--world-size", "0"], "--world-size", "must be >= 1"),
    ([*SERVE, "--port", "70000"], "--port", "0..65535"),
    ([*SERVE, "--port", "http"], "--port", "expected an integer"),
    ([*SERVE, "--host", ""], "--host", "must not be empty"),
    ([*SERVE, "--chunk-mb", "0.001"], "--chunk-mb", "chunk size"),
    ([*SERVE, "--chunk-mb", "inf"], "--chunk-mb", "finite"),
    ([*SERVE, "--max-buffered-mb", "0.5"], "--max-buffered-mb", "--chunk-mb"),
    ([*SERVE, "--max-jobs", "0"], "--max-jobs", "must be >= 1"),
    ([*SERVE, "--shutdown-grace-s", "-1"], "--shutdown-grace-s", "must be >= 0"),
    ([*SERVE, "--heartbeat-interval", "0"], "--heartbeat-interval", "must be > 0"),
    ([*SERVE, "--heartbeat-interval", "6"], "--heartbeat-interval", "--heartbeat-timeout"),
    ([*SERVE, "--heartbeat-timeout", "nan"], "--heartbeat-timeout", "finite"),
    ([*SERVE, "--stall-warning", "0"], "--stall-warning", "must be > 0"),
    ([*SERVE, "--checkpoint-store", "localhost:6379"], "--checkpoint-store", "redis://"),
    ([*SERVE, "--checkpoint-every", "-1"], "--checkpoint-every", "must be >= 0"),
    ([*SERVE, "--checkpoint-every", "3"], "--checkpoint-store", "need"),
    ([*SERVE, "--metrics-port", "99999"], "--metrics-port", "0..65535"),
    ([*SERVE, "--on-failure", "retry"], "--on-failure", "invalid choice"),
    ([*SERVE, "--min-workers", "3"], "--min-workers", "--world-size 2"),
    ([*SERVE, "--max-collective-mb", "0"], "--max-collective-mb", "must be > 0"),
    (
        [*SERVE, "--checkpoint-store", "ckpt", "--fresh-start", "--resume"],
        "--fresh-start",
        "contradict",
    ),
    ([*SERVE, "--store-timeout", "0"], "--store-timeout", "must be > 0"),
    ([*SERVE, "--redis-password-file", "/nonexistent/pw"], "--redis-password-file", "cannot read"),
    # worker
    (["worker", "--rank", "0", "--world-size", "2"], "--coordinator", "HOST:PORT"),
    ([*WORKER, "--coordinator", "http://h:50051"], "--coordinator", "has a scheme"),
    ([*WORKER, "--coordinator", "h:0"], "--coordinator", "outside 1..65535"),
    ([*WORKER, "--coordinator", "h:65536"], "--coordinator", "outside 1..65535"),
    ([*WORKER, "--coordinator", "h"], "--coordinator", "has no port"),
    ([*WORKER, "--coordinator", ":50051"], "--coordinator", "empty host"),
    ([*WORKER, "--rank", "-1"], "--rank", "must be >= 0"),
    ([*WORKER, "--rank", "3", "--world-size", "2"], "--rank", "out of range"),
    ([*WORKER, "--world-size", "0"], "--world-size", "must be >= 1"),
    ([*WORKER, "--job-id", ""], "--job-id", "must not be empty"),
    ([*WORKER, "--epochs", "0"], "--epochs", "must be >= 1"),
    ([*WORKER, "--batch-size", "0"], "--batch-size", "must be >= 1"),
    ([*WORKER, "--batch-size", "5000"], "--batch-size", "training samples"),
    ([*WORKER, "--lr", "-1"], "--lr", "must be > 0"),
    ([*WORKER, "--timeout-s", "0"], "--timeout-s", "must be > 0"),
    ([*WORKER, "--timeout-s", "1e300"], "--timeout-s", "must be <="),
    ([*WORKER, "--init-seed", "-1"], "--init-seed", "0..9223372036854775807"),
    ([*WORKER, "--save", "/nonexistent-dir/x.npz"], "--save", "does not exist"),
    ([*WORKER, "--save", "out-{epoch}.npz"], "--save", "only {rank} is replaced"),
    ([*WORKER, "--metrics-port", "70000"], "--metrics-port", "0..65535"),
    ([*WORKER, "--trace", "/nonexistent-dir/t.json"], "--trace", "does not exist"),
    ([*WORKER, "--log-every-steps", "-1"], "--log-every-steps", "must be >= 0"),
    # status
    (["status"], "--coordinator", "HOST:PORT"),
    (["status", "--coordinator", "[::1]"], "--coordinator", "has no port"),
    (["status", "--coordinator", "h:1", "--timeout-s", "-2"], "--timeout-s", "must be > 0"),
    # demo
    (["demo", "--workers", "-1"], "--workers", "must be >= 1"),
    (["demo", "--workers", "60"], "--workers", "training samples"),
    (["demo", "--lr", "nan"], "--lr", "finite"),
    (["demo", "--diloco", "0"], "--diloco", "must be >= 1"),
    # bench
    (["bench", "--suites", "loopback,gpu"], "--suites", "unknown ['gpu']"),
    (["bench", "--sizes-mb", "1,0"], "--sizes-mb", "must be > 0"),
    (["bench", "--worlds", "2,x"], "--worlds", "expected an integer"),
    (["bench", "--reps", "0"], "--reps", "must be >= 1"),
    (["bench", "--train-model-mb", "-1"], "--train-model-mb", "must be > 0"),
    (["bench", "--train-steps", "0"], "--train-steps", "must be >= 1"),
    (["bench", "--netns-rate-mbit", "0"], "--netns-rate-mbit", "must be > 0"),
    (["bench", "--wan-methods", "nosync,ring"], "--wan-methods", "unknown ['ring']"),
    (["bench", "--wan-steps", "0"], "--wan-steps", "must be >= 1"),
    (["bench", "--wan-quality-steps", "-1"], "--wan-quality-steps", "must be >= 0"),
    (["bench", "--wan-rates", "100,0"], "--wan-rates", "must be > 0"),
]


@pytest.mark.parametrize(
    ("args", "flag", "needle"), FLAG_ERRORS, ids=[" ".join(case[0]) for case in FLAG_ERRORS]
)
def test_every_flag_error_exits_2_at_once_naming_the_flag(
    args: list[str], flag: str, needle: str
) -> None:
    started = time.monotonic()
    result = run_cli(*args, timeout=30)
    assert result.returncode == 2, result.stderr
    assert flag in result.stderr and needle in result.stderr, result.stderr
    assert_quiet(result.stderr, " ".join(args))
    assert time.monotonic() - started < 15  # at once: before any connection attempt


@pytest.mark.parametrize(
    ("env", "argv", "flag", "needle"),
    [
        (
            {"GRADSYNC_COORDINATOR": "http://h:1"},
            ["--rank", "0", "--world-size", "2"],
            "--coordinator",
            "has a scheme",
        ),
        ({"RANK": "zero"}, ["--coordinator", "h:1", "--world-size", "2"], "--rank", "integer"),
        ({"WORLD_SIZE": "0"}, ["--coordinator", "h:1", "--rank", "0"], "--world-size", ">= 1"),
    ],
)
def test_bad_env_var_defaults_are_flag_errors(
    env: dict[str, str], argv: list[str], flag: str, needle: str
) -> None:
    # The variable supplies what its flag would; argparse checks it with the flag's type.
    result = run_cli("worker", *argv, env=clean_env(**env))
    assert result.returncode == 2, result.stderr
    assert flag in result.stderr and needle in result.stderr, result.stderr
    assert_quiet(result.stderr, str(env))


def test_serve_that_cannot_bind_says_where_without_a_traceback() -> None:
    # --insecure: without it, protected mode refuses a non-loopback host first (exit 2).
    result = run_cli(*SERVE, "--host", "nosuchhost.invalid", "--port", "0", "--insecure")
    assert result.returncode == 1, result.stderr
    assert "cannot listen on --host nosuchhost.invalid --port 0" in result.stderr
    assert_quiet(result.stderr, "serve")


def _worker(address: str, world_size: int = 2, *extra: str) -> WatchedProcess:
    return WatchedProcess(
        [
            *GRADSYNC,
            "worker",
            "--coordinator",
            address,
            "--rank",
            "0",
            "--world-size",
            str(world_size),
            "--epochs",
            "1",
            "--no-progress",
            *extra,
        ],
        name="worker rank 0",
    )


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
@pytest.mark.parametrize("reachable", [True, False], ids=["waiting", "unreachable"])
def test_a_signalled_worker_exits_with_one_line_and_no_noise(
    coordinator_factory, signum: signal.Signals, reachable: bool
) -> None:
    # Reachable: rank 1 never comes, so rank 0 waits for it. Unreachable: nothing listens.
    address = coordinator_factory(2).address if reachable else f"127.0.0.1:{free_port()}"
    worker = _worker(address)
    try:
        worker.wait_for("joining job", timeout_s=30)
        time.sleep(1.0)  # well inside the wait for the job (or the coordinator)
        worker.process.send_signal(signum)
        code, text = worker.finish(timeout_s=20)
    finally:
        worker.kill()
    assert code == 128 + signum, text
    assert f"gradsync worker: stopped by {signum.name}" in text
    assert_quiet(text, "the worker")


def test_status_of_a_dead_address_fails_quietly() -> None:
    address = f"127.0.0.1:{free_port()}"
    result = run_cli("status", "--coordinator", address, "--timeout-s", "2", timeout=30)
    assert result.returncode == 1
    assert f"gradsync status: no status from {address}" in result.stderr
    assert_quiet(result.stderr, "status")


@pytest.mark.timeout(90)
def test_status_shows_waiting_and_ended_jobs_with_integers_as_numbers(
    coordinator_factory, tmp_path: Path
) -> None:
    coordinator = coordinator_factory(2)
    done = [
        _worker(coordinator.address, 2, "--job-id", "done", "--rank", str(rank))
        for rank in range(2)
    ]
    for worker in done:
        code, text = worker.finish(timeout_s=60)
        assert code == 0, text
    waiting = _worker(coordinator.address, 2, "--job-id", "waiting")
    try:
        waiting.wait_for("joining job", timeout_s=30)
        wait_for(
            lambda: any(job.members for job in query_status(coordinator.address, "waiting").jobs),
            30,
            "job 'waiting' to list the rank that joined it",
        )
        result = run_cli("status", "--coordinator", coordinator.address, "--json")
        text = run_cli("status", "--coordinator", coordinator.address).stdout
    finally:
        waiting.kill()
    assert result.returncode == 0, result.stderr
    jobs = {job["jobId"]: job for job in json.loads(result.stdout)["jobs"]}
    assembling = jobs["waiting"]
    for key in ("openStep", "stepsCompleted", "membershipEpoch", "lastCheckpointStep"):
        assert type(assembling[key]) is int, (key, assembling[key])
    assert assembling["lastCheckpointStep"] == -1
    assert [type(member["reportedStep"]) for member in assembling["members"]] == [int]
    assert "job 'waiting': assembling" in text and "waiting for ranks [1] of 2" in text
    # A finished job is kept for a while with its outcome (1437 // 64 = 22 steps of one epoch).
    finished = jobs["done"]
    assert finished["ended"] is True and finished["state"] == "finished", finished
    assert finished["stepsCompleted"] == 22
    assert "job 'done': ended" in text and "(finished)" in text


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
    assert_quiet(log, "the coordinator")
    assert time.monotonic() - started < 20


def test_worker_fails_clearly_when_no_coordinator_listens() -> None:
    address = f"127.0.0.1:{free_port()}"
    result = run_cli(
        *WORKER[:2], address, *WORKER[3:], "--timeout-s", "2", "--no-progress", timeout=60
    )
    assert result.returncode == 1
    assert f"could not reach the coordinator at {address}" in result.stderr
    assert "connection refused" in result.stderr
    assert_quiet(result.stderr, "the worker")


@pytest.mark.timeout(180)
def test_demo_trains_and_matches_single_process() -> None:
    result = run_cli("demo", "--workers", "2", "--epochs", "2", timeout=170)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "OK: 2 workers trained the same model as a single process" in result.stdout
    accuracy = float(result.stdout.split("distributed test accuracy: ")[1].split()[0])
    assert accuracy > 0.8
    assert "rank 0 training" in result.stderr  # the progress bar is on rank 0
    assert_quiet(result.stderr, "the demo")


@pytest.mark.timeout(180)
def test_demo_diloco_trains_every_h_steps_and_matches_its_simulation() -> None:
    result = run_cli("demo", "--workers", "2", "--epochs", "2", "--diloco", "7", timeout=170)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "DiLoCo, a round every 7 steps" in result.stdout
    assert "OK: 2 workers trained the same model as a single process" in result.stdout
    accuracy = float(result.stdout.split("distributed test accuracy: ")[1].split()[0])
    assert accuracy > 0.8
    assert_quiet(result.stderr, "the demo")
