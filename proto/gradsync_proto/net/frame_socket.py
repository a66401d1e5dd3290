"""A worker's frame connection served by threads: written by whoever sends, read by one thread.

Why not the event loop: with the loop as the socket's owner, every
step of a small model costs a worker two cross-thread hand-overs. The training
thread wakes the loop to write its bucket (`call_soon_threadsafe`, the loop's
self-pipe, a queue and a writer task), and the loop wakes the training thread
with the average. With 17 processes on two cores, those wake-ups and the
loop's bookkeeping around them cost a worker more CPU than its own Python
(measured: the transport loop took a third of a W = 16 worker's CPU for two
messages a step).

`FrameSocket` owns one connected, non-blocking TCP socket, plain or TLS:

- **writes** happen on the thread that sends when the item is small and
  nothing is queued before it: it is encoded and handed to the kernel with a
  non-blocking `sendmsg`, so the sender never waits. Whatever the kernel does
  not take at once, a large item, and every item behind one go to a writer
  thread, which waits for the socket (bounded) and keeps the order;
- **reads** happen on a reader thread, which parses frames with the same
  `FrameReader` as the coordinator's frame server (claims over the limit
  refused before they are allocated) and hands each one to `on_frame` on
  that thread;
- **ending**: `on_lost` is called once, from the reader or writer thread,
  with why (None for a clean EOF); `stop` wakes both threads, which then
  end, and the last one out closes the socket. A write that finds the
  connection broken does not end it by itself: the peer's last words (a
  coordinator's StreamEnd and status, written just before it closed) may still
  wait in the receive buffer, and the reader reads them first (bounded by
  `DRAIN_AFTER_BROKEN_WRITE_S`). Ending at once lost them, so a worker took a
  refusal for a lost coordinator and reconnected.

A TLS socket (an `ssl.SSLSocket`, its handshake done) is read and written
the same way, each call into its SSL object under one lock: one OpenSSL
connection must not be read and written by two threads at once. The calls
never wait (the socket is non-blocking), so the lock is held only while
bytes are copied and ciphered. A TLS frame below a chunk's size is joined to
its header (one record instead of two).
"""

from __future__ import annotations

import collections
import contextlib
import logging
import select
import socket
import ssl
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from gradsync_proto.net.frames import HEADER, JOIN_BELOW_BYTES, MESSAGE, FrameReader

log = logging.getLogger("gradsync.net")

__all__ = ["FrameSocket", "Framed"]

#: How often a thread waiting on the socket looks whether it was stopped.
_POLL_SLICE_MS = 500

#: After a write found the connection broken, how long the reader may still read
#: what the peer sent before it went (it normally sees the end at once).
DRAIN_AFTER_BROKEN_WRITE_S = 2.0

#: What a non-blocking call raises when the socket (or TLS) cannot go on now.
_WOULD_BLOCK = (BlockingIOError, InterruptedError, ssl.SSLWantReadError, ssl.SSLWantWriteError)


class Framed:
    """Bytes that are already one or more whole frames (a HELLO): written as they are."""

    __slots__ = ("data",)

    def __init__(self, data: bytes) -> None:
        self.data = data


class _Rest:
    """What an inline write left to the writer thread: the unsent bytes, then more messages."""

    __slots__ = ("buffers", "messages")

    def __init__(self, buffers: list[memoryview], messages: Iterator[bytes]) -> None:
        self.buffers = buffers
        self.messages = messages


class FrameSocket:
    """One connected socket carrying frames, read and written by threads.

    Args:
        sock: connected (an `ssl.SSLSocket` after its handshake, for TLS); made
            non-blocking here, owned from now on.
        max_body_bytes: the longest frame body read (a longer claim ends the connection).
        on_frame: each frame's (kind, body), in order, on the reader thread.
        on_lost: once, with why the connection ended (None: the peer closed it
            cleanly), on the reader or writer thread. Not called after `stop`.
        encode: the wire messages (MESSAGE bodies) of an item given to `put`.
        write_timeout_s: the longest the writer thread waits for the socket to
            take more bytes (None: unbounded); read at each wait.
        name: for thread names and log messages.
    """

    def __init__(
        self,
        sock: socket.socket,
        max_body_bytes: int,
        on_frame: Callable[[int, bytearray], None],
        on_lost: Callable[[BaseException | None], None],
        encode: Callable[[Any], Iterable[bytes]],
        *,
        write_timeout_s: Callable[[], float | None] = lambda: None,
        name: str = "frames",
    ) -> None:
        sock.setblocking(False)
        self._sock = sock
        #: TLS: every call into the SSL object holds it (None: a plain socket).
        self._tls_lock = threading.Lock() if isinstance(sock, ssl.SSLSocket) else None
        # (its `on_lost`: a bad frame, a raising `on_frame`, or the end)
        self._reader = FrameReader(max_body_bytes, on_frame, self._lose)
        self._on_lost = on_lost
        self._encode = encode
        self._write_timeout_s = write_timeout_s
        self.name = name
        self._lock = threading.Lock()
        self._wake_writer = threading.Condition(self._lock)
        #: Items (and an inline write's rest) waiting for the writer thread, in order.
        self._pending: collections.deque[Any] = collections.deque()
        #: A thread is writing to the socket (only one ever does).
        self._busy = False
        self._stopped = False
        self._lost = False
        #: A write found the connection broken (reset, or a closed pipe), and when:
        #: nothing more is written; the reader reads to the end, then reports.
        self._broken: OSError | None = None
        self._broken_at = 0.0
        self._threads_left = 2
        self._threads = [
            threading.Thread(target=self._read_loop, name=f"gradsync-{name}-read", daemon=True),
            threading.Thread(target=self._write_loop, name=f"gradsync-{name}-write", daemon=True),
        ]

    # ------------------------------------------------------------ public API
    def start(self) -> None:
        """Start the reader and writer threads."""
        for thread in self._threads:
            thread.start()

    @property
    def closed(self) -> bool:
        """Stopped, or the connection is gone."""
        return self._stopped or self._lost

    def put(self, item: Any, *, inline: bool) -> None:
        """Write `item`'s messages after everything put before it (any thread; never blocks).

        With `inline` (a small item) and nothing queued, the calling thread hands
        the bytes to the kernel itself, without waiting; otherwise, and for what
        the kernel did not take at once, the writer thread does. Dropped once
        the connection is closed.
        """
        with self._lock:
            if self._stopped or self._lost or self._broken is not None:
                return
            if self._busy or self._pending or not inline:
                self._pending.append(item)
                if not self._busy:
                    self._wake_writer.notify()
                return
            self._busy = True
        rest: _Rest | None = None
        failure: BaseException | None = None
        try:
            rest = self._write_without_waiting(item)
        except Exception as exc:  # a broken connection, or an encoder's bug
            failure = exc
        with self._lock:
            if rest is not None:
                self._pending.appendleft(rest)
            self._busy = False
            if self._pending:
                self._wake_writer.notify()
            self._close_if_done()
        if failure is not None:
            self._write_failed(failure)

    def stop(self) -> None:
        """End both threads (they close the socket); `on_lost` is not called any more."""
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
            self._pending.clear()
            self._wake_writer.notify_all()
        self._shutdown()  # wakes a thread waiting in poll

    # ------------------------------------------------------------ writing
    def _unsent(self, item: Any) -> _Rest:
        """What writing `item` means: bytes as they are, then messages to frame.

        Called only when the item is written, so that an encoder reads its state
        (a heartbeat's step) then, not when the item was put.
        """
        if isinstance(item, _Rest):
            return item
        if isinstance(item, Framed):
            return _Rest([memoryview(item.data)], iter(()))
        return _Rest([], iter(self._encode(item)))

    def _frame_buffers(self, raw: bytes) -> list[memoryview]:
        """A MESSAGE frame as buffers (no copy of the body, but a small TLS one's)."""
        header = HEADER.pack(MESSAGE, len(raw))
        if self._tls_lock is not None and len(raw) < JOIN_BELOW_BYTES:
            return [memoryview(header + raw)]
        return [memoryview(header), memoryview(raw)]

    def _write_without_waiting(self, item: Any) -> _Rest | None:
        """Send what the kernel takes now; return the rest (None: all of it went)."""
        unsent = self._unsent(item)
        buffers = self._send_some(unsent.buffers)
        while not buffers:  # all of it went: on to the next message
            raw = next(unsent.messages, None)
            if raw is None:
                return None
            buffers = self._send_some(self._frame_buffers(raw))
        return _Rest(buffers, unsent.messages)

    def _send_some(self, buffers: list[memoryview]) -> list[memoryview]:
        """Non-blocking sends while the kernel takes bytes; the rest.

        Plain: one `sendmsg` of all buffers at a time. TLS: the first buffer
        (OpenSSL retries a write that could not go on with the same bytes,
        which the first unsent buffer is).
        """
        lock = self._tls_lock
        while buffers:
            try:
                if lock is None:
                    sent = self._sock.sendmsg(buffers)
                else:
                    with lock:
                        sent = self._sock.send(buffers[0])
            except _WOULD_BLOCK:
                return buffers
            buffers = _skip(buffers, sent)
        return buffers

    def _write_loop(self) -> None:
        try:
            while True:
                with self._lock:
                    while self._busy or not self._pending:
                        if self._stopped or self._lost or self._broken is not None:
                            return
                        self._wake_writer.wait()
                    item = self._pending.popleft()
                    self._busy = True
                try:
                    self._write_waiting(item)
                finally:
                    with self._lock:
                        self._busy = False
        except Exception as exc:
            self._write_failed(exc)
        finally:
            self._thread_done()

    def _write_waiting(self, item: Any) -> None:
        """Write all of `item`, waiting (bounded) whenever the socket is full."""
        unsent = self._unsent(item)
        self._send_all(unsent.buffers)
        for raw in unsent.messages:
            self._send_all(self._frame_buffers(raw))

    def _send_all(self, buffers: list[memoryview]) -> None:
        poller = _poller(self._sock, select.POLLOUT)
        while True:
            buffers = self._send_some(buffers)
            if not buffers:
                return
            self._wait(poller, "write")

    def _wait(self, poller: select.poll, what: str) -> None:
        """Wait until the socket is ready for `what`; raise once stopped or past the timeout.

        A read after a broken write waits at most until `DRAIN_AFTER_BROKEN_WRITE_S`
        after it, then raises that write's error.
        """
        timeout_s = self._write_timeout_s() if what == "write" else None
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while not poller.poll(_POLL_SLICE_MS if self._broken is None else 50):
            if self._stopped or self._lost:
                raise _Stopped()
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"a write took longer than {timeout_s:g}s")
            broken = self._broken
            if broken is not None and time.monotonic() > (
                self._broken_at + DRAIN_AFTER_BROKEN_WRITE_S
            ):
                raise broken

    # ------------------------------------------------------------ reading
    def _read_loop(self) -> None:
        reader = self._reader
        lock = self._tls_lock
        poller = _poller(self._sock, select.POLLIN)
        try:
            while not (self._stopped or self._lost):
                buffer = reader.get_buffer(-1)
                try:
                    if lock is None:
                        received = self._sock.recv_into(buffer)
                    else:
                        with lock:
                            received = self._sock.recv_into(buffer)
                except ssl.SSLWantWriteError:  # TLS must send before it reads on
                    self._wait(_poller(self._sock, select.POLLOUT), "read")
                    continue
                except _WOULD_BLOCK:
                    self._wait(poller, "read")
                    continue
                if received == 0:
                    reader.connection_lost(None)  # reports a frame cut in the middle
                    return
                reader.buffer_updated(received)
                if reader.failed is not None:  # not frames, or `on_frame` raised
                    self._lose(reader.failed)
                    return
        except _Stopped:
            pass
        except OSError as exc:
            if not self._stopped:
                reader.connection_lost(exc)
        except Exception as exc:
            self._lose(exc)
        finally:
            self._thread_done()

    # ------------------------------------------------------------ ending
    def _write_failed(self, exc: BaseException) -> None:
        """A write failed: a broken connection is left to the reader; anything else ends it."""
        if not isinstance(exc, OSError) or isinstance(exc, TimeoutError):
            self._lose(exc)  # an encoder's bug, or a peer that stopped reading
            return
        with self._lock:
            if self._broken is not None or self._lost or self._stopped:
                return
            self._broken, self._broken_at = exc, time.monotonic()
            self._pending.clear()
            self._wake_writer.notify_all()
        log.debug(
            "%s: a write found the connection broken (%s); reading to its end", self.name, exc
        )

    def _lose(self, exc: BaseException | None) -> None:
        if isinstance(exc, _Stopped):
            return
        with self._lock:
            if self._lost or self._stopped:
                return
            self._lost = True
            self._pending.clear()
            self._wake_writer.notify_all()
        try:
            self._on_lost(exc)
        except Exception:
            log.exception("%s: the connection-lost handler failed", self.name)
        self._shutdown()

    def _shutdown(self) -> None:
        """Shut the connection down both ways. Through `socket.socket`'s own method: an
        `SSLSocket`'s would drop its SSL object, and a thread's next read would then
        take the raw TLS bytes for frames."""
        with contextlib.suppress(OSError):  # (not connected any more)
            socket.socket.shutdown(self._sock, socket.SHUT_RDWR)

    def _thread_done(self) -> None:
        with self._lock:
            self._threads_left -= 1
            self._close_if_done()

    def _close_if_done(self) -> None:
        """Close the socket once both threads ended and no sender is writing (lock held):
        closing it under a write could hand its descriptor's number to another file."""
        if self._threads_left == 0 and not self._busy and self._sock.fileno() != -1:
            self._sock.close()


class _Stopped(Exception):
    """`stop` was called while a thread waited on the socket."""


def _poller(sock: socket.socket, events: int) -> select.poll:
    poller = select.poll()
    poller.register(sock, events)
    return poller


def _skip(buffers: list[memoryview], sent: int) -> list[memoryview]:
    """`buffers` without their first `sent` bytes."""
    while sent and buffers:
        first = buffers[0]
        if sent >= len(first):
            sent -= len(first)
            buffers = buffers[1:]
        else:
            buffers = [first[sent:], *buffers[1:]]
            sent = 0
    return buffers
