"""FrameSocket on a real socket pair: order, writes that never wait, reading, ending."""

from __future__ import annotations

import contextlib
import select
import socket
import ssl
import threading
import time
from collections.abc import Iterator

import pytest
import trustme
from gradsync_proto.codes import Code
from gradsync_proto.net.frame_socket import Framed, FrameSocket
from gradsync_proto.net.frames import HEADER, MESSAGE, STATUS, FrameError, status_frame


class Peer:
    """The other end: reads whole frames on demand, writes raw bytes."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._buffer = bytearray()

    def frame(self, timeout_s: float = 10.0) -> tuple[int, bytes]:
        self.sock.settimeout(timeout_s)
        while True:
            if len(self._buffer) >= HEADER.size:
                kind, length = HEADER.unpack_from(self._buffer)
                if len(self._buffer) >= HEADER.size + length:
                    body = bytes(self._buffer[HEADER.size : HEADER.size + length])
                    del self._buffer[: HEADER.size + length]
                    return kind, body
            chunk = self.sock.recv(1 << 20)
            if not chunk:
                raise EOFError("the FrameSocket closed")
            self._buffer += chunk


class TlsPeer:
    """The other end of a TLS FrameSocket, on one thread: writes `sending` while it reads
    `expected_bytes` of frames, both through one non-blocking SSL object."""

    def __init__(self, sock: ssl.SSLSocket, sending: bytes) -> None:
        self.sock = sock
        self.sending = memoryview(sending)
        self.received = bytearray()
        self.error: BaseException | None = None
        self._thread: threading.Thread | None = None

    def start(self, expected_bytes: int) -> None:
        self._thread = threading.Thread(target=self._run, args=(expected_bytes,), daemon=True)
        self._thread.start()

    def _run(self, expected_bytes: int) -> None:
        try:
            self.sock.setblocking(False)
            deadline = time.monotonic() + 30
            while self.sending or len(self.received) < expected_bytes:
                assert time.monotonic() < deadline, "the peer's exchange took over 30 s"
                select.select([self.sock], [self.sock] if self.sending else [], [], 0.05)
                if self.sending:
                    with contextlib.suppress(ssl.SSLWantReadError, ssl.SSLWantWriteError):
                        self.sending = self.sending[self.sock.send(self.sending[: 1 << 16]) :]
                with contextlib.suppress(ssl.SSLWantReadError, ssl.SSLWantWriteError):
                    while chunk := self.sock.recv(1 << 20):
                        self.received += chunk
        except BaseException as exc:  # reported by finish()
            self.error = exc

    def finish(self, timeout_s: float) -> list[tuple[int, bytes]]:
        """The frames read, once everything was written and read."""
        assert self._thread is not None
        self._thread.join(timeout_s)
        assert not self._thread.is_alive(), "the peer did not finish"
        if self.error is not None:
            raise self.error
        frames, view = [], memoryview(self.received)
        while view:
            kind, length = HEADER.unpack_from(view)
            frames.append((kind, bytes(view[HEADER.size : HEADER.size + length])))
            view = view[HEADER.size + length :]
        return frames


class Ends:
    """What a FrameSocket reported: frames read, and how it was lost."""

    def __init__(self) -> None:
        self.frames: list[tuple[int, bytes, str]] = []
        self.lost: list[BaseException | None] = []
        self.lost_event = threading.Event()
        self.frame_event = threading.Event()

    def on_frame(self, kind: int, body: bytearray) -> None:
        self.frames.append((kind, bytes(body), threading.current_thread().name))
        self.frame_event.set()

    def on_lost(self, exc: BaseException | None) -> None:
        self.lost.append(exc)
        self.lost_event.set()


def _encode(item: object) -> Iterator[bytes]:
    """Items are bytes (one message) or tuples of bytes (several)."""
    if isinstance(item, tuple):
        return iter(item)
    assert isinstance(item, bytes)
    return iter((item,))


@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    left, right = socket.socketpair()
    yield left, right
    for end in (left, right):
        end.close()


def _frame_socket(
    sock: socket.socket,
    ends: Ends,
    limit: int = 1 << 24,
    write_timeout_s: float | None = None,
    name: str = "test",
) -> FrameSocket:
    frames = FrameSocket(
        sock,
        limit,
        ends.on_frame,
        ends.on_lost,
        _encode,
        write_timeout_s=lambda: write_timeout_s,
        name=name,
    )
    frames.start()
    return frames


def _small_buffers(sock: socket.socket) -> None:
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)


def test_small_and_large_items_arrive_whole_and_in_the_order_they_were_put(pair) -> None:
    left, right = pair
    _small_buffers(left)
    ends = Ends()
    frames = _frame_socket(left, ends)
    items: list[object] = []
    for index in range(40):
        size = 3_000_000 if index % 7 == 3 else 10 + index
        body = bytes([index]) * size
        items.append((body, body[:5]) if index % 5 == 0 else body)
    expected: list[bytes] = []
    for index, item in enumerate(items):
        frames.put(item, inline=index % 3 != 0)
        expected.extend(item if isinstance(item, tuple) else (item,))
    peer = Peer(right)
    received = [peer.frame() for _ in expected]
    assert [kind for kind, _ in received] == [MESSAGE] * len(expected)
    assert [body for _, body in received] == expected
    frames.stop()
    assert ends.lost == []


def test_an_inline_put_never_waits_for_a_peer_that_does_not_read(pair) -> None:
    left, right = pair
    _small_buffers(left)
    ends = Ends()
    frames = _frame_socket(left, ends)
    body = b"x" * 8_000_000  # far more than the socket buffers hold
    started = time.monotonic()
    frames.put(body, inline=True)
    frames.put(b"after", inline=True)  # queued behind the rest, not written first
    assert time.monotonic() - started < 1.0
    peer = Peer(right)
    assert peer.frame() == (MESSAGE, body)
    assert peer.frame() == (MESSAGE, b"after")
    frames.stop()


def test_a_framed_item_goes_out_as_it_is_before_what_follows(pair) -> None:
    left, right = pair
    ends = Ends()
    frames = _frame_socket(left, ends)
    frames.put(Framed(status_frame(3, "hello")), inline=True)
    frames.put(b"message", inline=False)
    peer = Peer(right)
    assert peer.frame() == (STATUS, b"\x00\x00\x00\x03hello")
    assert peer.frame() == (MESSAGE, b"message")
    frames.stop()


def test_frames_are_read_in_order_on_the_reader_thread_and_a_clean_close_is_reported(
    pair,
) -> None:
    left, right = pair
    ends = Ends()
    frames = _frame_socket(left, ends)
    bodies = [b"a" * n for n in (0, 1, 70_000, 5, 2_000_000, 3)]
    for body in bodies:
        right.sendall(HEADER.pack(MESSAGE, len(body)) + body)
    right.shutdown(socket.SHUT_WR)
    assert ends.lost_event.wait(10)
    assert [body for _, body, _ in ends.frames] == bodies
    assert {thread for _, _, thread in ends.frames} == {"gradsync-test-read"}
    assert ends.lost == [None]
    assert frames.closed


def test_a_claim_over_the_limit_ends_the_connection_before_it_is_read(pair) -> None:
    left, right = pair
    ends = Ends()
    _frame_socket(left, ends, limit=1000)
    right.sendall(HEADER.pack(MESSAGE, 1001))
    assert ends.lost_event.wait(10)
    (failure,) = ends.lost
    assert isinstance(failure, FrameError) and failure.code == Code.RESOURCE_EXHAUSTED
    assert ends.frames == []


def test_a_cut_frame_and_a_raising_handler_are_reported_as_such(pair) -> None:
    left, right = pair
    ends = Ends()
    _frame_socket(left, ends)
    right.sendall(HEADER.pack(MESSAGE, 10) + b"abc")
    right.shutdown(socket.SHUT_WR)
    assert ends.lost_event.wait(10)
    assert isinstance(ends.lost[0], FrameError) and "middle of a frame" in str(ends.lost[0])

    other_left, other_right = socket.socketpair()
    try:
        broken = Ends()

        def on_frame(kind: int, body: bytearray) -> None:
            raise RuntimeError("a handler's bug")

        broken.on_frame = on_frame  # type: ignore[method-assign]
        _frame_socket(other_left, broken)
        other_right.sendall(HEADER.pack(MESSAGE, 1) + b"x")
        assert broken.lost_event.wait(10)
        assert isinstance(broken.lost[0], RuntimeError)
        assert other_right.recv(10) == b""  # and the connection was dropped
    finally:
        other_left.close()
        other_right.close()


def test_an_encoder_that_raises_ends_the_connection_with_its_error(pair) -> None:
    left, right = pair
    ends = Ends()
    frames = _frame_socket(left, ends)
    frames.put(object(), inline=True)  # _encode asserts bytes
    assert ends.lost_event.wait(10)
    assert isinstance(ends.lost[0], AssertionError)
    frames.put(b"dropped", inline=True)  # after the end: dropped, no error
    assert right.recv(10) == b""


def test_a_write_the_peer_never_takes_ends_after_the_write_timeout(pair) -> None:
    left, _right = pair
    _small_buffers(left)
    ends = Ends()
    frames = _frame_socket(left, ends, write_timeout_s=0.3)
    started = time.monotonic()
    frames.put(b"y" * 8_000_000, inline=False)
    assert ends.lost_event.wait(10)
    assert isinstance(ends.lost[0], TimeoutError)
    assert "0.3s" in str(ends.lost[0])
    assert time.monotonic() - started < 5


def test_stop_ends_both_threads_closes_the_socket_and_reports_nothing(pair) -> None:
    left, _right = pair
    _small_buffers(left)
    ends = Ends()
    frames = _frame_socket(left, ends, name="stopping")  # (its threads' names: this test's)
    frames.put(b"z" * 8_000_000, inline=False)  # the writer thread waits on a full socket
    time.sleep(0.2)
    frames.stop()

    def running() -> list[threading.Thread]:
        return [t for t in threading.enumerate() if t.name.startswith("gradsync-stopping-")]

    deadline = time.monotonic() + 10
    while (running() or left.fileno() != -1) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert running() == []  # both threads ended...
    assert left.fileno() == -1  # ...and the last one out closed the socket
    assert ends.lost == []
    assert frames.closed
    frames.put(b"after", inline=True)  # dropped


def test_threads_putting_at_once_get_whole_frames_each_in_its_own_order(pair) -> None:
    left, right = pair
    _small_buffers(left)
    ends = Ends()
    frames = _frame_socket(left, ends)
    senders, per_sender = 4, 60

    def send(sender: int) -> None:
        for sequence in range(per_sender):
            size = 1_000_000 if sequence % 3 == 0 else 100 + sequence  # partial writes, often
            header = f"{sender}:{sequence}:".encode()
            frames.put(header + b"." * size, inline=True)

    threads = [threading.Thread(target=send, args=(sender,)) for sender in range(senders)]
    peer = Peer(right)
    for thread in threads:
        thread.start()
    seen: dict[int, list[int]] = {sender: [] for sender in range(senders)}
    for _ in range(senders * per_sender):
        kind, body = peer.frame()
        sender, sequence, rest = body.split(b":", 2)
        assert kind == MESSAGE and set(rest) == {ord(".")}  # no other frame's bytes inside
        seen[int(sender)].append(int(sequence))
    for thread in threads:
        thread.join(10)
    assert seen == {sender: list(range(per_sender)) for sender in range(senders)}
    frames.stop()


def test_a_write_that_finds_the_peer_gone_still_lets_its_last_frames_be_read() -> None:
    """The coordinator writes its StreamEnd and status, then closes (a reset: it left
    bytes unread). A heartbeat written after that fails; the frames already in the
    receive buffer must still be read, before the loss is reported (CI, stop 42: both
    workers took a --require-checkpoint refusal for a lost coordinator)."""
    server = socket.create_server(("127.0.0.1", 0))
    left = socket.create_connection(server.getsockname())
    right, _ = server.accept()
    server.close()
    try:
        left.sendall(b"bytes the peer never reads")
        time.sleep(0.1)
        last_words = [b"stream end", b"and its reason"]
        for body in last_words:
            right.sendall(HEADER.pack(MESSAGE, len(body)) + body)
        right.close()  # unread bytes: a reset, not a clean close
        time.sleep(0.1)
        ends = Ends()
        frames = FrameSocket(left, 1 << 20, ends.on_frame, ends.on_lost, _encode, name="reset")
        frames.put(b"a heartbeat", inline=True)  # fails: the connection was reset
        assert ends.lost == []  # not reported by the writer...
        frames.put(b"dropped", inline=True)  # (nothing more is written)
        frames.start()
        assert ends.lost_event.wait(10)
        # ...but by the reader, once it read what the peer sent before it went.
        assert [body for _, body, _ in ends.frames] == last_words
        assert len(ends.lost) == 1
    finally:
        left.close()
        right.close()


def test_a_tls_socket_carries_frames_both_ways_while_both_threads_run() -> None:
    """One SSL object, read and written by two threads at once under the socket's lock:
    small and large items out (inline and by the writer thread) while frames come in."""
    ca = trustme.CA()
    server_context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("127.0.0.1").configure_cert(server_context)
    client_context = ssl.create_default_context()
    ca.configure_trust(client_context)
    listener = socket.create_server(("127.0.0.1", 0))
    plain = socket.create_connection(listener.getsockname())
    accepted, _ = listener.accept()
    listener.close()
    handshake = threading.Thread(
        target=lambda: client_box.append(
            client_context.wrap_socket(plain, server_hostname="127.0.0.1")
        )
    )
    client_box: list[ssl.SSLSocket] = []
    handshake.start()
    right = server_context.wrap_socket(accepted, server_side=True)
    handshake.join(10)
    left = client_box[0]
    incoming = [bytes([index]) * (10 + index * 40_000) for index in range(30)]
    outgoing = [bytes([index]) * (2_000_000 if index % 4 == 1 else 100) for index in range(20)]
    # The peer writes `incoming` and reads the frames of `outgoing` at the same time, from one
    # thread: an SSL object is not safe to read and write from two threads without a lock.
    pump = TlsPeer(right, b"".join(HEADER.pack(MESSAGE, len(b)) + b for b in incoming))
    try:
        ends = Ends()
        frames = _frame_socket(left, ends)
        pump.start(expected_bytes=sum(HEADER.size + len(body) for body in outgoing))
        for index, body in enumerate(outgoing):
            frames.put(body, inline=index % 2 == 0)
        assert pump.finish(30) == [(MESSAGE, body) for body in outgoing]
        deadline = time.monotonic() + 10
        while len(ends.frames) < len(incoming) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert [body for _, body, _ in ends.frames] == incoming
        frames.stop()
        assert ends.lost == []
    finally:
        right.close()
        left.close()
