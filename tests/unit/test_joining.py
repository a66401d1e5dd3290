"""Waiting for a job to assemble: heartbeats from the start, progress and reasons in the logs.

A worker may start before its peers or its coordinator. These tests pin down
what it says while it waits (who is missing, who was refused, why the
coordinator cannot be reached, in words) and that it is alive meanwhile
(heartbeats before Welcome), without a coordinator: messages are fed to the
`Inbox` directly and reachability is probed against sockets the test owns.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import socket
import ssl
import threading
import time
from collections.abc import Iterator

import pytest
from gradsync.control.inbox import Inbox
from gradsync.control.joining import wait_for_welcome
from gradsync.control.transport import _HEARTBEAT, Transport
from gradsync.errors import CoordinatorUnavailableError, JoinRefusedError, SyncTimeoutError
from gradsync_proto.net.reachability import describe_connect_error, diagnose
from gradsync_proto.v1 import gradsync_pb2 as pb

pytestmark = pytest.mark.unit


@pytest.fixture
def closed_port() -> Iterator[int]:
    """A loopback port with nothing listening (bound, so nobody else takes it)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        yield sock.getsockname()[1]


@pytest.fixture
def listening_port() -> Iterator[int]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


@pytest.fixture
def plaintext_port() -> Iterator[int]:
    """A TCP server that answers every connection with non-TLS bytes, then hangs up."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    server.settimeout(5)

    def serve() -> None:
        try:
            connection, _ = server.accept()
        except OSError:
            return
        with connection:
            connection.sendall(b"HTTP/1.0 400 Bad Request\r\n\r\n")

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield server.getsockname()[1]
    server.close()
    thread.join(timeout=5)


def test_nothing_listening_is_connection_refused(closed_port: int) -> None:
    assert diagnose("127.0.0.1", closed_port, timeout_s=2) == "connection refused"


def test_an_unknown_host_is_name_not_resolved() -> None:
    reason = diagnose("no-such-host.invalid", 50051, timeout_s=2)
    assert reason is not None and reason.startswith("name not resolved")


def test_a_listening_port_is_reachable(listening_port: int) -> None:
    assert diagnose("127.0.0.1", listening_port, timeout_s=2) is None


def test_tls_to_a_plaintext_server_is_a_failed_handshake(plaintext_port: int) -> None:
    context = ssl.create_default_context()
    reason = diagnose("127.0.0.1", plaintext_port, timeout_s=2, tls=context)
    assert reason is not None and reason.startswith("TLS handshake failed")


@pytest.mark.parametrize(
    ("error", "words"),
    [
        (OSError(errno.ENETUNREACH, "Network is unreachable"), "network unreachable"),
        (OSError(errno.EHOSTUNREACH, "No route to host"), "host unreachable"),
        (TimeoutError("timed out"), "connection timed out"),
        (socket.gaierror(socket.EAI_NONAME, "Name or service not known"), "name not resolved"),
        (ConnectionRefusedError(errno.ECONNREFUSED, "Connection refused"), "connection refused"),
        (OSError(errno.EPIPE, "Broken pipe"), "broken pipe"),
    ],
)
def test_connect_errors_are_put_in_words(error: BaseException, words: str) -> None:
    assert describe_connect_error(error).startswith(words)


def feed(inbox: Inbox, message: pb.CoordinatorMessage, delay_s: float) -> None:
    threading.Timer(delay_s, inbox.on_message, args=(message.SerializeToString(),)).start()


def progress(joined: list[int], missing: list[int], refused: str = "") -> pb.CoordinatorMessage:
    return pb.CoordinatorMessage(
        assembly=pb.AssemblyProgress(
            joined_ranks=joined,
            missing_ranks=missing,
            waited_s=1.0,
            heartbeat_interval_s=0.25,
            refused=refused,
        )
    )


def test_waiting_ranks_log_who_is_missing_and_who_was_refused(
    caplog: pytest.LogCaptureFixture,
) -> None:
    inbox = Inbox("127.0.0.1:1", rank=1)
    feed(inbox, progress([0, 1], [2]), 0.0)
    feed(inbox, progress([0, 1], [2], refused="rank 2: world size 4, the job has 3"), 0.1)
    feed(inbox, pb.CoordinatorMessage(welcome=pb.Welcome(world_size=3)), 0.3)
    with caplog.at_level(logging.INFO, logger="gradsync.client"):
        welcome = wait_for_welcome(inbox, "127.0.0.1:1", 1, 5.0, lambda: True)
    assert welcome.world_size == 3
    infos = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert infos == ["rank 1: waiting for ranks [2] of 3, 0 s of 5 s"]
    assert warnings == [
        "rank 1: the coordinator refused a rank of this job: rank 2: world size 4, the job has 3"
    ]
    assert inbox.heartbeat_interval_s == 0.25


def test_progress_is_repeated_while_nothing_changes(caplog: pytest.LogCaptureFixture) -> None:
    inbox = Inbox("127.0.0.1:1", rank=0)
    feed(inbox, progress([0], [1, 2]), 0.0)
    with (
        caplog.at_level(logging.INFO, logger="gradsync.client"),
        pytest.raises(SyncTimeoutError, match=r"still missing ranks \[1, 2\] of 3"),
    ):
        wait_for_welcome(inbox, "127.0.0.1:1", 0, 1.0, lambda: True, report_every_s=0.3)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) >= 3 and all("waiting for ranks [1, 2] of 3" in line for line in lines)


def test_an_unreachable_coordinator_is_reported_with_the_reason_and_time_left(
    closed_port: int, caplog: pytest.LogCaptureFixture
) -> None:
    target = f"127.0.0.1:{closed_port}"
    inbox = Inbox(target, rank=2)
    started = time.monotonic()
    with (
        caplog.at_level(logging.WARNING, logger="gradsync.client"),
        pytest.raises(CoordinatorUnavailableError) as raised,
    ):
        wait_for_welcome(inbox, target, 2, 1.5, lambda: False, first_report_s=0.1)
    assert time.monotonic() - started < 5
    assert f"at {target} within 1.5s: connection refused" in str(raised.value)
    (line,) = [r.getMessage() for r in caplog.records]
    assert line.startswith(f"rank 2: cannot reach the coordinator at {target} (connection refused)")
    assert "still trying for 1 s of 1.5 s" in line


def test_a_refused_join_ends_the_wait_at_once() -> None:
    inbox = Inbox("127.0.0.1:1", rank=1)
    refusal = JoinRefusedError("INVALID_ARGUMENT: signature mismatch", rank=1)
    threading.Timer(0.1, inbox.stream_ended, args=(refusal,)).start()
    started = time.monotonic()
    with pytest.raises(JoinRefusedError, match="signature mismatch"):
        wait_for_welcome(inbox, "127.0.0.1:1", 1, 10.0, lambda: True)
    assert time.monotonic() - started < 2


def test_heartbeats_start_before_welcome_at_the_coordinators_interval_without_piling_up() -> None:
    transport = Transport("127.0.0.1:1", rank=0)
    try:
        transport._inbox.on_message(progress([0], [1]).SerializeToString())
        assembly = pb.AssemblyProgress(heartbeat_interval_s=0.05)
        transport._inbox.on_message(pb.CoordinatorMessage(assembly=assembly).SerializeToString())

        async def beat_for_a_while() -> int:
            task = asyncio.create_task(transport._send_heartbeats())
            await asyncio.sleep(0.4)  # the first progress said 0.25 s: one beat by now
            task.cancel()
            queued = list(transport._sync._queue)  # (the stream's, before a pipe)
            return sum(item is _HEARTBEAT for item in queued)

        # Nothing consumes the queue (no connection): exactly one beat waits.
        assert transport._run(beat_for_a_while(), timeout_s=5) == 1
    finally:
        transport.close(timeout_s=2)
