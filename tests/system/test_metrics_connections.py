"""The /metrics endpoint keeps answering scrapes while strangers hold connections to it.

A scrape port is reachable by whoever can reach the host, without credentials
(SECURITY.md, "Metrics binding"). Connections that never send a request, or drip
it a byte at a time, must not take the threads that answer Prometheus: the
scrapes below run, over real sockets, while such connections are held open, and
those connections are dropped at the request deadline or evicted when more of
them arrive than the endpoint keeps.
"""

from __future__ import annotations

import contextlib
import select
import socket
import time
import urllib.request

import pytest
from gradsync_proto.net.exposition import serve_metrics
from prometheus_client import CollectorRegistry, Counter

pytestmark = pytest.mark.timeout(60)

#: Silent connections held open while scraping: four times the old pool of four threads.
SILENT_CONNECTIONS = 16
#: Scrapes made while they are held; every one must succeed.
SCRAPES = 8


def _registry() -> CollectorRegistry:
    registry = CollectorRegistry()
    Counter("gradsync_probe", "A counter the scrapes look for.", registry=registry).inc()
    return registry


def _scrape(url: str) -> tuple[str, float]:
    """One scrape: ("200", seconds) on success, else (the error, seconds)."""
    started = time.monotonic()
    try:
        with urllib.request.urlopen(url, timeout=5) as reply:
            body = reply.read().decode()
            outcome = str(reply.status) if "gradsync_probe_total 1.0" in body else body
    except OSError as exc:
        outcome = repr(exc)
    return outcome, time.monotonic() - started


def _closed_by_peer(connection: socket.socket) -> bool:
    """Whether the server closed this connection (EOF or reset), without blocking."""
    readable, _, _ = select.select([connection], [], [], 0)
    if not readable:
        return False
    try:
        return connection.recv(1) == b""
    except ConnectionResetError:
        return True


def test_scrapes_succeed_while_silent_connections_are_held() -> None:
    with serve_metrics(0, _registry(), host="127.0.0.1") as server:
        silent = [
            socket.create_connection(("127.0.0.1", server.port), timeout=5)
            for _ in range(SILENT_CONNECTIONS)
        ]
        try:
            time.sleep(0.3)  # every one of them accepted and waiting for its request
            outcomes = [_scrape(server.url) for _ in range(SCRAPES)]
            held = sum(not _closed_by_peer(connection) for connection in silent)
        finally:
            for connection in silent:
                connection.close()
    failed = [outcome for outcome in outcomes if outcome[0] != "200"]
    assert not failed, f"{len(failed)} of {SCRAPES} scrapes failed: {failed}"
    assert max(seconds for _, seconds in outcomes) < 2.0, outcomes
    assert held == SILENT_CONNECTIONS, f"only {held} silent connections were held: too few tested"


def test_silent_and_dripping_connections_are_dropped_at_the_request_deadline() -> None:
    from gradsync_proto.net.exposition import REQUEST_READ_TIMEOUT_S

    give_up_after_s = 3 * REQUEST_READ_TIMEOUT_S
    request = b"GET /metrics HTTP/1.0\r\nX-Slow: " + b"a" * 200
    with serve_metrics(0, _registry(), host="127.0.0.1") as server:
        started = time.monotonic()
        silent = socket.create_connection(("127.0.0.1", server.port), timeout=5)
        dripping = socket.create_connection(("127.0.0.1", server.port), timeout=5)
        closed_after: dict[str, float] = {}
        try:
            for byte in request:  # one byte every 0.1 s: each read is quick, the whole is not
                for name, connection in (("silent", silent), ("dripping", dripping)):
                    if name not in closed_after and _closed_by_peer(connection):
                        closed_after[name] = time.monotonic() - started
                if len(closed_after) == 2 or time.monotonic() - started > give_up_after_s:
                    break
                with contextlib.suppress(OSError):  # closed: seen at the next look
                    dripping.send(bytes([byte]))
                time.sleep(0.1)
        finally:
            silent.close()
            dripping.close()
        assert _scrape(server.url)[0] == "200"
    assert set(closed_after) == {"silent", "dripping"}, closed_after
    for name, seconds in closed_after.items():
        assert REQUEST_READ_TIMEOUT_S - 0.2 <= seconds <= REQUEST_READ_TIMEOUT_S + 1.0, (
            f"the {name} connection was closed after {seconds:.2f} s"
        )


def test_beyond_the_pending_cap_the_oldest_idle_connection_makes_room() -> None:
    from gradsync_proto.net.exposition import MAX_PENDING_CONNECTIONS

    with serve_metrics(0, _registry(), host="127.0.0.1") as server:
        silent = [
            socket.create_connection(("127.0.0.1", server.port), timeout=5)
            for _ in range(MAX_PENDING_CONNECTIONS + 8)
        ]
        try:
            time.sleep(0.3)
            outcome, seconds = _scrape(server.url)
            assert outcome == "200" and seconds < 2.0, (outcome, seconds)
            time.sleep(0.1)
            assert _closed_by_peer(silent[0]), "the oldest idle connection was kept"
            assert not _closed_by_peer(silent[-1]), "the newest idle connection was evicted"
        finally:
            for connection in silent:
                connection.close()
