"""A worker's Sync stream as frames on a socket, with gRPC as the way in and the fallback.

`FrameStreamClient` is a `StreamClient` (same queue, encoder, ending and
bounded close) whose pipe is a frame connection (`gradsync_proto.net.frames`)
when the coordinator offers one, and the gRPC stream otherwise:

1. It asks the coordinator's gRPC port where its frame port is (the
   `FramePort` RPC, with the token and TLS of every call, waiting for a
   coordinator that is not up yet as the gRPC stream would). A refusal
   (a wrong token, say) ends the stream with the coordinator's status, as
   the gRPC stream would have.
2. It connects to that port on the same host, with the same TLS trust and
   client certificate, and sends its HELLO (the token).
3. When there is no frame port (an older coordinator, a standby, one
   started with `--frame-port -1`), or it cannot be reached (a firewall or a
   port mapping that lets only the gRPC port through), the same stream is
   opened over gRPC instead, and a refused connection says so in the log.

`GRADSYNC_FRAMES=0` in the worker's environment skips the frame port.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import ssl
import threading
from collections.abc import Callable
from typing import Any

import grpc

from gradsync_proto.codes import Code
from gradsync_proto.net.address import parse_address
from gradsync_proto.net.frame_socket import Framed, FrameSocket
from gradsync_proto.net.frames import (
    MESSAGE,
    STATUS,
    WRITE_HIGH_WATER,
    FrameError,
    FrameReader,
    decode_status,
    hello_frame,
    write_message,
)
from gradsync_proto.net.stream_client import (
    _END_WRITES,
    TASK_END_TIMEOUT_S,
    EndKind,
    StreamClient,
)
from gradsync_proto.v1 import gradsync_pb2 as pb

log = logging.getLogger("gradsync.net")

__all__ = ["ENV_FRAMES", "FRAME_PORT_METHOD", "FrameStreamClient", "frames_enabled"]

FRAME_PORT_METHOD = "/gradsync.v1.Coordinator/FramePort"
#: "0" turns the frame port off on a worker (its Sync stream stays on gRPC).
ENV_FRAMES = "GRADSYNC_FRAMES"
#: How long connecting to the frame port (TLS included) may take before gRPC is used.
FRAME_CONNECT_TIMEOUT_S = 5.0
#: The keepalive channel never goes idle (gRPC's default closes it after 30 min).
_NEVER_IDLE_MS = 2**31 - 1


def frames_enabled() -> bool:
    """Whether workers in this process try the frame port (`GRADSYNC_FRAMES`, default on)."""
    return os.environ.get(ENV_FRAMES, "1").strip().lower() not in ("0", "false", "no", "off")


class FrameStreamClient(StreamClient):
    """A Sync stream on the coordinator's frame port, or on gRPC where there is none.

    Takes `StreamClient`'s arguments; `max_message_bytes` bounds a frame read.
    `idle_timeout_s` is not supported on frames (the Sync stream has none).

    Plain frames run on a `FrameSocket` (threads: `on_message` is then called
    on its reader thread, and `send_threadsafe` writes a small item from the
    calling thread); TLS frames and gRPC run on the loop.

    Args:
        inline: whether an item is small enough for the thread that sends it to
            write it (default: none is; the rest go to the socket's writer thread).
        loop: the loop `start` will be called on (`send_threadsafe` before it).
    """

    def __init__(
        self,
        *args: Any,
        max_message_bytes: int,
        inline: Callable[[Any], bool] = lambda item: False,
        loop: asyncio.AbstractEventLoop | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self._max_message_bytes = max_message_bytes
        self._inline = inline
        self._transport: asyncio.Transport | None = None
        #: The plain frame connection, once open and every item queued before it sent.
        self._socket: FrameSocket | None = None
        self._loop = loop
        #: Items `send_threadsafe` handed to the loop that it has not sent yet: while
        #: there are any, later ones go the same way (a thread's items keep their order).
        self._hops = 0
        self._hops_lock = threading.Lock()
        self._status: tuple[int, str] | None = None
        #: The channel of the FramePort question while it is asked.
        self._asking: grpc.aio.Channel | None = None
        #: That channel, kept open beside the frames for its keepalive pings.
        self._keepalive: grpc.aio.Channel | None = None
        self._writable: asyncio.Event | None = None
        #: "frames" or "grpc" once decided; "" while asking.
        self.pipe = ""

    # ------------------------------------------------------------ public API
    def start(self, channel: grpc.aio.Channel | None = None) -> None:
        """Ask for the frame port and connect (on the loop; returns at once); given a
        `channel`, run the stream over gRPC on it instead."""
        self._done = asyncio.Event()
        self._loop = asyncio.get_running_loop()
        if channel is not None:
            self._keepalive = channel
            self._use_grpc()
            return
        self._spawn(self._connect(), "connect")

    def send(self, item: object) -> None:
        """Queue `item` (loop thread); on a plain frame connection, write it at once."""
        frames = self._socket
        if frames is not None:
            frames.put(item, inline=self._inline(item))
        else:
            super().send(item)

    def send_threadsafe(self, item: object) -> None:
        """`send` from any thread, keeping the order of the calling thread's items.

        On a plain frame connection a small item is written by the calling
        thread; otherwise it is handed to the loop.
        """
        frames = self._socket
        if frames is not None and self._hops == 0:
            frames.put(item, inline=self._inline(item))
            return
        loop = self._loop
        if loop is None:
            raise RuntimeError(f"{self.name}: send_threadsafe before start")
        with self._hops_lock:
            self._hops += 1
        loop.call_soon_threadsafe(self._hopped, item)

    def _hopped(self, item: object) -> None:
        self.send(item)  # before the count drops: a later item must not overtake it
        with self._hops_lock:
            self._hops -= 1

    @property
    def connected(self) -> bool:
        if self.pipe == "grpc":
            return bool(super().connected)
        if self._socket is not None:
            return not self._socket.closed
        transport = self._transport
        if transport is not None:
            return not transport.is_closing()
        # Asking, or connecting the frames: the coordinator answers on its gRPC port.
        channel = self._asking or self._keepalive
        return channel is not None and channel.get_state() == grpc.ChannelConnectivity.READY

    # ------------------------------------------------------------ connecting
    async def _connect(self) -> None:
        try:
            await self._choose_pipe()
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a bug: end the stream and say so, never hang
            self._finish(self._ended(EndKind.FAULT, Code.UNKNOWN, repr(exc), exc))
            self._stop_soon()

    async def _choose_pipe(self) -> None:
        """Frames where the coordinator offers them and they connect, else gRPC."""
        port = await self._frame_port()
        if port is None:
            return  # ended (refused), or gRPC was started
        if self.ended is not None or self._closing:
            return
        try:
            await self._open_frames(port)
        except (OSError, ssl.SSLError, TimeoutError) as exc:
            log.warning(
                "%s: the coordinator's frame port %d at %s cannot be reached (%s); "
                "using its gRPC port instead (slower for small models: open the frame port "
                "too, see the README)",
                self.name,
                port,
                parse_address(self.target).host,
                exc,
            )
            self._use_grpc()

    async def _frame_port(self) -> int | None:
        """The coordinator's frame port; None once the stream ended or went to gRPC."""
        port = await self._ask_frame_port() if frames_enabled() else 0
        if port == 0:
            self._use_grpc()
            return None
        return port

    async def _ask_frame_port(self) -> int | None:
        """The FramePort RPC's answer (0: none, or not implemented); None: it ended the stream."""
        options = [*self._options, ("grpc.client_idle_timeout_ms", _NEVER_IDLE_MS)]
        channel = self._security.aio_channel(self.target, options)
        self._asking = channel
        keep = False
        try:
            ask = channel.unary_unary(
                FRAME_PORT_METHOD,
                request_serializer=pb.FramePortRequest.SerializeToString,
                response_deserializer=pb.FramePortReply.FromString,
            )
            reply = await ask(
                pb.FramePortRequest(),
                metadata=self._security.metadata,
                wait_for_ready=self._wait_for_ready,
            )
            keep = True
            self._keepalive = channel  # kept: the frames' keepalive, or gRPC's stream
            return int(reply.port)
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.UNIMPLEMENTED:  # a coordinator without frames
                keep = True
                self._keepalive = channel
                return 0
            code = int(exc.code().value[0])
            self._finish(self._ended(EndKind.STATUS, code, exc.details() or "", exc))
            return None
        finally:
            self._asking = None
            if not keep:
                await channel.close()

    async def _open_frames(self, port: int) -> None:
        host = parse_address(self.target).host
        if not self._security.tls:
            await self._open_frame_socket(host, port)
            return
        loop = asyncio.get_running_loop()
        protocol = FrameReader(self._max_message_bytes, self._on_frame, self._on_lost)
        protocol.pause_writing = self._pause_writing  # type: ignore[method-assign]
        protocol.resume_writing = self._resume_writing  # type: ignore[method-assign]
        context = self._tls_context()
        transport, _ = await asyncio.wait_for(
            loop.create_connection(
                lambda: protocol,
                host,
                port,
                ssl=context,
                server_hostname=host if context is not None else None,
            ),
            FRAME_CONNECT_TIMEOUT_S,
        )
        assert isinstance(transport, asyncio.Transport)
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        transport.set_write_buffer_limits(high=WRITE_HIGH_WATER)
        self._transport = transport
        transport.write(hello_frame(self._security.token))
        self.pipe = "frames"
        log.debug("%s: Sync stream on frames at %s:%d", self.name, host, port)
        self._spawn(self._write(), "write")
        self._spawn(self._watch_keepalive(), "keepalive")

    async def _open_frame_socket(self, host: str, port: int) -> None:
        """Connect a plain socket and hand it to a `FrameSocket` (threads), HELLO first."""
        sock = await asyncio.wait_for(_connect(host, port), FRAME_CONNECT_TIMEOUT_S)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        frames = FrameSocket(
            sock,
            self._max_message_bytes,
            self._on_frame,
            self._on_socket_lost,
            self._encode,
            write_timeout_s=lambda: self.write_timeout_s,
            name=self.name,
        )
        frames.put(Framed(hello_frame(self._security.token)), inline=True)
        while not self._queue.empty():  # what was sent before the connection, in order
            item = self._queue.get_nowait()
            frames.put(item, inline=self._inline(item))
        self._socket = frames
        self.pipe = "frames"
        frames.start()  # (only now can an answer come in: the pipe is said first)
        log.debug("%s: Sync stream on frames at %s:%d (threads)", self.name, host, port)
        self._spawn(self._write(), "write")  # the farewell of `close` comes by the queue
        self._spawn(self._watch_keepalive(), "keepalive")

    def _on_socket_lost(self, exc: BaseException | None) -> None:
        """FrameSocket's `on_lost` (its threads): say how the stream ended, on the loop."""
        loop = self._loop
        if loop is not None and not loop.is_closed():
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                loop.call_soon_threadsafe(self._on_lost, exc)

    async def _watch_keepalive(self) -> None:
        """End the stream UNAVAILABLE when the coordinator stops answering keepalive pings.

        A frozen coordinator (SIGSTOP, a paused VM, a dead host the kernel has not
        reset yet) still has its kernel accept our bytes, so the frames alone would
        wait for the step timeout. The FramePort channel stays open beside them with
        gRPC's keepalive pings (`channel_options`), answered by gRPC's core threads
        even while the coordinator's Python is busy; its connection going down is
        the coordinator going away.
        """
        channel = self._keepalive
        if channel is None:
            return
        state = channel.get_state()
        while state == grpc.ChannelConnectivity.READY:
            await channel.wait_for_state_change(state)
            state = channel.get_state()
        if self.ended is None and not self._closing:
            details = (
                "the coordinator's gRPC port stopped answering (its keepalive pings went "
                f"unanswered, or the connection dropped: {state.name}) while the frame "
                "stream was open: it froze or went away"
            )
            self._finish(self._ended(EndKind.STATUS, Code.UNAVAILABLE, details))
            self._stop_soon()

    def _tls_context(self) -> ssl.SSLContext | None:
        security = self._security
        if not security.tls:
            return None
        context = ssl.create_default_context(
            cadata=(security.root_certificates or b"").decode("ascii")
        )
        if security.cert_path is not None and security.key_path is not None:
            context.load_cert_chain(security.cert_path, security.key_path)
        return context

    def _use_grpc(self) -> None:
        """Open the same stream over gRPC (StreamClient's own way), on the channel that asked.

        Reusing it keeps the connection the join wait has seen up (a second channel
        would be a second connect, and a moment in which `connected` is False).
        """
        self.pipe = "grpc"
        channel, self._keepalive = self._keepalive, None
        if self.ended is not None or self._closing:
            if channel is not None:
                self._channel = channel  # closed by `_stop`
            return
        done = self._done  # `close` may be waiting on it already
        super().start(channel)
        self._done = done

    # ------------------------------------------------------------ frames
    def _on_frame(self, kind: int, body: bytearray) -> None:
        if kind == MESSAGE:
            if self._status is not None:
                raise FrameError("a message after the STATUS frame")
            self._on_message(body)
        elif kind == STATUS:
            self._status = decode_status(body)
        else:
            raise FrameError(f"a frame of kind {kind} from the coordinator")

    def _on_lost(self, exc: BaseException | None) -> None:
        if self._status is not None:
            code, details = self._status
            self._finish(self._ended(EndKind.STATUS, code, details))
        elif isinstance(exc, TimeoutError):  # a FrameSocket's write
            self._finish(self._timeout(Code.DEADLINE_EXCEEDED, str(exc), "write"))
        elif isinstance(exc, FrameError):
            self._finish(self._ended(EndKind.STATUS, Code.INTERNAL, f"frame stream: {exc}", exc))
        elif exc is not None and not isinstance(exc, OSError):
            self._finish(self._ended(EndKind.FAULT, Code.UNKNOWN, repr(exc), exc))
        else:
            what = f": {exc}" if exc is not None else ""
            details = f"the coordinator closed the frame connection without a status{what}"
            self._finish(self._ended(EndKind.STATUS, Code.UNAVAILABLE, details, exc))
        self._stop_soon()

    def _pause_writing(self) -> None:
        self._writable = asyncio.Event()

    def _resume_writing(self) -> None:
        if self._writable is not None:
            self._writable.set()
        self._writable = None

    async def _write(self) -> None:
        if self.pipe != "frames":
            await super()._write()
            return
        frames = self._socket
        if frames is not None:  # threads write; only `close` still queues (its farewell)
            while (item := await self._queue.get()) is not _END_WRITES:
                self.send(item)
            return
        transport = self._transport
        assert transport is not None
        timeout_s = self.write_timeout_s
        try:
            while True:
                item = await self._queue.get()
                if item is _END_WRITES:
                    return  # the farewell (a Leave) ends the stream at the coordinator
                for message in self._encode(item):
                    if transport.is_closing():
                        return  # the reader reports how it ended
                    write_message(transport, message)
                    writable = self._writable
                    if writable is not None:
                        timeout_s = self.write_timeout_s
                        await asyncio.wait_for(writable.wait(), timeout_s)
        except TimeoutError:
            details = f"a write took longer than {timeout_s:g}s"
            self._finish(self._timeout(Code.DEADLINE_EXCEEDED, details, "write"))
        except Exception as exc:  # an encoder's bug
            self._finish(self._ended(EndKind.FAULT, Code.UNKNOWN, repr(exc), exc))
        if self.ended is not None:
            self._stop_soon()

    # ------------------------------------------------------------ ending
    def _stop_soon(self) -> None:
        if self._transport is not None:
            self._transport.abort()
        if self._socket is not None:
            self._socket.stop()
        super()._stop_soon()

    async def _stop(self) -> None:
        await super()._stop()
        channel, self._keepalive = self._keepalive, None
        if channel is not None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(channel.close(), TASK_END_TIMEOUT_S)


async def _connect(host: str, port: int) -> socket.socket:
    """A connected non-blocking TCP socket to `host`:`port` (each address tried in turn)."""
    loop = asyncio.get_running_loop()
    failure: OSError = OSError(f"{host} resolves to no address")
    for family, kind, proto, _, address in await loop.getaddrinfo(
        host, port, type=socket.SOCK_STREAM
    ):
        sock = socket.socket(family, kind, proto)
        sock.setblocking(False)
        try:
            await loop.sock_connect(sock, address)
            return sock
        except OSError as exc:
            sock.close()
            failure = exc
        except BaseException:  # cancelled (the connect timeout)
            sock.close()
            raise
    raise failure
