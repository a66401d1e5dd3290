"""A stream as frames on a socket: the frame pipe, and the discovery that picks it or gRPC.

`FrameDiscovery` is a `StreamClient`'s `Discovery` for a worker's streams (its
Sync stream, and its shard data streams, which stay on gRPC while a shard
offers no frame port):

1. It asks the coordinator's gRPC port where its frame port is (the
   `FramePort` RPC, with the token and TLS of every call, waiting for a
   coordinator that is not up yet as the gRPC stream would, bounded by the
   stream's `connect_timeout_s`). A refusal
   (a wrong token, say) ends the stream with the coordinator's status, as
   the gRPC stream would have.
2. It connects to that port on the same host, with the same TLS trust and
   client certificate, and sends its HELLO (the token): the stream runs on a
   `FramePipe`.
3. When there is no frame port (an older coordinator, a standby, one
   started with `--frame-port -1`), or it cannot be reached (a firewall or a
   port mapping that lets only the gRPC port through), the stream runs on a
   `GrpcPipe` over the channel that asked, and a refused connection says so
   in the log.

`GRADSYNC_FRAMES=0` in the worker's environment skips the frame port.

`FramePipe` runs on a `FrameSocket`, plain or TLS (threads: `on_message` is
called on its reader thread, and a small item is written by the thread that
sends it). Any stream whose peer serves frames can run on it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import ssl
from collections.abc import Callable
from typing import Any

import grpc

from gradsync_proto.codes import Code
from gradsync_proto.net.address import parse_address
from gradsync_proto.net.channels import ChannelSecurity
from gradsync_proto.net.frame_socket import Framed, FrameSocket
from gradsync_proto.net.frames import MESSAGE, STATUS, FrameError, decode_status, hello_frame
from gradsync_proto.net.stream_client import END_WRITES, EndKind, GrpcPipe, Pipe, StreamClient
from gradsync_proto.v1 import gradsync_pb2 as pb

log = logging.getLogger("gradsync.net")

__all__ = [
    "ENV_FRAMES",
    "FRAME_PORT_METHOD",
    "FrameDiscovery",
    "FramePipe",
    "frames_enabled",
]

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


class FrameDiscovery:
    """The frame port where the coordinator offers one and it connects, else gRPC.

    Args:
        max_message_bytes: the longest frame body read.
        inline: whether an item is small enough for the thread that sends it to
            write it (default: none is; the rest go to the socket's writer thread).
    """

    def __init__(
        self, max_message_bytes: int, inline: Callable[[Any], bool] = lambda item: False
    ) -> None:
        self._max_message_bytes = max_message_bytes
        self._inline = inline
        #: The channel of the FramePort question while it is asked.
        self._asking: grpc.aio.Channel | None = None

    @property
    def connected(self) -> bool:
        # Asking, or connecting the frames: the coordinator answers on its gRPC port.
        channel = self._asking
        return channel is not None and channel.get_state() == grpc.ChannelConnectivity.READY

    async def pipe(self, stream: StreamClient) -> Pipe | None:
        if not frames_enabled():
            return GrpcPipe()
        options = [*stream.options, ("grpc.client_idle_timeout_ms", _NEVER_IDLE_MS)]
        channel = stream.security.aio_channel(stream.target, options)
        self._asking = channel
        kept = False
        try:
            try:
                port = await asyncio.wait_for(
                    self._ask_frame_port(stream, channel), stream.connect_timeout_s
                )
            except TimeoutError:
                await stream.connect_timed_out(stream.connect_timeout_s or 0.0)
                return None
            if port is None:
                return None
            kept = True
            if port == 0 or stream.ended is not None or stream.closing:
                return GrpcPipe(channel)  # (freed unstarted when the stream ended)
            try:
                sock = await asyncio.wait_for(
                    _connect(parse_address(stream.target).host, port, stream.security),
                    FRAME_CONNECT_TIMEOUT_S,
                )
            except (OSError, TimeoutError) as exc:
                log.warning(
                    "%s: the coordinator's frame port %d at %s cannot be reached (%s); "
                    "using its gRPC port instead (slower for small models: open the frame "
                    "port too, see the README)",
                    stream.name,
                    port,
                    parse_address(stream.target).host,
                    exc,
                )
                # Reusing the channel keeps the connection the join wait has seen up (a
                # second channel would be a second connect, and a moment in which
                # `connected` is False).
                return GrpcPipe(channel)
            log.debug("%s: stream on frames at %s:%d", stream.name, sock.getpeername()[0], port)
            return FramePipe(sock, self._max_message_bytes, self._inline, keepalive=channel)
        finally:
            self._asking = None
            if not kept:
                await channel.close()

    async def _ask_frame_port(self, stream: StreamClient, channel: grpc.aio.Channel) -> int | None:
        """The FramePort RPC's answer (0: none, or not implemented); None: it ended the stream."""
        ask = channel.unary_unary(
            FRAME_PORT_METHOD,
            request_serializer=pb.FramePortRequest.SerializeToString,
            response_deserializer=pb.FramePortReply.FromString,
        )
        try:
            reply = await ask(
                pb.FramePortRequest(),
                metadata=stream.security.metadata,
                wait_for_ready=stream.wait_for_ready,
            )
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.UNIMPLEMENTED:  # a coordinator without frames
                return 0
            code = int(exc.code().value[0])
            stream.end(EndKind.STATUS, code, exc.details() or "", exc)
            return None
        return int(reply.port)


class FramePipe:
    """A stream on a frame connection (a `FrameSocket`: threads), HELLO first.

    Args:
        sock: connected (TLS: after its handshake).
        max_message_bytes: the longest frame body read.
        inline: whether the thread that sends an item writes it.
        keepalive: a gRPC channel to the same coordinator, kept open beside the
            frames for its keepalive pings (`_watch_keepalive`); owned.
    """

    name = "frames"
    threadsafe = True

    def __init__(
        self,
        sock: socket.socket,
        max_message_bytes: int,
        inline: Callable[[Any], bool],
        *,
        keepalive: grpc.aio.Channel | None = None,
    ) -> None:
        self._sock = sock
        self._max_message_bytes = max_message_bytes
        self._inline = inline
        self._keepalive = keepalive
        self._status: tuple[int, str] | None = None
        self._stream: StreamClient | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._frames: FrameSocket | None = None
        #: What `put` got before `start`, in order (the stream's queue, handed over).
        self._early: list[object] = []

    def start(self, stream: StreamClient) -> None:
        self._stream = stream
        self._loop = asyncio.get_running_loop()
        frames = FrameSocket(
            self._sock,
            self._max_message_bytes,
            self._on_frame,
            self._on_socket_lost,
            stream.encode,
            write_timeout_s=lambda: stream.write_timeout_s,
            name=stream.name,
        )
        frames.put(Framed(hello_frame(stream.security.token)), inline=True)
        for item in self._early:
            frames.put(item, inline=self._inline(item))
        self._early.clear()
        self._frames = frames
        frames.start()
        if self._keepalive is not None:
            stream.spawn(self._watch_keepalive(stream, self._keepalive), "keepalive")

    def put(self, item: object) -> None:
        if item is END_WRITES:
            return  # the farewell (a Leave) ends the stream at the coordinator
        frames = self._frames
        if frames is None:
            self._early.append(item)
        else:
            frames.put(item, inline=self._inline(item))

    def stop(self) -> None:
        if self._frames is not None:
            self._frames.stop()

    async def release(self) -> None:
        if self._frames is None:
            self._sock.close()  # never started: the socket is still this pipe's
        channel, self._keepalive = self._keepalive, None
        if channel is not None:
            await channel.close()

    @property
    def connected(self) -> bool:
        return self._frames is not None and not self._frames.closed

    @property
    def side_channel(self) -> grpc.aio.Channel | None:
        """The keepalive channel, which no frame travels on (for small calls that must
        not wait behind the frames: a worker's heartbeats, `Coordinator.Beat`)."""
        return self._keepalive

    # ------------------------------------------------------------ the socket's threads
    def _on_frame(self, kind: int, body: bytearray) -> None:
        """A frame (the socket's reader thread): a message for the stream, or its status."""
        assert self._stream is not None
        if kind == MESSAGE:
            if self._status is not None:
                raise FrameError("a message after the STATUS frame")
            self._stream.on_message(body)
        elif kind == STATUS:
            self._status = decode_status(body)
        else:
            raise FrameError(f"a frame of kind {kind} from the coordinator")

    def _on_socket_lost(self, exc: BaseException | None) -> None:
        """The socket's `on_lost` (its threads): say how the stream ended, on the loop."""
        loop = self._loop
        if loop is not None and not loop.is_closed():
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                loop.call_soon_threadsafe(self._lost, exc)

    def _lost(self, exc: BaseException | None) -> None:
        stream = self._stream
        assert stream is not None
        if self._status is not None:
            code, details = self._status
            stream.end(EndKind.STATUS, code, details)
        elif isinstance(exc, TimeoutError):  # a write
            stream.end(EndKind.TIMEOUT, Code.DEADLINE_EXCEEDED, str(exc), bound="write")
        elif isinstance(exc, FrameError):
            stream.end(EndKind.STATUS, Code.INTERNAL, f"frame stream: {exc}", exc)
        elif exc is not None and not isinstance(exc, OSError):
            stream.end(EndKind.FAULT, Code.UNKNOWN, repr(exc), exc)
        else:
            what = f": {exc}" if exc is not None else ""
            details = f"the coordinator closed the frame connection without a status{what}"
            stream.end(EndKind.STATUS, Code.UNAVAILABLE, details, exc)

    # ------------------------------------------------------------ liveness
    async def _watch_keepalive(self, stream: StreamClient, channel: grpc.aio.Channel) -> None:
        """End the stream UNAVAILABLE when the coordinator stops answering keepalive pings.

        A frozen coordinator (SIGSTOP, a paused VM, a dead host the kernel has not
        reset yet) still has its kernel accept our bytes, so the frames alone would
        wait for the step timeout. The FramePort channel stays open beside them with
        gRPC's keepalive pings (`channel_options`), answered by gRPC's core threads
        even while the coordinator's Python is busy; its connection going down is
        the coordinator going away.
        """
        state = channel.get_state()
        while state == grpc.ChannelConnectivity.READY:
            await channel.wait_for_state_change(state)
            state = channel.get_state()
        if stream.ended is None and not stream.closing:
            details = (
                "the coordinator's gRPC port stopped answering (its keepalive pings went "
                f"unanswered, or the connection dropped: {state.name}) while the frame "
                "stream was open: it froze or went away"
            )
            stream.end(EndKind.STATUS, Code.UNAVAILABLE, details)


async def _connect(host: str, port: int, security: ChannelSecurity) -> socket.socket:
    """A connected non-blocking TCP socket to `host`:`port` (each address tried in turn),
    wrapped in TLS (handshake done) when `security` has it."""
    loop = asyncio.get_running_loop()
    failure: OSError = OSError(f"{host} resolves to no address")
    for family, kind, proto, _, address in await loop.getaddrinfo(
        host, port, type=socket.SOCK_STREAM
    ):
        sock = socket.socket(family, kind, proto)
        sock.setblocking(False)
        try:
            await loop.sock_connect(sock, address)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            context = security.ssl_context()
            if context is not None:  # (`sock` becomes the TLS socket: closed as one below)
                sock = context.wrap_socket(
                    sock, server_hostname=host, do_handshake_on_connect=False
                )
                await _handshake(loop, sock)
            return sock
        except OSError as exc:
            sock.close()
            failure = exc
        except BaseException:  # cancelled (the connect timeout)
            sock.close()
            raise
    raise failure


async def _handshake(loop: asyncio.AbstractEventLoop, sock: ssl.SSLSocket) -> None:
    """Run a non-blocking socket's TLS handshake on the loop."""
    while True:
        try:
            sock.do_handshake()
            return
        except ssl.SSLWantReadError:
            await _ready(loop, sock, writing=False)
        except ssl.SSLWantWriteError:
            await _ready(loop, sock, writing=True)


async def _ready(loop: asyncio.AbstractEventLoop, sock: socket.socket, *, writing: bool) -> None:
    """Wait until `sock` can be read (or written) on the loop."""
    ready = loop.create_future()
    fd = sock.fileno()
    add, remove = (
        (loop.add_writer, loop.remove_writer) if writing else (loop.add_reader, loop.remove_reader)
    )
    add(fd, lambda: None if ready.done() else ready.set_result(None))
    try:
        await ready
    finally:
        remove(fd)
