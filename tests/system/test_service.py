"""Running gradsync like a service: Prometheus scraping real processes, step traces,
torchrun as the launcher, and the docker-compose topology rebuilt from network namespaces."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import threading
import time
from pathlib import Path
from urllib.parse import urlsplit

import numpy as np
import pytest
import yaml
from gradsync.example import (
    TrainSettings,
    global_batches,
    load_digits,
    max_relative_difference,
    train_reference,
)
from gradsync_bench.netns import Cluster
from gradsync_proto.net.launch import free_port, parse_banner
from prometheus_client.parser import text_string_to_metric_families
from support.components import (
    NO_PROMETHEUS,
    NO_REDIS_SERVER,
    PROMETHEUS,
    REDIS_SERVER,
    netns_available,
)
from support.compose import VARIANTS, command_argv, load_compose
from support.processes import reap, start_workers, wait_all
from support.promserver import PrometheusServer

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(120)
@pytest.mark.skipif(PROMETHEUS is None, reason=NO_PROMETHEUS)
def test_prometheus_scrapes_a_running_coordinator_and_workers(
    coordinator_factory, tmp_path: Path, layout: str
) -> None:
    # Hierarchical (the default, both ranks one local group): only rank 0 uploads, yet
    # the lag of rank 1 is exported too, from its LocalPosted notices.
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
        reap(processes)
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


def use_compose_token(
    services: dict[str, dict[str, object]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Do what compose's `token-init` does, here: run its command to write the token, and
    give every process the path the gradsync services get in $GRADSYNC_TOKEN_FILE."""
    init = compose_command(services["token-init"])
    in_container = init[1]
    token_file = tmp_path / "token"
    argv = [str(token_file) if arg == in_container else arg for arg in init]
    subprocess.run([sys.executable, "-m", "gradsync.cli", *argv], check=True, timeout=60)
    for name, service in services.items():
        if "build" in service and not name.endswith("token-init"):
            environment = service.get("environment") or {}
            assert environment.get("GRADSYNC_TOKEN_FILE") == in_container, name  # type: ignore[union-attr]
    monkeypatch.delenv("GRADSYNC_TOKEN", raising=False)
    monkeypatch.setenv("GRADSYNC_TOKEN_FILE", str(token_file))
    if "shard-token-init" in services:
        # The sharded variant's second secret, for the leader and the shards (the workers
        # of this test inherit the variable too, and never read it).
        init = compose_command(services["shard-token-init"])
        in_container, shard_token_file = init[1], tmp_path / "shard-token"
        argv = [str(shard_token_file) if arg == in_container else arg for arg in init]
        subprocess.run([sys.executable, "-m", "gradsync.cli", *argv], check=True, timeout=60)
        for name in ("coordinator", "shard-1", "shard-2"):
            environment = services[name].get("environment") or {}
            assert environment.get("GRADSYNC_SHARD_TOKEN_FILE") == in_container, name  # type: ignore[union-attr]
        assert "GRADSYNC_SHARD_TOKEN_FILE" not in (services["worker-0"].get("environment") or {})  # type: ignore[operator]
        monkeypatch.delenv("GRADSYNC_SHARD_TOKEN", raising=False)
        monkeypatch.setenv("GRADSYNC_SHARD_TOKEN_FILE", str(shard_token_file))


def resolve_service_names(argv: list[str], addresses: dict[str, str]) -> list[str]:
    """Replace compose service names by their hosts' addresses, as compose's DNS would.

    Only a URL's host (`redis://redis:6379/0`) or a whole `host:port` argument is
    replaced; a URL's scheme that happens to be a service name stays as it is.
    """
    resolved = []
    for arg in argv:
        if "://" in arg:
            parts = urlsplit(arg)
            if parts.hostname in addresses:
                userinfo, at, hostport = parts.netloc.rpartition("@")
                port = hostport[len(parts.hostname) :]
                netloc = f"{userinfo}{at}{addresses[parts.hostname]}{port}"
                arg = parts._replace(netloc=netloc).geturl()
        elif (match := re.fullmatch(r"([\w.-]+)(:\d+)", arg)) and match[1] in addresses:
            arg = addresses[match[1]] + match[2]
        resolved.append(arg)
    return resolved


def test_service_names_resolve_to_addresses_and_keep_url_schemes() -> None:
    addresses = {"redis": "10.0.0.3", "coordinator": "10.0.0.2"}
    argv = ["--checkpoint-store", "redis://redis:6379/0", "--coordinator", "coordinator:50051"]
    assert resolve_service_names(argv, addresses) == [
        "--checkpoint-store",
        "redis://10.0.0.3:6379/0",
        "--coordinator",
        "10.0.0.2:50051",
    ]
    assert resolve_service_names(["redis://user:pw@redis:6379/1"], addresses) == [
        "redis://user:pw@10.0.0.3:6379/1"
    ]
    untouched = ["--name", "redis", "worker-redis:1", "file:///redis:6379"]
    assert resolve_service_names(untouched, addresses) == untouched


#: Reads what the coordinator left in Redis (run on an emulated host, which alone can reach
#: the Redis host): the job's checkpoint keys, its `latest` pointer and each blob's size.
REDIS_KEYS = """
import json, sys
import redis
client = redis.Redis.from_url(sys.argv[1], socket_timeout=10)
prefix = f"gradsync:ckpt:{sys.argv[2]}:"
keys = sorted(key.decode() for key in client.scan_iter(match=prefix + "*"))
latest = client.get(prefix + "latest")
print(json.dumps({
    "keys": keys,
    "latest": latest.decode() if latest is not None else None,
    "steps": [int(step) for step in client.zrange(prefix + "steps", 0, -1)],
    "sizes": {key: client.strlen(key) for key in keys if key[len(prefix):].isdigit()},
}))
"""


@pytest.mark.timeout(240)
@pytest.mark.skipif(not netns_available()[0], reason=netns_available()[1])
@pytest.mark.skipif(REDIS_SERVER is None, reason=NO_REDIS_SERVER)
def test_compose_topology_on_emulated_hosts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The compose file's services, each on its own host, running the compose commands;
    the coordinator's checkpoints land in the Redis host."""
    pytest.importorskip("redis", reason="the redis package is not installed: gradsync[redis]")
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]
    use_compose_token(compose, tmp_path, monkeypatch)
    workers = sorted(name for name in compose if name.startswith("worker-"))
    hosts = ["coordinator", "redis", *workers]
    with Cluster(hosts) as cluster:
        addresses = {host: cluster.address(host) for host in hosts}
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
        coordinator_argv = resolve_service_names(compose_command(compose["coordinator"]), addresses)
        store_url = coordinator_argv[coordinator_argv.index("--checkpoint-store") + 1]
        assert store_url == f"redis://{addresses['redis']}:6379/0", store_url
        every = int(coordinator_argv[coordinator_argv.index("--checkpoint-every") + 1])
        coordinator = cluster.popen(
            "coordinator",
            [sys.executable, "-m", "gradsync.cli", *coordinator_argv],
            stderr=subprocess.PIPE,
            text=True,
        )
        assert coordinator.stderr is not None
        log_lines: list[str] = []
        # Drain the coordinator's log so its pipe never fills; keep it for diagnostics.
        reader = threading.Thread(target=lambda: log_lines.extend(coordinator.stderr), daemon=True)  # type: ignore[arg-type]
        reader.start()
        deadline = time.monotonic() + 60
        while not any(parse_banner(line) for line in log_lines):
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
        # Enough epochs for the coordinator to checkpoint at least once (every `every` steps).
        one_epoch = TrainSettings(world_size=len(workers), epochs=1)
        steps_per_epoch = len(global_batches(len(load_digits().train_x), one_epoch))
        epochs = -(-every // steps_per_epoch)
        processes = [
            cluster.popen(
                name,
                [
                    sys.executable,
                    "-m",
                    "gradsync.cli",
                    "--log-level",
                    "WARNING",
                    *resolve_service_names(compose_command(compose[name]), addresses),
                    "--epochs",
                    str(epochs),
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
        try:
            for process in processes:
                output, _ = process.communicate(timeout=180)
                assert process.returncode == 0, output[-3000:]
        finally:
            reap(processes)
        saved = [dict(np.load(tmp_path / f"{name}.npz")) for name in workers]
        for params in saved[1:]:
            for name, value in params.items():
                np.testing.assert_array_equal(value, saved[0][name])
        coordinator.terminate()
        assert coordinator.wait(timeout=30) == 0, "".join(log_lines)[-3000:]
        stored = subprocess.run(
            cluster.command(
                "coordinator", [sys.executable, "-c", REDIS_KEYS, store_url, "default"]
            ),
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert stored.returncode == 0, stored.stderr
        found = json.loads(stored.stdout)
        redis.terminate()
        redis.wait(timeout=30)
    # The checkpoints are in Redis, under the job's keys: a pointer, the set of steps and
    # one non-empty blob per kept step, the pointer naming the newest.
    steps = found["steps"]
    assert steps and all(step % every == 0 for step in steps), found
    assert found["latest"] == str(max(steps)), found
    prefix = "gradsync:ckpt:default:"
    assert set(found["keys"]) == {f"{prefix}latest", f"{prefix}steps"} | {
        f"{prefix}{step}" for step in steps
    }, found
    assert all(size > 0 for size in found["sizes"].values()), found


#: Run on an emulated host: the leader's Prometheus text (which carries every shard's counters).
SCRAPE = """
import sys, urllib.request
print(urllib.request.urlopen(sys.argv[1], timeout=10).read().decode())
"""


def start_logged(
    cluster: Cluster, host: str, argv: list[str]
) -> tuple[subprocess.Popen[str], list[str]]:
    """Start a gradsync command on `host`; its log lines are drained into the returned list."""
    process = cluster.popen(
        host,
        [sys.executable, "-m", "gradsync.cli", *argv],
        stderr=subprocess.STDOUT,
        stdout=subprocess.PIPE,
        text=True,
    )
    lines: list[str] = []
    assert process.stdout is not None
    threading.Thread(target=lambda: lines.extend(process.stdout), daemon=True).start()  # type: ignore[arg-type]
    return process, lines


@pytest.mark.timeout(240)
@pytest.mark.skipif(not netns_available()[0], reason=netns_available()[1])
@pytest.mark.skipif(REDIS_SERVER is None, reason=NO_REDIS_SERVER)
def test_sharded_compose_topology_on_emulated_hosts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """docker-compose.yml + docker-compose.sharded.yml, each service on its own host running
    its compose command: the workers, which know only the leader, train through every shard
    (each received and sent gradient bytes), and match single-process training."""
    pytest.importorskip("redis", reason="the redis package is not installed: gradsync[redis]")
    compose = load_compose(*VARIANTS["sharded"])["services"]
    use_compose_token(compose, tmp_path, monkeypatch)
    workers = sorted(name for name in compose if name.startswith("worker-"))
    shards = sorted(name for name in compose if command_argv(compose[name])[:1] == ["shard"])
    assert len(shards) == 2, shards
    hosts = ["coordinator", "redis", *shards, *workers]
    logs: dict[str, list[str]] = {}
    with Cluster(hosts) as cluster:
        addresses = {host: cluster.address(host) for host in hosts}
        cluster.popen(
            "redis",
            [
                str(REDIS_SERVER),
                *command_argv(compose["redis"])[1:],
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
        leader_argv = resolve_service_names(command_argv(compose["coordinator"]), addresses)
        assert "--wait-for-shards" in leader_argv
        leader, logs["coordinator"] = start_logged(cluster, "coordinator", leader_argv)
        for name in shards:
            argv = resolve_service_names(command_argv(compose[name]), addresses)
            # The shard advertises its own host (compose: its service name) to the workers.
            assert f"{addresses[name]}:50051" in argv, argv
            _, logs[name] = start_logged(cluster, name, argv)

        def diagnostics() -> str:
            return "\n".join(f"--- {h}\n" + "".join(lines[-40:]) for h, lines in logs.items())

        deadline = time.monotonic() + 60
        while not any(parse_banner(line) for line in logs["coordinator"]):
            assert time.monotonic() < deadline and leader.poll() is None, diagnostics()
            time.sleep(0.05)
        processes = [
            cluster.popen(
                name,
                [
                    sys.executable,
                    "-m",
                    "gradsync.cli",
                    "--log-level",
                    "WARNING",
                    *resolve_service_names(command_argv(compose[name]), addresses),
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
        try:
            for process in processes:
                output, _ = process.communicate(timeout=180)
                assert process.returncode == 0, output[-3000:] + diagnostics()
        finally:
            reap(processes)
        leader_address = f"{addresses['coordinator']}:50051"
        status = subprocess.run(
            cluster.command(
                workers[0],
                [
                    sys.executable,
                    "-m",
                    "gradsync.cli",
                    "status",
                    "--coordinator",
                    leader_address,
                    "--json",
                ],
            ),
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert status.returncode == 0, status.stderr + diagnostics()
        metrics_port = leader_argv[leader_argv.index("--metrics-port") + 1]
        scraped = subprocess.run(
            cluster.command(
                workers[0],
                [
                    sys.executable,
                    "-c",
                    SCRAPE,
                    f"http://{addresses['coordinator']}:{metrics_port}/metrics",
                ],
            ),
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert scraped.returncode == 0, scraped.stderr
    reported = {shard.get("index", 0): shard for shard in json.loads(status.stdout)["shards"]}
    assert set(reported) == {0, 1, 2}, reported
    advertised = {f"{addresses[name]}:50051" for name in shards}
    assert {reported[1]["address"], reported[2]["address"]} == advertised, reported
    for index, shard in reported.items():
        # Every shard holds part of every bucket, so each one carried gradients both ways.
        assert shard["alive"] and shard["bytesReceived"] > 0 and shard["bytesSent"] > 0, (
            index,
            shard,
        )
    counters = {
        (family.name, sample.labels.get("shard")): sample.value
        for family in text_string_to_metric_families(scraped.stdout)
        for sample in family.samples
        if sample.name.startswith("gradsync_shard")
    }
    for index in ("0", "1", "2"):
        assert counters[("gradsync_shard_bytes_received", index)] > 0, counters
        assert counters[("gradsync_shard_up", index)] == 1, counters
    # The shards change where bytes are averaged, not the result: single-process training.
    reference, _ = train_reference(TrainSettings(world_size=len(workers), epochs=1), init_seed=1000)
    saved = [dict(np.load(tmp_path / f"{name}.npz")) for name in workers]
    for params in saved:
        assert max_relative_difference(reference, params) <= 1e-5
    for params in saved[1:]:
        for name, value in params.items():
            np.testing.assert_array_equal(value, saved[0][name])
