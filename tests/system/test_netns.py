"""gradsync_bench.netns: emulated hosts reach each other, are rate-limited, cut off, leave no trace.

These tests build real network namespaces, so they need root; without it (or on a kernel that
lacks bridges, veths or tbf, or without iproute2) they skip with the reason
`support.components.netns_available()` gives.
"""

from __future__ import annotations

import contextlib
import ipaddress
import subprocess
import sys

import pytest
from gradsync_bench.netns import Cluster
from gradsync_bench.netns_commands import NetnsError
from gradsync_bench.netns_probe import delay_available
from gradsync_bench.netns_shaping import LinkShape
from gradsync_bench.netns_throughput import measure_throughput
from support.components import netns_available

PORT = 7000

# Accepts connections forever and greets each one; prints a line once it listens.
SERVER = """
import socket, sys
srv = socket.create_server((sys.argv[1], int(sys.argv[2])))
print("listening", flush=True)
while True:
    conn, _ = srv.accept()
    conn.sendall(b"hello")
    conn.close()
"""

# One connection attempt per `timeout` seconds, retried for `patience` seconds; prints
# "ok <connect ms> <greeting>" or "fail <exception>".
CLIENT = """
import socket, sys, time
host, port = sys.argv[1], int(sys.argv[2])
timeout, patience = float(sys.argv[3]), float(sys.argv[4])
give_up = time.monotonic() + patience
while True:
    start = time.monotonic()
    try:
        with socket.create_connection((host, port), timeout=timeout) as sock:
            elapsed_ms = (time.monotonic() - start) * 1000
            print("ok", f"{elapsed_ms:.1f}", sock.recv(100).decode())
            break
    except OSError as exc:
        if time.monotonic() >= give_up:
            print("fail", type(exc).__name__, exc)
            break
        time.sleep(0.1)
"""


@pytest.fixture(autouse=True)
def _require_netns() -> None:
    ok, reason = netns_available()
    if not ok:
        pytest.skip(reason)


def start_server(cluster: Cluster, host: str) -> subprocess.Popen[str]:
    server: subprocess.Popen[str] = cluster.popen(
        host,
        [sys.executable, "-c", SERVER, cluster.address(host), str(PORT)],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert server.stdout is not None
    assert server.stdout.readline().strip() == "listening"
    return server


def connect(
    cluster: Cluster, src: str, dst: str, *, timeout: float = 2.0, patience: float = 0.0
) -> str:
    """Run the client on `src` against the server on `dst`; return its one-line verdict."""
    args = [cluster.address(dst), str(PORT), str(timeout), str(patience)]
    client = cluster.popen(
        src,
        [sys.executable, "-c", CLIENT, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    out, err = client.communicate(timeout=timeout + patience + 10)
    assert client.returncode == 0, err
    return str(out).strip()


def present_names() -> set[str]:
    """Namespace names plus root-namespace interface names that exist right now."""
    netns = subprocess.run(
        ["ip", "netns", "list"], capture_output=True, text=True, timeout=10, check=True
    ).stdout
    links = subprocess.run(
        ["ip", "-o", "link", "show"], capture_output=True, text=True, timeout=10, check=True
    ).stdout
    names = {line.split()[0] for line in netns.splitlines() if line.strip()}
    names |= {line.split(":")[1].strip().split("@")[0] for line in links.splitlines()}
    return names


@pytest.mark.timeout(60)
def test_hosts_reach_each_other_by_address() -> None:
    with Cluster(["a", "b", "c"]) as cluster:
        addresses = [cluster.address(host) for host in cluster.hosts]
        assert addresses == ["10.213.0.2", "10.213.0.3", "10.213.0.4"]
        assert all(
            ipaddress.ip_address(a) in ipaddress.ip_network("10.213.0.0/24") for a in addresses
        )
        start_server(cluster, "b")
        assert connect(cluster, "a", "b", patience=10).endswith("hello")
        assert connect(cluster, "c", "b", patience=10).endswith("hello")


@pytest.mark.timeout(60)
def test_rate_limit_caps_single_stream_tcp() -> None:
    rate = 200.0
    measured: list[float] = []
    with Cluster(["a", "b"], LinkShape(rate_mbit=rate)) as cluster:
        for _ in range(2):  # a second try absorbs a hiccup on a busy machine
            measured.append(measure_throughput(cluster, "a", "b", seconds=1.5))
            if 0.6 * rate <= measured[-1] <= 1.1 * rate:
                break
    print(f"configured {rate:g} Mbit/s, measured {', '.join(f'{m:.1f}' for m in measured)}")
    assert 0.6 * rate <= measured[-1] <= 1.1 * rate, measured


@pytest.mark.timeout(60)
def test_set_link_partitions_and_heals() -> None:
    with Cluster(["a", "b"]) as cluster:
        start_server(cluster, "b")
        assert connect(cluster, "a", "b", patience=10).startswith("ok")
        cluster.set_link("b", False)
        verdict = connect(cluster, "a", "b", timeout=1.5)
        assert verdict.startswith("fail"), verdict
        cluster.set_link("b", True)
        assert connect(cluster, "a", "b", patience=10).startswith("ok")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("body_raises", [False, True])
def test_teardown_leaves_nothing_behind(body_raises: bool) -> None:
    class Boom(Exception):
        pass

    expectation = pytest.raises(Boom) if body_raises else contextlib.nullcontext()
    with expectation, Cluster(["a", "b"], LinkShape(rate_mbit=100)) as cluster:
        names = set(cluster.names)
        sleeper = cluster.popen("a", [sys.executable, "-c", "import time; time.sleep(60)"])
        assert names <= present_names()
        if body_raises:
            raise Boom
    assert sleeper.poll() is not None, "popen'ed process survived teardown"
    assert not names & present_names()
    cluster.close()  # idempotent: a second close neither fails nor recreates anything
    assert not names & present_names()


@pytest.mark.timeout(60)
def test_clusters_do_not_collide() -> None:
    with Cluster(["a", "b"]) as first:
        start_server(first, "b")
        # Same subnet, different prefix: an independent second switch.
        with Cluster(["a", "b"]) as second:
            assert second.prefix != first.prefix
            start_server(second, "b")
            assert connect(second, "a", "b", patience=10).endswith("hello")
        # A clashing prefix fails loudly and must not delete the first cluster's objects.
        with pytest.raises(NetnsError, match="File exists"), Cluster(["a"], prefix=first.prefix):
            pass
        assert set(first.names) <= present_names()
        assert connect(first, "a", "b", patience=10).endswith("hello")


@pytest.mark.timeout(60)
def test_delay_and_rate_together() -> None:
    ok, reason = delay_available()
    if not ok:
        pytest.skip(reason)
    rate = 200.0
    with Cluster(["a", "b"], LinkShape(rate_mbit=rate, delay_ms=5)) as cluster:
        start_server(cluster, "b")
        verdict = connect(cluster, "a", "b", patience=10).split()
        assert verdict[0] == "ok"
        # A connect takes one round trip: 4 delayed links (a up, b down, b up, a down).
        assert 18 <= float(verdict[1]) <= 60, verdict
        measured = max(measure_throughput(cluster, "a", "b", seconds=1.5) for _ in range(2))
    assert 0.6 * rate <= measured <= 1.1 * rate, measured
