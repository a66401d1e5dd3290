"""Connections that never authenticate cannot hold a TLS coordinator's descriptors.

A real `gradsync serve` with TLS (trustme certificates) and a token, flooded with
silent TCP connections that never start their TLS handshake, on both ports. The
frame port counts a connection from its accept, before TLS: one address holds at
most half of them and all addresses `MAX_UNGREETED` (the
oldest dropped beyond either), each for at most the first-message deadline. The
gRPC port closes them at the same deadline (gRPC's own handshake timeout). The
coordinator's descriptors are counted in `/proc/<pid>/fd`, and its refusals are
logged a line at a time, not one per connection.
"""

from __future__ import annotations

import os
import re
import socket
import ssl
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from gradsync_proto.net.frames import HEADER, STATUS, decode_status, hello_frame
from gradsync_server.rpc.frame_server import MAX_LINGERING, MAX_UNGREETED
from gradsync_server.rpc.linger import LINGER_S
from support.processes import CoordinatorProcess

trustme = pytest.importorskip("trustme", reason="trustme is not installed: pip install trustme")

TOKEN = "t0k3n-" + "z" * 26
#: The first-message deadline the coordinator is started with (seconds).
DEADLINE_S = 3.0
#: Silent connections per source address (far beyond the caps).
FLOOD = 200
#: Descriptors the coordinator may hold beyond its idle count while flooded: the
#: ungreeted cap, and room for connections being accepted or closed right then.
FD_SLACK = 16


@pytest.fixture
def secured(tmp_path: Path, request: pytest.FixtureRequest) -> tuple[CoordinatorProcess, Path]:
    extra = getattr(request, "param", ())
    ca = trustme.CA()
    ca_path, server_path, token_path = tmp_path / "ca.pem", tmp_path / "srv.pem", tmp_path / "tok"
    ca.cert_pem.write_to_path(str(ca_path))
    ca.issue_cert("127.0.0.1").private_key_and_cert_chain_pem.write_to_path(str(server_path))
    token_path.write_text(TOKEN + "\n")
    coordinator = CoordinatorProcess(
        2,
        "--tls-cert", str(server_path), "--tls-key", str(server_path),
        "--token-file", str(token_path), "--first-message-timeout-s", str(DEADLINE_S),
        *extra,
    )  # fmt: skip
    yield coordinator, ca_path  # type: ignore[misc]
    coordinator.stop()


def frame_port(coordinator: CoordinatorProcess) -> int:
    match = re.search(r"frames on port (\d+)", "".join(coordinator.startup_lines))
    assert match is not None, coordinator.startup_lines
    return int(match.group(1))


def descriptors(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


@pytest.fixture
def opened() -> Iterator[list[socket.socket]]:
    """Client sockets, closed at the end of the test whatever happened."""
    sockets: list[socket.socket] = []
    yield sockets
    for sock in sockets:
        sock.close()


def flood(port: int, sources: list[str], opened: list[socket.socket]) -> list[socket.socket]:
    """`FLOOD` silent TCP connections to `port` from each source address (into `opened`)."""
    for source in sources:
        for _ in range(FLOOD):
            sock = socket.create_connection(("127.0.0.1", port), 5, (source, 0))
            opened.append(sock)
    return opened


def ended(sock: socket.socket) -> bool:
    """Whether the coordinator has closed `sock` (EOF or reset; never any data)."""
    sock.setblocking(False)
    try:
        data = sock.recv(1)
    except BlockingIOError:
        return False
    except OSError:
        return True
    assert data == b"", "the coordinator sent bytes to a connection that said nothing"
    return True


def wait_until(condition, within_s: float) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.1)
    return bool(condition())


def refused_over_tls(port: int, ca_path: Path) -> str:
    """A TLS client with the wrong token: the STATUS details it is told."""
    context = ssl.create_default_context(cafile=str(ca_path))
    with (
        socket.create_connection(("127.0.0.1", port), 5) as raw,
        context.wrap_socket(raw, server_hostname="127.0.0.1") as tls,
    ):
        tls.settimeout(5)
        tls.sendall(hello_frame("wr0ng-" + "q" * 26))
        received = b""
        while len(received) < HEADER.size or (
            len(received) < HEADER.size + HEADER.unpack(received[: HEADER.size])[1]
        ):
            chunk = tls.recv(65536)
            assert chunk, "closed without a STATUS frame"
            received += chunk
        kind, _ = HEADER.unpack(received[: HEADER.size])
        assert kind == STATUS
        return decode_status(received[HEADER.size :])[1]


@pytest.mark.timeout(90)
def test_silent_connections_to_the_tls_frame_port_are_capped_and_closed_at_the_deadline(
    secured: tuple[CoordinatorProcess, Path], opened: list[socket.socket]
) -> None:
    coordinator, ca_path = secured
    pid, port = coordinator.process.pid, frame_port(coordinator)
    idle = descriptors(pid)
    sources = ["127.0.0.1", "127.0.0.2", "127.0.0.3"]
    started = time.monotonic()
    silent = flood(port, sources, opened)
    # (Accepted in batches: the count settles within a moment of the last connect.)
    bound = idle + MAX_UNGREETED + FD_SLACK
    assert wait_until(lambda: descriptors(pid) <= bound, 1.0), (bound, descriptors(pid))
    # All but the newest few of each address were dropped at once (over the caps).
    # (Within a moment, well before the deadline: the coordinator works through them.)
    over = len(silent) - MAX_UNGREETED - FD_SLACK
    assert wait_until(lambda: sum(ended(sock) for sock in silent) >= over, 1.5), over
    # The rest are closed at the deadline, counted from their accept (not their handshake).
    assert wait_until(lambda: all(ended(sock) for sock in silent), DEADLINE_S + 3)
    assert wait_until(lambda: descriptors(pid) <= idle + 2, 3), (idle, descriptors(pid))
    # The port still speaks TLS to whoever comes next.
    assert "token" in refused_over_tls(port, ca_path)
    code, rest = coordinator.stop()
    refusal_lines = [line for line in rest.splitlines() if "refused" in line]
    # One line per 10 s for hundreds of refusals (the flood took a few seconds).
    elapsed_periods = int((time.monotonic() - started) // 10) + 1
    assert 1 <= len(refusal_lines) <= elapsed_periods + 1, refusal_lines
    assert code == 0, rest[-2000:]


@pytest.mark.timeout(60)
def test_silent_connections_to_the_tls_grpc_port_are_closed_at_the_deadline(
    secured: tuple[CoordinatorProcess, Path], opened: list[socket.socket]
) -> None:
    coordinator, _ = secured
    pid = coordinator.process.pid
    idle = descriptors(pid)
    silent = flood(coordinator.port, ["127.0.0.1"], opened)
    assert wait_until(lambda: descriptors(pid) >= idle + FLOOD - FD_SLACK, 2)  # gRPC holds them
    assert wait_until(lambda: all(ended(sock) for sock in silent), DEADLINE_S + 4)
    assert wait_until(lambda: descriptors(pid) <= idle + 2, 3), (idle, descriptors(pid))


#: A small stream cap, so that the gRPC port's connection cap (2 x it + 64) is small too.
MAX_STREAMS = 8


@pytest.mark.timeout(60)
@pytest.mark.parametrize("secured", [("--max-connections", str(MAX_STREAMS))], indirect=True)
def test_connections_to_the_grpc_port_beyond_its_cap_are_closed_at_accept(
    secured: tuple[CoordinatorProcess, Path], opened: list[socket.socket]
) -> None:
    coordinator, _ = secured
    pid = coordinator.process.pid
    idle = descriptors(pid)
    cap = 2 * MAX_STREAMS + 64
    silent = flood(coordinator.port, ["127.0.0.1"], opened)  # FLOOD > cap
    # Long before the handshake deadline, those over the cap are closed already...
    assert wait_until(lambda: sum(ended(sock) for sock in silent) >= FLOOD - cap, 1.0)
    # ... and the coordinator holds no more than the cap.
    assert descriptors(pid) <= idle + cap + 2, (idle, descriptors(pid))
    assert cap < FLOOD


@pytest.mark.timeout(60)
def test_refused_tls_connections_that_never_answer_the_close_are_capped_and_cut(
    secured: tuple[CoordinatorProcess, Path], opened: list[socket.socket]
) -> None:
    """A wrong token over TLS, then silence: the coordinator's close waits for the peer's
    close_notify (30 s by asyncio's default); those waits count as lingering (capped,
    the oldest cut) and last `LINGER_S` at most."""
    coordinator, ca_path = secured
    pid, port = coordinator.process.pid, frame_port(coordinator)
    idle = descriptors(pid)
    context = ssl.create_default_context(cafile=str(ca_path))
    for _ in range(FLOOD):
        raw = socket.create_connection(("127.0.0.1", port), 5)
        opened.append(raw)
        tls = context.wrap_socket(raw, server_hostname="127.0.0.1")
        opened.append(tls)
        tls.sendall(hello_frame("wr0ng-" + "q" * 26))  # refused; never read, never closed
    bound = idle + MAX_LINGERING + FD_SLACK
    assert wait_until(lambda: descriptors(pid) <= bound, 1.5), (bound, descriptors(pid))
    assert wait_until(lambda: descriptors(pid) <= idle + 2, LINGER_S + 3), descriptors(pid)
