"""One bidirectional stream, as the side that dials it sees it, over a pluggable pipe.

Every gradsync process that dials a stream needs the same machinery: the
worker's Sync stream to the coordinator (`gradsync.control.transport`), its data
streams to the coordinator's shards (`gradsync.path.shard_streams`), and a
shard's control link to its leader (`gradsync_server.rpc.shard_link`).
`StreamClient` is that machinery once:

- a writer: `send` queues an item and never blocks; the pipe turns it into
  wire messages with `encode` only when it writes it (so that what it says, a
  heartbeat's step or a chunk's epoch, is read at send time), each write
  bounded by `write_timeout_s`;
- a reader: each message is handed to `on_message`, in order;
- bounds: connecting is bounded by `connect_timeout_s` (a TLS handshake that
  fails is then named, not retried in silence), and closing waits for the
  peer's goodbye at most `timeout_s`, then cancels, and waits for its own
  tasks at most `TASK_END_TIMEOUT_S`: closing never hangs;
- one error boundary: however the stream ends (the peer's status, a clean
  end, a bound that ran out, a handler that raised, this side closing), that
  becomes one `StreamEnded` value, handed once to `on_end` and kept in `ended`.

How the bytes travel is a `Pipe` (start / put / stop): `GrpcPipe` here, the
reference, which is the only code that catches gRPC's exceptions, and
`gradsync_proto.net.frame_stream.FramePipe`, length-prefixed frames on a
socket. A `Discovery` picks the pipe before the stream starts (the worker's
Sync stream asks the coordinator for its frame port); without one the stream
runs on gRPC. Items sent before the pipe is open wait in the stream's queue
and go first, in order.

Threads. Construction, `start`, `send`, `close` and `wait` belong to the event
loop `start` is called on (`send_threadsafe` is for any other thread).
`on_end` is always called on that loop. `on_message` is called on the
thread that reads the pipe, one message at a time: the loop for gRPC, the
frame socket's reader thread for frames (so that an answer reaches a waiting
training thread without crossing the loop).

Messages are raw bytes both ways unless `serializer` / `deserializer` are
given (the worker encodes and decodes gradient chunks itself, without copying
payloads through protobuf objects).
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import threading
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import grpc

from gradsync_proto.codes import Code
from gradsync_proto.net.channels import ChannelSecurity, handshake_failure

log = logging.getLogger("gradsync.net")

__all__ = [
    "END_WRITES",
    "TASK_END_TIMEOUT_S",
    "Discovery",
    "EndKind",
    "GrpcPipe",
    "Pipe",
    "StreamClient",
    "StreamEnded",
]

#: Bound on the wait for a stream's own tasks (and channel) to end once cancelled.
TASK_END_TIMEOUT_S = 5.0

#: Given to a pipe's `put` when the stream closes: write no more (half-close).
END_WRITES = object()


class EndKind(enum.Enum):
    """How a stream ended."""

    #: The call ended with a status (the peer's, or gRPC's own): OK is a clean end.
    STATUS = "status"
    #: This side closed the stream before it had ended.
    CLOSED = "closed"
    #: A bound ran out: the connection, a silence or a write (`details` says which).
    TIMEOUT = "timeout"
    #: `on_message` or `encode` raised (`cause`): a bug, not the network.
    FAULT = "fault"


#: The details grpc-python's client gives a call whose write failed in core
#: (`set_internal_error`), overriding whatever status the peer sent or would send.
CORE_WRITE_FAILURE = "Internal error from Core"


@dataclass(frozen=True)
class StreamEnded:
    """Why a stream ended: the one value every way of ending becomes.

    Attributes:
        kind: how it ended.
        code: the status number (google.rpc.Code, as gRPC reported it: also one
            `Code` does not name) of STATUS; CANCELLED (CLOSED); DEADLINE_EXCEEDED,
            or UNAVAILABLE for a connection never ready (TIMEOUT); UNKNOWN (FAULT).
        details: the status details, or what ran out, or the fault, in words.
        closing: this side had begun closing (an end is then expected).
        cause: the exception it ended with, if any (chain it to the caller's error).
        bound: which bound ran out (TIMEOUT): "connect", "idle" or "write"; else "".
    """

    kind: EndKind
    code: int
    details: str
    closing: bool = False
    cause: BaseException | None = None
    bound: str = ""

    @property
    def clean(self) -> bool:
        """The peer ended the stream with OK."""
        return self.kind is EndKind.STATUS and self.code == Code.OK


class Pipe(Protocol):
    """How a stream's messages travel, once it is open.

    A pipe reports what it reads to `stream.on_message` (on its reader) and
    how it ended with `stream.end` (on the loop). It runs its loop tasks
    through `stream.spawn`, so that the stream cancels and awaits them.
    """

    #: "grpc" or "frames".
    name: str
    #: Whether `put` may be called from any thread (else only on the loop).
    threadsafe: bool

    def start(self, stream: StreamClient) -> None:
        """Begin reading and writing (loop; returns at once)."""

    def put(self, item: object) -> None:
        """Write `item` after everything put before it; `END_WRITES`: half-close. Never blocks."""

    def stop(self) -> None:
        """Stop reading and writing now (loop; idempotent); what it holds is freed by `release`."""

    async def release(self) -> None:
        """Free the connection (loop; bounded by the caller)."""

    @property
    def connected(self) -> bool:
        """The connection is up (a goodbye can reach the peer)."""
        ...


class Discovery(Protocol):
    """Picks a stream's pipe before the stream starts (on the loop)."""

    @property
    def connected(self) -> bool:
        """While picking: the peer can be reached (a goodbye can reach it)."""
        ...

    async def pipe(self, stream: StreamClient) -> Pipe | None:
        """The pipe to run on; None when picking ended the stream (`stream.end` was called).

        Cancelled when the stream is closed meanwhile: it frees what it opened.
        """
        ...


def _bytes(item: object) -> Iterable[object]:
    """The default `encode`: the item is one message as it is."""
    return (item,)


class StreamClient:
    """One bidirectional stream on its own connection: queue, pipe, ending, bounded close.

    Args:
        target: "host:port" to dial.
        method: the full method name ("/gradsync.v1.Coordinator/Sync").
        on_message: called with every message read, in order, on the thread that
            reads the pipe (module docstring; quick). What it raises ends the
            stream as a FAULT.
        on_end: called once with why the stream ended (loop thread; must not raise).
        security: TLS and token of the call (default: plaintext, no token).
        options: the channel's gRPC options.
        encode: the wire messages of a queued item (default: the item itself).
        serializer, deserializer: for protobuf messages both ways (default: raw bytes;
            gRPC pipe only).
        wait_for_ready: wait for the server instead of failing at once when it is
            not there yet (bound it with `connect_timeout_s` or the caller's own wait).
        connect_timeout_s: the connection must be READY this soon; None = unbounded.
        idle_timeout_s: the longest silence of the peer once started; None = unbounded.
            May be changed while the stream runs (read before each wait; gRPC pipe).
        write_timeout_s: the longest a single write may take; None = unbounded.
            May be changed while the stream runs (read before each write).
        name: for log messages and task names.
        discovery: picks the pipe when the stream starts; None = gRPC.
        loop: the loop `start` will be called on (for `send_threadsafe` before it).
    """

    def __init__(
        self,
        target: str,
        method: str,
        on_message: Callable[[Any], None],
        on_end: Callable[[StreamEnded], None],
        *,
        security: ChannelSecurity | None = None,
        options: Sequence[tuple[str, Any]] = (),
        encode: Callable[[Any], Iterable[Any]] = _bytes,
        serializer: Callable[[Any], bytes] | None = None,
        deserializer: Callable[[bytes], Any] | None = None,
        wait_for_ready: bool = True,
        connect_timeout_s: float | None = None,
        idle_timeout_s: float | None = None,
        write_timeout_s: float | None = None,
        name: str = "stream",
        discovery: Discovery | None = None,
        loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        self.target = target
        self.name = name
        self.method = method
        self.on_message = on_message
        self._on_end = on_end
        self.security = security or ChannelSecurity()
        self.options = list(options)
        self.encode = encode
        self.serializer = serializer
        self.deserializer = deserializer
        self.wait_for_ready = wait_for_ready
        self.connect_timeout_s = connect_timeout_s
        self.idle_timeout_s = idle_timeout_s
        self.write_timeout_s = write_timeout_s
        self._discovery = discovery
        #: Items sent before the pipe is open, in order.
        self._queue: list[object] = []
        self._pipe: Pipe | None = None
        #: Other threads put into the pipe themselves (it is open and takes them).
        self._direct = False
        self._tasks: list[asyncio.Task[None]] = []
        self._closing = False
        self._done: asyncio.Event | None = None
        self._loop = loop
        #: Items `send_threadsafe` handed to the loop that it has not sent yet: while
        #: there are any, later ones go the same way (a thread's items keep their order).
        self._hops = 0
        self._hops_lock = threading.Lock()
        #: Why the stream ended; None while it runs (or before it started).
        self.ended: StreamEnded | None = None

    # ------------------------------------------------------------ public API
    def start(self) -> None:
        """Pick the pipe and open it (loop; returns at once)."""
        self._done = asyncio.Event()
        self._loop = asyncio.get_running_loop()
        if self._discovery is None:
            self._open(GrpcPipe())
        else:
            self.spawn(self._discover(self._discovery), "discover")

    @property
    def pipe(self) -> str:
        """The pipe's name ("grpc", "frames"); "" while it is being picked."""
        return self._pipe.name if self._pipe is not None else ""

    @property
    def side_channel(self) -> Any:
        """A gRPC channel to the same peer that carries none of this stream's bytes
        (a `grpc.aio.Channel`: the frame pipe's keepalive channel), or None (gRPC pipe)."""
        return getattr(self._pipe, "side_channel", None)

    def send(self, item: object) -> None:
        """Queue `item` for writing (loop thread). Never blocks; dropped once the stream ended."""
        if self.ended is not None:
            return
        pipe = self._pipe
        if pipe is None:
            self._queue.append(item)
        else:
            pipe.put(item)

    def send_threadsafe(self, item: object) -> None:
        """`send` from any thread, keeping the order of the calling thread's items.

        On a pipe that takes items from any thread (frames) a small item is
        written by the calling thread; otherwise it is handed to the loop.
        """
        pipe = self._pipe
        if self._direct and self._hops == 0 and pipe is not None:
            if self.ended is None:
                pipe.put(item)
            return
        loop = self._loop
        if loop is None:
            raise RuntimeError(f"{self.name}: send_threadsafe before start")
        with self._hops_lock:
            self._hops += 1
        loop.call_soon_threadsafe(self._hopped, item)

    @property
    def connected(self) -> bool:
        """The connection is up (a goodbye can reach the peer)."""
        if self._pipe is not None:
            return self._pipe.connected
        return self._discovery is not None and self._discovery.connected

    async def wait(self, timeout_s: float | None = None) -> StreamEnded | None:
        """Wait (bounded) until the stream ended; return why, or None if it still runs."""
        if self.ended is None and self._done is not None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._done.wait(), timeout_s)
        return self.ended

    async def close(self, timeout_s: float, farewell: object | None = None) -> None:
        """End the stream: say `farewell` and half-close, wait for the peer (bounded), cancel.

        The goodbye is sent only while the stream runs and the connection is up
        (without one there is nobody to wait for). Then the pipe is stopped, the
        tasks awaited (at most `TASK_END_TIMEOUT_S`) and the connection freed.
        Idempotent; `on_end` gets CLOSED if nothing ended it first.
        """
        self._closing = True
        started = self._done is not None
        if farewell is not None and self.ended is None and started and self.connected:
            self.send(farewell)
            self.send(END_WRITES)
            await self.wait(timeout_s)
        self._finish(StreamEnded(EndKind.CLOSED, Code.CANCELLED, "closed by this side", True))
        await self._stop()

    # ------------------------------------------------------------ for pipes
    @property
    def closing(self) -> bool:
        """This side has begun closing (an end is then expected)."""
        return self._closing

    def spawn(self, coroutine: Awaitable[None], what: str) -> None:
        """Run `coroutine` as one of the stream's tasks (loop): cancelled and awaited at the end."""
        task = asyncio.ensure_future(coroutine)
        task.set_name(f"gradsync-{self.name}-{what}")
        self._tasks.append(task)

    def end(
        self,
        kind: EndKind,
        code: int,
        details: str,
        cause: BaseException | None = None,
        bound: str = "",
    ) -> None:
        """The stream ended (loop): record why (the first end only), tell `on_end`, stop."""
        self._finish(StreamEnded(kind, code, details, self._closing, cause, bound))
        self._stop_soon()

    async def connect_timed_out(self, timeout_s: float) -> None:
        """The connection was not up within `timeout_s` (loop): `end` as TIMEOUT, saying why.

        gRPC retries a failed TLS handshake as quietly as a refused connection:
        the handshake is tried once more with Python's `ssl` to say which it was.
        """
        if self.ended is not None or self._closing:
            return
        tls = await asyncio.to_thread(handshake_failure, self.target, self.security)
        details = f"could not connect within {timeout_s:g}s" + (f": {tls}" if tls else "")
        self.end(EndKind.TIMEOUT, Code.UNAVAILABLE, details, bound="connect")

    # ------------------------------------------------------------ opening
    async def _discover(self, discovery: Discovery) -> None:
        try:
            pipe = await discovery.pipe(self)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a bug: end the stream and say so, never hang
            self.end(EndKind.FAULT, Code.UNKNOWN, repr(exc), exc)
            return
        if pipe is not None:
            self._open(pipe)

    def _open(self, pipe: Pipe) -> None:
        """Hand the queued items to `pipe`, in order, then run on it (loop)."""
        for item in self._queue:
            pipe.put(item)
        self._queue.clear()
        self._pipe = pipe
        if self.ended is None and not self._closing:  # (else only freed, by `close`)
            pipe.start(self)
            # Only now may another thread put straight into it: the queue went first.
            self._direct = pipe.threadsafe

    def _hopped(self, item: object) -> None:
        self.send(item)  # before the count drops: a later item must not overtake it
        with self._hops_lock:
            self._hops -= 1

    # ------------------------------------------------------------ ending
    def _finish(self, ended: StreamEnded) -> None:
        """Record the first end and tell `on_end`; later ends are not news."""
        if self.ended is not None:
            return
        self.ended = ended
        if self._done is not None:
            self._done.set()
        try:
            self._on_end(ended)
        except Exception:  # the boundary: a broken callback must not break the loop
            log.exception("%s: the end-of-stream handler failed", self.name)

    def _stop_soon(self) -> None:
        """Once ended: stop the pipe and cancel the other tasks (they are not awaited)."""
        if self._pipe is not None:
            self._pipe.stop()
        current = asyncio.current_task()
        for task in self._tasks:
            if task is not current:
                task.cancel()

    async def _stop(self) -> None:
        """Stop the pipe, cancel the tasks, wait for them (bounded), free the connection."""
        self._stop_soon()
        current = asyncio.current_task()
        tasks = [task for task in self._tasks if task is not current]
        if tasks:
            await asyncio.wait(tasks, timeout=TASK_END_TIMEOUT_S)
        for task in tasks:  # retrieve what they raised: no "exception never retrieved"
            if task.done() and not task.cancelled():
                task.exception()
        if self._pipe is not None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._pipe.release(), TASK_END_TIMEOUT_S)


class GrpcPipe:
    """The stream as a gRPC call on its own channel (all on the loop).

    Args:
        channel: the channel to call on, then owned (default: a new one to the
            stream's target, with its security and options).
    """

    name = "grpc"
    threadsafe = False

    def __init__(self, channel: grpc.aio.Channel | None = None) -> None:
        self._channel = channel
        self._queue: asyncio.Queue[object] = asyncio.Queue()
        self._call: Any = None

    def start(self, stream: StreamClient) -> None:
        if self._channel is None:
            self._channel = stream.security.aio_channel(stream.target, stream.options)
        multi = self._channel.stream_stream(
            stream.method,
            request_serializer=stream.serializer,
            response_deserializer=stream.deserializer,
        )
        metadata = stream.security.metadata
        self._call = multi(metadata=metadata, wait_for_ready=stream.wait_for_ready)
        stream.spawn(self._read(stream), "read")
        stream.spawn(self._write(stream), "write")
        if stream.connect_timeout_s is not None:
            stream.spawn(self._watch_connect(stream, stream.connect_timeout_s), "connect")

    def put(self, item: object) -> None:
        self._queue.put_nowait(item)

    def stop(self) -> None:
        if self._call is not None:
            self._call.cancel()

    async def release(self) -> None:
        if self._channel is not None:
            await self._channel.close()

    @property
    def connected(self) -> bool:
        channel = self._channel
        return channel is not None and channel.get_state() == grpc.ChannelConnectivity.READY

    async def _read(self, stream: StreamClient) -> None:
        """Hand every message to `on_message` until the call ends; then say why."""
        try:
            messages = self._call.__aiter__()
            while True:
                idle_s = stream.idle_timeout_s
                try:
                    message = await asyncio.wait_for(anext(messages), idle_s)
                except StopAsyncIteration:
                    stream.end(EndKind.STATUS, Code.OK, "")
                    return
                except TimeoutError:
                    details = f"the peer was silent for more than {idle_s:g}s"
                    stream.end(EndKind.TIMEOUT, Code.DEADLINE_EXCEEDED, details, bound="idle")
                    return
                stream.on_message(message)
        except grpc.aio.AioRpcError as exc:
            code, details = int(exc.code().value[0]), exc.details() or ""
            if code == Code.INTERNAL and details == CORE_WRITE_FAILURE:
                # grpc-python replaces the call's status with this when a write fails in
                # core because the call is over (a peer gone, a connection reset): the
                # peer's own status is lost, and what is known is a broken transport.
                code = int(Code.UNAVAILABLE)
                details = f"the stream broke under a write (gRPC: {CORE_WRITE_FAILURE})"
            stream.end(EndKind.STATUS, code, details, exc)
        except asyncio.CancelledError:
            stream.end(EndKind.CLOSED, Code.CANCELLED, "closed by this side")
            raise
        except Exception as exc:  # a handler's bug: end the stream and say so, never hang
            stream.end(EndKind.FAULT, Code.UNKNOWN, repr(exc), exc)

    async def _write(self, stream: StreamClient) -> None:
        """Write every queued item's messages (each bounded); half-close at `END_WRITES`."""
        timeout_s = stream.write_timeout_s
        try:
            while True:
                item = await self._queue.get()
                timeout_s = stream.write_timeout_s
                if item is END_WRITES:
                    await asyncio.wait_for(self._call.done_writing(), timeout_s)
                    return
                for message in stream.encode(item):
                    await asyncio.wait_for(self._call.write(message), timeout_s)
        except TimeoutError:
            details = f"a write took longer than {timeout_s:g}s"
            stream.end(EndKind.TIMEOUT, Code.DEADLINE_EXCEEDED, details, bound="write")
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError):
            return  # the call has ended: the reader reports its status
        except Exception as exc:  # an encoder's bug
            stream.end(EndKind.FAULT, Code.UNKNOWN, repr(exc), exc)

    async def _watch_connect(self, stream: StreamClient, timeout_s: float) -> None:
        """End the stream when the connection is not READY within `timeout_s`."""
        assert self._channel is not None
        try:
            await asyncio.wait_for(self._channel.channel_ready(), timeout_s)
        except TimeoutError:
            await stream.connect_timed_out(timeout_s)
