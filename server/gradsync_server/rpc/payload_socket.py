"""The coordinator's payload endpoint: an abstract Unix socket where local leaders register.

The same-host payload path (`gradsync_server.rpc.segments`) needs each local
leader's segment descriptor, which only a Unix socket can carry
(SCM_RIGHTS). The socket is abstract (no file to clean up, gone with the
process) and has a random name per coordinator process, told only to
same-host local leaders in their Welcome. Abstract sockets are per network
namespace, which is why the host id that decides who is told includes it.

One daemon thread accepts and serves registrations one at a time, every
socket operation bounded (`EXCHANGE_TIMEOUT_S`), so a stalled peer delays
the next registration by seconds at most and never the event loop. A peer
of another uid (SO_PEERCRED) is refused before a byte is read. The verdict
needs the jobs' state, which lives on the asyncio loop without locks: the
thread hands the request and the descriptor to the loop (`admit`, run there)
and waits, bounded, for the answer; from that hand-over on the loop owns the
descriptor (the registry closes it when it refuses it).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import os
import socket
import struct
import threading
from collections.abc import Callable

from gradsync_proto.codes import Code
from gradsync_proto.payload_socket import (
    EXCHANGE_TIMEOUT_S,
    MAX_REQUEST_BYTES,
    OK,
    Registration,
    address,
    decode_request,
    new_socket_name,
    refusal,
)

from gradsync_server.dataplane.actions import SegmentAverage
from gradsync_server.rpc.connection import Connection
from gradsync_server.rpc.segments import SegmentRegistry

log = logging.getLogger("gradsync.server")

#: Called on the event loop with a request and its descriptor (which it then
#: owns); returns None (registered) or why not.
Admit = Callable[[Registration, int], "str | None"]
#: How often the accepting thread looks whether it is to stop.
_POLL_S = 0.2
_UCRED = struct.Struct("3i")  # pid, uid, gid


class PayloadSocket:
    """The listening socket and its accepting thread.

    Args:
        loop: the coordinator's event loop (where `admit` runs).
        admit: decides a registration and takes its descriptor.
        backlog: pending connections the kernel holds (more are refused).
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, admit: Admit, backlog: int = 16) -> None:
        self.name = new_socket_name()
        self._loop = loop
        self._admit = admit
        self._stop = threading.Event()
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._sock.bind(address(self.name))
            self._sock.listen(backlog)
            self._sock.settimeout(_POLL_S)
        except OSError:
            self._sock.close()
            raise
        self._thread = threading.Thread(
            target=self._serve, name="gradsync-payload-socket", daemon=True
        )
        self._thread.start()

    def close(self) -> None:
        """Stop accepting and wait (bounded) for the thread. Idempotent."""
        self._stop.set()
        self._thread.join(timeout=EXCHANGE_TIMEOUT_S * 2 + 1)
        self._sock.close()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                continue
            except OSError:
                if self._stop.is_set():
                    return
                continue
            with conn:
                try:
                    conn.settimeout(EXCHANGE_TIMEOUT_S)
                    conn.sendall(self._handle(conn))
                except OSError as exc:
                    log.info("payload socket: a registration failed: %s", exc)

    def _handle(self, conn: socket.socket) -> bytes:
        """Serve one registration; return the reply."""
        cred = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
        pid, uid, _ = _UCRED.unpack(cred)
        if uid != os.getuid():
            log.warning("payload socket: refused pid %d of uid %d (not this uid)", pid, uid)
            return refusal(f"uid {uid} is not the coordinator's")
        raw, fds, _, _ = socket.recv_fds(conn, MAX_REQUEST_BYTES + 1, 2)
        for extra in fds[1:]:
            os.close(extra)
        if not fds:
            return refusal("no descriptor came with the registration")
        fd = fds[0]
        os.set_inheritable(fd, False)
        try:
            registration = decode_request(raw)
        except ValueError as exc:
            os.close(fd)
            return refusal(str(exc))
        return self._decide(registration, fd)

    def _decide(self, registration: Registration, fd: int) -> bytes:
        """Ask the loop (bounded); the descriptor is the loop's once its call has begun."""
        verdict: concurrent.futures.Future[str | None] = concurrent.futures.Future()

        def on_loop() -> None:
            if not verdict.set_running_or_notify_cancel():
                return  # the thread gave up and closed the descriptor itself
            try:
                verdict.set_result(self._admit(registration, fd))
            except Exception as exc:  # a bug: refuse, never leave the thread waiting
                log.exception("payload socket: admitting a registration failed")
                verdict.set_result(f"internal error: {exc!r}")

        try:
            self._loop.call_soon_threadsafe(on_loop)
        except RuntimeError:  # the loop is closed: the coordinator is stopping
            os.close(fd)
            return refusal("the coordinator is stopping")
        try:
            problem = verdict.result(timeout=EXCHANGE_TIMEOUT_S)
        except concurrent.futures.TimeoutError:
            if verdict.cancel():
                os.close(fd)
            else:  # it is running now: wait for its word (it owns the descriptor)
                with contextlib.suppress(concurrent.futures.TimeoutError):
                    problem = verdict.result(timeout=EXCHANGE_TIMEOUT_S)
                    return OK if problem is None else refusal(problem)
            return refusal("the coordinator did not decide in time")
        if problem is not None:
            log.warning("payload socket: refused a registration: %s", problem)
            return refusal(problem)
        return OK


def averaged_for(segments: SegmentRegistry, target: Connection, average: SegmentAverage) -> bytes:
    """What to send `target` for an averaged chunk of an upload read from its segment: a
    header-only chunk once the average is written there, else the whole chunk.

    A write that fails ends that rank alone (its stream; the job carries on as
    after any lost rank).
    """
    job_id = target.job.job_id if target.job is not None else ""
    try:
        header_only = segments.reply(job_id, target.rank, average.header, average.payload)
    except OSError as exc:
        target.end(
            Code.FAILED_PRECONDITION,
            f"the coordinator could not write an average into rank {target.rank}'s "
            f"shared-memory segment: {exc}",
        )
        header_only = None
    return header_only or average.encoded()
