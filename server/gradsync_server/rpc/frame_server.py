"""The coordinator's frame port: worker streams over plain (or TLS) sockets.

See `gradsync_proto.net.frames` for why and for the wire format. Each
connection is served by the same guarded handler as the role's gRPC stream
(`CoordinatorServicer.sync` under `guarded`: a leader's Sync, a shard's Data,
which a `Join` or a `ShardHello` opens), given a `FrameContext` in place
of gRPC's servicer context and an async iterator of the frames' messages in
place of gRPC's request iterator; so joining, the data plane, the bounded
outbox, the connection cap and every error a stream can end with are the
gRPC stream's own, and the status the handler ends with is sent as the last
frame.

What gRPC's server did around a handler is done here: TLS (the same
certificate, key and client CA as the gRPC port), the token check before a
byte past the HELLO is read (the same words as the gRPC token check), the
first-message deadline for the HELLO, the message size limit (a frame longer
than `--max-message-mb` ends the connection unread), and flow control both
ways (reading pauses while the handler is behind; the handler's writes wait
while the socket's buffer is full).

Connections that have not authenticated are bounded from the moment they are
accepted, before any TLS: the TLS handshake is started here on the accepted TCP
connection (not by the listener), so the first-message deadline covers the
handshake and the HELLO together, and the connection counts against the
ungreeted caps (`MAX_UNGREETED` in all, `MAX_UNGREETED_PER_SOURCE` from one
address) while it shakes hands. Ended connections that linger (`rpc.linger`)
have a cap of their own (`MAX_LINGERING`). Every refusal is counted in the
process's rate-limited `RefusalLog`.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any

import grpc
from gradsync_proto import auth
from gradsync_proto.codes import Code
from gradsync_proto.net.frames import (
    HELLO,
    MAX_HELLO_BYTES,
    MESSAGE,
    WRITE_HIGH_WATER,
    FrameError,
    FrameReader,
    decode_hello,
    status_frame,
    write_message,
)

from gradsync_server.config import CoordinatorConfig
from gradsync_server.rpc.auth_check import MISSING_TOKEN, WRONG_TOKEN, RefusalLog
from gradsync_server.rpc.linger import LINGER_S, Linger

if TYPE_CHECKING:
    from gradsync_server.rpc.servicer import CoordinatorServicer

log = logging.getLogger("gradsync.server")

#: Reading pauses while this many messages wait for the handler (a Join being served).
_MAX_WAITING_MESSAGES = 64
#: The most connections that may wait for their HELLO (TLS handshake included) at once;
#: one more drops the oldest.
MAX_UNGREETED = 64
#: The most of them from one address; one more drops that address's oldest. Half of
#: `MAX_UNGREETED`, so that one address alone never pushes out another's connections.
MAX_UNGREETED_PER_SOURCE = MAX_UNGREETED // 2
#: The most ended connections that linger at once (`rpc.linger`); one more cuts the oldest.
MAX_LINGERING = 32

#: What lingering connections read into, to drop it (shared: nobody reads it back).
_DRAIN = memoryview(bytearray(1 << 16))

#: The handler: `guarded("Sync", servicer.sync, streams)`.
SyncHandler = Callable[[AsyncIterator[bytes], Any], Awaitable[None]]


def tls_context(cert: str | None, key: str | None, client_ca: str | None) -> ssl.SSLContext | None:
    """The frame port's TLS context: the gRPC port's certificate and client CA (None: plaintext)."""
    if cert is None or key is None:
        return None
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert, key)
    if client_ca is not None:
        context.load_verify_locations(client_ca)
        context.verify_mode = ssl.CERT_REQUIRED
    return context


class FrameContext:
    """What the Sync handler uses of `grpc.aio.ServicerContext`, on a frame connection."""

    def __init__(self, connection: FrameConnection, peer: str) -> None:
        self._peer = peer
        self.code = grpc.StatusCode.OK
        self.details = ""
        # The writes are the connection's own (`FrameConnection.send`, `.write_now`).
        self.write = connection.send
        self.write_now = connection.write_now

    def peer(self) -> str:
        return self._peer

    def set_code(self, code: grpc.StatusCode) -> None:
        self.code = code

    def set_details(self, details: str) -> None:
        self.details = details

    async def abort(self, code: grpc.StatusCode, details: str) -> None:
        self.code, self.details = code, details
        raise grpc.aio.AbortError(details)


class _Requests:
    """The connection's messages as the async iterator the handler reads (gRPC's shape)."""

    def __init__(self, pause: Callable[[bool], None]) -> None:
        self._waiting: collections.deque[bytes] = collections.deque()
        self._wake: asyncio.Future[None] | None = None
        self._end: BaseException | None = None
        self._ended = False
        self._pause = pause

    def push(self, raw: bytes) -> None:
        self._waiting.append(raw)
        if len(self._waiting) >= _MAX_WAITING_MESSAGES:
            self._pause(True)
        self._notify()

    def finish(self, exc: BaseException | None) -> None:
        if self._ended:
            return  # (an ended connection that lingered: its end was said then)
        self._ended, self._end = True, exc
        self._notify()

    def _notify(self) -> None:
        if self._wake is not None and not self._wake.done():
            self._wake.set_result(None)

    def __aiter__(self) -> AsyncIterator[bytes]:
        return self

    async def __anext__(self) -> bytes:
        while not self._waiting:
            if self._ended:
                if self._end is not None:
                    raise self._end
                raise StopAsyncIteration
            self._wake = asyncio.get_running_loop().create_future()
            await self._wake
        raw = self._waiting.popleft()
        if len(self._waiting) == _MAX_WAITING_MESSAGES // 2:
            self._pause(False)
        return raw


class _EarlyBytes(asyncio.Protocol):
    """What TLS decrypts between the end of its handshake and `start_tls` returning.

    Bounded by one read of the TLS layer: the connection takes over right after.
    """

    def __init__(self) -> None:
        self.data = bytearray()
        self.lost = False

    def data_received(self, data: bytes) -> None:
        self.data += data

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True


class FrameConnection(FrameReader):
    """One worker's connection: HELLO, then its Sync stream, then a STATUS frame."""

    def __init__(self, server: FrameServer) -> None:
        super().__init__(MAX_HELLO_BYTES, self._on_frame, self._on_lost)
        self._server = server
        #: The accepted TCP connection (under TLS, what the TLS transport runs on).
        self._raw: asyncio.Transport | None = None
        #: What frames are read from and written to: the TCP or, once shaken hands, TLS transport.
        self._transport: asyncio.Transport | None = None
        self._handshake: asyncio.Task[None] | None = None
        self._requests = _Requests(self._pause_reading)
        self._task: asyncio.Task[None] | None = None
        self._hello_timer: asyncio.TimerHandle | None = None
        self._writable: asyncio.Future[None] | None = None
        self._closed = False
        #: The STATUS frame is written: what still comes in is read and dropped.
        self._ending = False
        #: Set once the STATUS is written and our side half-closed: reads are dropped.
        self._linger: Linger | None = None
        self.peer = "frames:unknown"
        #: The peer's address without its port: what the per-source cap counts by.
        self.source = "unknown"

    # ------------------------------------------------------------ protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        """A TCP connection was accepted: it counts from now, TLS handshake included."""
        assert isinstance(transport, asyncio.Transport)
        self._raw = transport
        peer = transport.get_extra_info("peername")
        if isinstance(peer, tuple) and len(peer) >= 2:
            family = "ipv6" if ":" in str(peer[0]) else "ipv4"
            host = f"[{peer[0]}]" if family == "ipv6" else peer[0]
            self.peer = f"{family}:{host}:{peer[1]}"
            self.source = str(peer[0])
        loop = asyncio.get_running_loop()
        self._hello_timer = loop.call_later(self._server.first_message_s, self._hello_due)
        self._server.connections.add(self)
        if self._server.tls is None:
            self._attach(transport)
        else:
            transport.pause_reading()  # what arrives now is the handshake's, not frames
            self._handshake = loop.create_task(self._shake_hands(transport, self._server.tls))
        self._server.greeting(self)

    def _attach(self, transport: asyncio.Transport) -> None:
        super().connection_made(transport)
        self._transport = transport
        transport.set_write_buffer_limits(high=WRITE_HIGH_WATER)

    async def _shake_hands(self, raw: asyncio.Transport, tls: ssl.SSLContext) -> None:
        """The TLS handshake on the accepted connection, within the first-message deadline.

        What the peer sent right behind its handshake is decrypted before `start_tls`
        returns the TLS transport; it is held (`_EarlyBytes`) and then read here as if
        it had just arrived, so the HELLO and what follows it are taken in order.
        """
        if self._closed or raw.is_closing():  # dropped (a cap) before its handshake began
            self.connection_lost(None)
            return
        early = _EarlyBytes()
        try:
            secured = await asyncio.get_running_loop().start_tls(
                raw,
                early,
                tls,
                server_side=True,
                ssl_handshake_timeout=self._server.first_message_s,
                # A closed TLS connection waits for the peer's close_notify this long
                # at most (asyncio's default is 30 s), counted as lingering meanwhile.
                ssl_shutdown_timeout=LINGER_S,
            )
        except (OSError, TimeoutError) as exc:  # (ssl.SSLError is an OSError)
            if isinstance(exc, ssl.SSLError) and not self._closed:
                self._server.refusals.note("frame", self.peer, f"TLS handshake failed: {exc}")
            secured = None
        if secured is None or early.lost or self._closed or raw.is_closing():
            raw.abort()  # failed, or cut while it shook hands (a cap, the deadline)
            self.connection_lost(None)
            return
        secured.set_protocol(self)
        self._attach(secured)
        if early.data:
            self.data_arrived(early.data)

    def pause_writing(self) -> None:
        self._writable = asyncio.get_running_loop().create_future()

    def resume_writing(self) -> None:
        if self._writable is not None and not self._writable.done():
            self._writable.set_result(None)
        self._writable = None

    def get_buffer(self, sizehint: int) -> memoryview:
        if self._linger is not None:  # read to be dropped, not parsed
            return _DRAIN
        return super().get_buffer(sizehint)

    def buffer_updated(self, nbytes: int) -> None:
        if self._linger is None:
            super().buffer_updated(nbytes)

    def data_arrived(self, data: bytes | bytearray) -> None:
        """Take `data` as if the transport had just read it (bytes that came before it)."""
        view = memoryview(data)
        while view and not self._closed and self.failed is None:
            buffer = self.get_buffer(len(view))
            if not buffer:
                return  # (a transport would end the connection here too)
            size = min(len(buffer), len(view))
            buffer[:size] = view[:size]
            self.buffer_updated(size)
            view = view[size:]

    def _open(self) -> asyncio.Transport | None:
        """The transport while this end may still write to it (None once it ended)."""
        transport = self._transport
        if transport is None or transport.is_closing() or self._ending:
            return None
        return transport

    # ------------------------------------------------------------ frames
    def _on_frame(self, kind: int, body: bytearray) -> None:
        if self._open() is None:
            return  # refused or ended: what follows in the same read is not looked at
        if self._task is None:
            self._hello(kind, body)
        elif kind == MESSAGE:
            # A bytearray nobody else holds: read as bytes (protobuf and the codec take both).
            self._requests.push(body)  # type: ignore[arg-type]
        else:
            raise FrameError(f"a frame of kind {kind} after the HELLO: only messages may follow")

    def _hello(self, kind: int, body: bytearray) -> None:
        if self._hello_timer is not None:
            self._hello_timer.cancel()
        self._server.greeted(self)
        if kind != HELLO:
            raise FrameError(f"the first frame is of kind {kind}, not a HELLO")
        presented = decode_hello(body)
        expected = self._server.token
        if expected is not None and not auth.token_matches(expected, presented or None):
            template = MISSING_TOKEN if not presented else WRONG_TOKEN
            message = template.format(env=auth.ENV_TOKEN, env_file=auth.ENV_TOKEN_FILE)
            self._server.refused += 1
            why = "no token" if not presented else "wrong token"
            self._server.refusals.note("frame", self.peer, why)
            self._finish(Code.UNAUTHENTICATED, message)
            return
        self.max_body_bytes = self._server.max_message_bytes
        context = FrameContext(self, self.peer)
        self._task = asyncio.ensure_future(self._serve(context))

    def _on_lost(self, exc: BaseException | None) -> None:
        self._closed = True
        if self._linger is not None:
            self._linger.cancel()
        self._server.connections.discard(self)
        self._server.greeted(self)
        self._server.lingered(self)
        if self._hello_timer is not None:
            self._hello_timer.cancel()
        self._release_handler(exc if exc is not None and not isinstance(exc, FrameError) else None)

    def _release_handler(self, exc: BaseException | None) -> None:
        """No more messages for the handler (`exc`: why); a write it waits on returns."""
        self._requests.finish(exc)
        if self._writable is not None and not self._writable.done():
            self._writable.set_result(None)  # a waiting write returns; the next one is refused

    def _hello_due(self) -> None:
        if self._task is None and not self._closed:
            why = "no HELLO" if self._transport is not None else "no TLS handshake"
            self._server.refusals.note("frame", self.peer, f"{why} within the deadline")
            self._finish(
                Code.DEADLINE_EXCEEDED,
                f"{self.peer} sent no HELLO within the first-message deadline "
                "(--first-message-timeout-s); connection ended",
            )

    # ------------------------------------------------------------ serving
    async def _serve(self, context: FrameContext) -> None:
        try:
            await self._server.handler(self._requests, context)
        except grpc.aio.AbortError:
            pass  # the context holds the code and details
        except asyncio.CancelledError:
            context.code, context.details = grpc.StatusCode.UNAVAILABLE, "the coordinator stopped"
            raise
        finally:
            self._finish(int(context.code.value[0]), context.details)

    async def send(self, raw: bytes) -> None:
        """Write one message frame; wait while the socket's buffer is over its high water."""
        transport = self._open()
        if self._closed or transport is None:
            raise ConnectionError(f"the connection to {self.peer} is closed")
        write_message(transport, raw)
        if self._writable is not None:
            await self._writable

    def write_now(self, raw: bytes) -> bool:
        """Write one message frame unless the socket's buffer is full or the connection closed."""
        transport = self._open()
        if self._writable is not None or self._closed or transport is None:
            return False
        write_message(transport, raw)
        return True

    def _finish(self, code: int, details: str) -> None:
        """Send the STATUS frame, then end our side; close once the worker closed its own.

        Why not close at once: the worker may still be sending (a heartbeat, the next
        step's bucket). Closing a socket with unread bytes makes the kernel reset the
        connection, and a reset drops what it has not yet delivered of ours: on a slow
        link, the StreamEnd and STATUS that say why, so the worker would take a refusal
        for a lost coordinator and reconnect. So this end half-closes (its FIN follows
        the STATUS), reads and drops what still comes, and closes when the worker does,
        or once its last bytes stopped moving for a while (`rpc.linger`). TLS cannot
        half-close, and a connection that never said HELLO is not worth a descriptor
        for seconds (a flood of them must stay bounded, `MAX_UNGREETED`): those close
        at once, and count as lingering until they are gone (a TLS close waits for
        the peer's close_notify, at most `LINGER_S`).
        """
        if self._transport is None:  # still shaking hands: nothing can be said before TLS
            if self._raw is not None and not self._closed:
                self._raw.abort()
            return
        transport = self._open()
        if transport is None:
            return
        self._ending = True
        transport.write(status_frame(code, details))
        if self._task is None or not transport.can_write_eof():
            transport.close()  # (TLS: after the peer's close_notify, within LINGER_S)
            if not self._closed:
                self._server.lingering(self)  # held until then: counted
            return
        transport.write_eof()  # after what is buffered
        self._linger = Linger(transport)
        self._server.lingering(self)
        # What comes now is dropped: a handler still running (a refused frame) sees the
        # end of its messages now, as it did when the connection closed at once.
        self._release_handler(None)
        transport.resume_reading()  # (paused while the handler was behind)

    def refuse(self, exc: BaseException) -> None:
        """Bytes that are not frames: say why in a STATUS frame, then close."""
        if isinstance(exc, FrameError):
            self._server.refusals.note("frame", self.peer, str(exc))
            self._finish(int(exc.code), f"{self.peer}: {exc}")
        else:  # the handler's side raised while taking a frame: a bug
            log.error("internal error taking a frame from %s", self.peer, exc_info=exc)
            self._finish(int(Code.INTERNAL), f"internal error in Sync: {type(exc).__name__}: {exc}")

    def _pause_reading(self, pause: bool) -> None:
        transport = self._open()
        if transport is not None:
            (transport.pause_reading if pause else transport.resume_reading)()

    def drop(self, code: Code, details: str) -> None:
        """End a connection that has not said HELLO: a STATUS frame, then close."""
        if self._hello_timer is not None:
            self._hello_timer.cancel()
        self._finish(int(code), details)

    def abort(self) -> None:
        """Drop the connection now (shutdown, or a lingering one over its cap)."""
        transport = self._transport or self._raw
        if transport is not None:
            transport.abort()
        if self._task is not None:
            self._task.cancel()


class FrameServer:
    """The listening frame port of one coordinator.

    Args:
        handler: serves one Sync stream (the gRPC handler, guarded).
        token: the workers' token every HELLO must present (None: unchecked).
        max_message_bytes: the longest message frame accepted.
        first_message_s: how long a connection may take to send its HELLO, from its
            accept (its TLS handshake included).
        tls: the TLS context (None: plaintext).
        refusals: where refusals are logged, rate-limited (shared with the process's
            gRPC port; None: a log of its own).
    """

    def __init__(
        self,
        handler: SyncHandler,
        *,
        token: str | None,
        max_message_bytes: int,
        first_message_s: float,
        tls: ssl.SSLContext | None = None,
        refusals: RefusalLog | None = None,
    ) -> None:
        self.handler = handler
        self.token = token
        self.max_message_bytes = max_message_bytes
        self.first_message_s = first_message_s
        self.tls = tls
        self.connections: set[FrameConnection] = set()
        self.refusals = refusals or RefusalLog()
        #: Connections that have not said HELLO yet, oldest first (at most MAX_UNGREETED).
        self._ungreeted: dict[FrameConnection, None] = {}
        #: How many of them each source address holds (at most MAX_UNGREETED_PER_SOURCE).
        self._ungreeted_by_source: collections.Counter[str] = collections.Counter()
        #: Ended connections lingering, oldest first (at most MAX_LINGERING).
        self._lingering: dict[FrameConnection, None] = {}
        #: Connections refused for their token (for tests).
        self.refused = 0
        self._server: asyncio.Server | None = None
        self.port = 0

    def greeting(self, connection: FrameConnection) -> None:
        """A connection was accepted and waits for its HELLO; beyond a cap its oldest goes.

        Unauthenticated connections count against no other cap (`--max-connections`
        counts streams, which begin at the HELLO), so their number is bounded here from
        the accept on, TLS handshake included: a flood of silent connections cannot hold
        memory or descriptors. One address may hold `MAX_UNGREETED_PER_SOURCE` of them
        (one more drops its own oldest), all addresses together `MAX_UNGREETED` (one
        more drops the oldest of all).
        """
        source = connection.source
        if self._ungreeted_by_source[source] >= MAX_UNGREETED_PER_SOURCE:
            oldest = next(c for c in self._ungreeted if c.source == source)
            self._drop_ungreeted(
                oldest,
                f"{MAX_UNGREETED_PER_SOURCE} connections from {source} to the frame port "
                "are waiting to say HELLO; the oldest is dropped",
            )
        self._ungreeted[connection] = None
        self._ungreeted_by_source[source] += 1
        if len(self._ungreeted) > MAX_UNGREETED:
            self._drop_ungreeted(
                next(iter(self._ungreeted)),
                f"{MAX_UNGREETED} connections to the frame port are waiting to say HELLO; "
                "the oldest is dropped",
            )

    def _drop_ungreeted(self, connection: FrameConnection, details: str) -> None:
        self.greeted(connection)
        self.refusals.note("frame", connection.peer, details)
        connection.drop(Code.RESOURCE_EXHAUSTED, details)

    def greeted(self, connection: FrameConnection) -> None:
        """`connection` said HELLO (or ended): it no longer counts as ungreeted."""
        if connection in self._ungreeted:
            del self._ungreeted[connection]
            self._ungreeted_by_source[connection.source] -= 1
            if not self._ungreeted_by_source[connection.source]:
                del self._ungreeted_by_source[connection.source]

    def lingering(self, connection: FrameConnection) -> None:
        """`connection` ended and lingers; beyond `MAX_LINGERING` the oldest is cut."""
        self._lingering[connection] = None
        if len(self._lingering) > MAX_LINGERING:
            oldest = next(iter(self._lingering))
            self.lingered(oldest)
            oldest.abort()

    def lingered(self, connection: FrameConnection) -> None:
        """`connection` is gone: it no longer lingers."""
        self._lingering.pop(connection, None)

    async def start(self, host: str, port: int) -> int:
        """Listen on `host:port` (0 = any free port); the bound port."""
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            lambda: FrameConnection(self),
            host.strip("[]") or None,
            port,
            reuse_address=True,
            # TLS is started by each connection on its accepted socket (`_shake_hands`),
            # so that the connection counts from its accept, not from its handshake's end.
            backlog=MAX_UNGREETED * 2,
        )
        sockets = self._server.sockets
        self.port = int(sockets[0].getsockname()[1]) if sockets else 0
        return self.port

    async def stop(self) -> None:
        """Stop listening and drop every connection (the handlers see them close)."""
        if self._server is not None:
            self._server.close()
        for connection in list(self.connections):
            connection.abort()
        if self._server is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 5.0)


async def start_frame_server(
    config: CoordinatorConfig, servicer: CoordinatorServicer, refusals: RefusalLog | None = None
) -> FrameServer:
    """Serve Sync streams as frames too (`frame_server`), on the gRPC port's host and security.

    Raises:
        OSError: `frame_port_required` and the port cannot be bound.
    """
    assert config.frame_port is not None
    frames = FrameServer(
        servicer.sync_handler(),
        token=config.token,
        max_message_bytes=config.max_message_bytes,
        first_message_s=config.first_message_timeout_s,
        tls=tls_context(config.tls_cert, config.tls_key, config.tls_client_ca),
        refusals=refusals,
    )
    try:
        servicer.frame_port = await frames.start(config.host, config.frame_port)
    except OSError as exc:
        if config.frame_port_required or config.frame_port == 0:
            raise OSError(
                f"could not bind the frame port {config.host}:{config.frame_port}: {exc}"
            ) from exc
        servicer.frame_port = await frames.start(config.host, 0)
        log.warning(
            "the frame port %d is taken (%s); serving frames on port %d instead "
            "(workers find it through the gRPC port; set --frame-port to choose)",
            config.frame_port,
            exc.strerror or exc,
            servicer.frame_port,
        )
    return frames
