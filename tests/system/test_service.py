"""Running gradsync like a service: Prometheus scraping real processes, step traces,
torchrun as the launcher, and the docker-compose topology rebuilt from network namespaces."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import yaml
from gradsync.bench.netns import Cluster, available
from gradsync.example import TrainSettings, max_relative_difference, train_reference
from support.faultworkers import start_workers
from support.promserver import NO_PROMETHEUS, PROMETHEUS, PrometheusServer
from support.redisserver import NO_REDIS_SERVER, REDIS_SERVER, free_port

ROOT = Path(__file__).resolve().parents[2]


def wait_all(processes: list[subprocess.Popen[bytes]], timeout_s: float = 90) -> None:
    try:
        for process in processes:
            assert process.wait(timeout=timeout_s) == 0
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait()


@pytest.mark.timeout(120)
@pytest.mark.skipif(PROMETHEUS is None, reason=NO_PROMETHEUS)
def test_prometheus_scrapes_a_running_coordinator_and_workers(
    coordinator_factory, tmp_path: Path
) -> None:
    coordinator_port = free_port()
    coordinator = coordinator_factory(2, "--metrics-port", str(coordinator_port))
    assert f"metrics http://127.0.0.1:{coordinator_port}/metrics" in "".join(
        coordinator.startup_lines
    )
    worker_ports = [free_port(), free_port()]
    prometheus = PrometheusServer(
        tmp_path / "prometheus",
        [f"127.0.0.1:{p}" for p in [coordinator_port, *worker_ports]],
    )
    processes: list[subprocess.Popen[bytes]] = []
    try:
        processes = start_workers(
            coordinator.address,
            2,
            tmp_path,
            40,
            {r: ["--metrics-port", str(p)] for r, p in enumerate(worker_ports)},
            "--step-delay-s",
            "0.15",
        )

        def series(expression: str) -> list[tuple[dict[str, str], float]]:
            return prometheus.values(expression)

        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            steps = series("gradsync_steps_completed_total")
            worker_steps = series("gradsync_worker_steps_total")
            if (
                steps
                and steps[0][1] >= 5
                and len(worker_steps) == 2
                and min(value for _, value in worker_steps) >= 5
            ):
                break
            time.sleep(0.5)
        else:
            raise AssertionError(f"no plausible series; targets: {prometheus.targets()}")
        (received,) = series("gradsync_received_bytes_total")
        (sent,) = series("gradsync_sent_bytes_total")
        # Every averaged byte goes to both ranks: the coordinator sends what it receives.
        assert received[1] > 0 and sent[1] > 0
        lags = {
            labels["rank"]: value for labels, value in series("gradsync_rank_lag_seconds_count")
        }
        assert set(lags) == {"0", "1"} and min(lags.values()) > 0
        exposed = series("gradsync_worker_exposed_comm_seconds_count")
        assert {labels["rank"] for labels, _ in exposed} == {"0", "1"}
        (alive,) = series("gradsync_workers_alive")
        assert alive[1] == 2
        p95 = series("histogram_quantile(0.95, gradsync_step_sync_seconds_bucket)")
        assert p95 and 0 < p95[0][1] < 10, p95
        wait_all(processes)
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait()
        prometheus.stop()


@pytest.mark.timeout(90)
def test_step_trace_shows_overlapped_buckets_in_order(coordinator_factory, tmp_path: Path) -> None:
    coordinator = coordinator_factory(2)
    trace = tmp_path / "trace.json"
    wait_all(start_workers(coordinator.address, 2, tmp_path, 3, {0: ["--trace", str(trace)]}))
    events = json.loads(trace.read_text())
    names = {e["args"]["name"] for e in events if e["ph"] == "M"}
    assert {"autograd", "transport", "rank 0"} <= names
    for step in range(3):
        mine = [e for e in events if e.get("args", {}).get("step") == step]
        (backward,) = [e for e in mine if e["name"] == "backward"]
        (wait,) = [e for e in mine if e["name"] == "wait for averages"]
        ready = {e["args"]["bucket"]: e for e in mine if e["name"].startswith("ready")}
        uploads = {e["args"]["bucket"]: e for e in mine if e["name"].startswith("upload")}
        averaged = {e["args"]["bucket"]: e for e in mine if e["name"].startswith("until averaged")}
        assert len(ready) >= 3 and set(ready) == set(uploads) == set(averaged)
        end = backward["ts"] + backward["dur"]
        assert backward["ts"] <= wait["ts"] and wait["ts"] + wait["dur"] <= end + 1
        for bucket, mark in ready.items():
            upload, result = uploads[bucket], averaged[bucket]
            assert backward["ts"] <= mark["ts"] <= upload["ts"] + 1
            assert upload["ts"] + upload["dur"] <= result["ts"] + result["dur"] + 1
            assert result["ts"] + result["dur"] <= end + 1
        # Bucket 0 (the last layers) is ready before backward reaches the first layers.
        assert ready[0]["ts"] < wait["ts"]


@pytest.mark.timeout(180)
def test_torchrun_launches_workers_that_match_single_process(
    coordinator_factory, tmp_path: Path
) -> None:
    coordinator = coordinator_factory(2)
    env = dict(os.environ, GRADSYNC_COORDINATOR=coordinator.address, OMP_NUM_THREADS="1")
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            "2",
            "--master-port",
            str(free_port()),
            "-m",
            "gradsync.cli",
            "--log-level",
            "WARNING",
            "worker",
            "--epochs",
            "1",
            "--no-progress",
            "--save",
            str(tmp_path / "rank{rank}.npz"),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=170,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    settings = TrainSettings(world_size=2, epochs=1)
    reference, _ = train_reference(settings, init_seed=1000)
    saved = [dict(np.load(tmp_path / f"rank{rank}.npz")) for rank in range(2)]
    for params in saved:
        assert max_relative_difference(reference, params) <= 1e-5
    for name in saved[0]:
        np.testing.assert_array_equal(saved[0][name], saved[1][name])


def compose_command(service: dict[str, object]) -> list[str]:
    command = service["command"]
    return shlex.split(command) if isinstance(command, str) else list(command)  # type: ignore[arg-type]


@pytest.mark.timeout(240)
@pytest.mark.skipif(not available()[0], reason=available()[1])
@pytest.mark.skipif(REDIS_SERVER is None, reason=NO_REDIS_SERVER)
def test_compose_topology_on_emulated_hosts(tmp_path: Path) -> None:
    """The compose file's services, each on its own host, running the compose commands."""
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]
    workers = sorted(name for name in compose if name.startswith("worker-"))
    hosts = ["coordinator", "redis", *workers]
    with Cluster(hosts) as cluster:

        def resolve(argv: list[str]) -> list[str]:
            # Compose resolves service names through its DNS; here, by address.
            out = []
            for arg in argv:
                for host in hosts:
                    arg = arg.replace(f"//{host}:", f"//{cluster.address(host)}:")
                    if arg.startswith(f"{host}:"):
                        arg = arg.replace(f"{host}:", f"{cluster.address(host)}:", 1)
                out.append(arg)
            return out

        redis_args = compose_command(compose["redis"])[1:]
        redis = cluster.popen(
            "redis",
            [
                str(REDIS_SERVER),
                *redis_args,
                "--bind",
                "0.0.0.0",
                "--port",
                "6379",
                "--dir",
                str(tmp_path),
                "--protected-mode",
                "no",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        coordinator = cluster.popen(
            "coordinator",
            [
                sys.executable,
                "-m",
                "gradsync.cli",
                *resolve(compose_command(compose["coordinator"])),
            ],
            stderr=subprocess.PIPE,
            text=True,
        )
        assert coordinator.stderr is not None
        log_lines: list[str] = []
        # Drain the coordinator's log so its pipe never fills; keep it for diagnostics.
        reader = threading.Thread(target=lambda: log_lines.extend(coordinator.stderr), daemon=True)  # type: ignore[arg-type]
        reader.start()
        deadline = time.monotonic() + 60
        while not any("listening on" in line for line in log_lines):
            assert time.monotonic() < deadline and coordinator.poll() is None, log_lines
            time.sleep(0.05)
        probe = subprocess.run(
            cluster.command(
                workers[0],
                [
                    sys.executable,
                    "-m",
                    "gradsync.healthcheck",
                    f"{cluster.address('coordinator')}:50051",
                ],
            ),
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert probe.returncode == 0, probe.stdout + probe.stderr
        processes = [
            cluster.popen(
                name,
                [
                    sys.executable,
                    "-m",
                    "gradsync.cli",
                    "--log-level",
                    "WARNING",
                    *resolve(compose_command(compose[name])),
                    "--epochs",
                    "1",
                    "--no-progress",
                    "--save",
                    str(tmp_path / f"{name}.npz"),
                ],
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
            for name in workers
        ]
        for process in processes:
            output, _ = process.communicate(timeout=180)
            assert process.returncode == 0, output[-3000:]
        saved = [dict(np.load(tmp_path / f"{name}.npz")) for name in workers]
        for params in saved[1:]:
            for name, value in params.items():
                np.testing.assert_array_equal(value, saved[0][name])
        coordinator.terminate()
        assert coordinator.wait(timeout=30) == 0
        redis.terminate()
        redis.wait(timeout=30)
