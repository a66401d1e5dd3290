"""How long an ended frame connection stays open: while its last bytes still move.

After its STATUS frame the coordinator half-closes a worker's frame connection and
keeps reading (to drop) until the worker closes its end (`FrameConnection._finish`
says why: closing with the worker's bytes unread is a reset, and a reset drops what
is still in flight). A worker that never closes must not hold the connection for
ever, but a fixed deadline is wrong too: on a slow link the StreamEnd and STATUS may
queue behind megabytes of averages, and cutting the connection before they arrive
is the very loss the lingering is there to prevent. So the connection is cut only
after `LINGER_S` in which none of our bytes moved: none left the transport's buffer
and none were acknowledged by the worker's kernel (Linux: `TIOCOUTQ`, the bytes of
the socket's send queue not yet acknowledged). Once all of them are acknowledged the
worker has everything, and it gets `LINGER_S` more to close. A peer that keeps the
bytes moving, a few at a time, still gets no more than `MAX_LINGER_S` in all, and the
frame server cuts the oldest lingering connection beyond a count of its own
(`frame_server.MAX_LINGERING`).
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import struct
import termios

#: Cut an ended connection after this long without any of its last bytes moving.
LINGER_S = 5.0
#: Cut an ended connection after this long in all, moving or not (a link that slow
#: to carry the last answers and the STATUS is taken for a peer that holds it).
MAX_LINGER_S = 60.0
#: How often a lingering connection looks whether its bytes moved.
CHECK_S = 0.25


def unacknowledged_bytes(transport: asyncio.Transport) -> int:
    """Bytes written but not yet acknowledged by the peer: the transport's, then the kernel's."""
    pending = transport.get_write_buffer_size()
    sock = transport.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError, ValueError):  # not Linux, or already closed
            raw = fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, struct.pack("i", 0))
            pending += struct.unpack("i", raw)[0]
    return pending


class Linger:
    """Cut `transport` (abort) once its unacknowledged bytes stop moving for `LINGER_S`,
    or `MAX_LINGER_S` after it began.

    Started right after the half-close; `cancel` when the connection ends by itself.
    """

    def __init__(self, transport: asyncio.Transport) -> None:
        self._transport = transport
        self._loop = asyncio.get_running_loop()
        self._pending = unacknowledged_bytes(transport)
        self._moved_at = self._started_at = self._loop.time()
        self._timer: asyncio.TimerHandle | None = self._loop.call_later(CHECK_S, self._check)

    def cancel(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _check(self) -> None:
        pending = unacknowledged_bytes(self._transport)
        now = self._loop.time()
        if pending < self._pending:
            self._moved_at = now
        self._pending = pending
        if now - self._moved_at >= LINGER_S or now - self._started_at >= MAX_LINGER_S:
            self._timer = None
            self._transport.abort()
            return
        self._timer = self._loop.call_later(CHECK_S, self._check)
