"""One bidirectional gRPC stream, as the side that dials it sees it.

Every gradsync process that dials a stream needs the same machinery: the
worker's Sync stream to the coordinator (`gradsync.path.transport`), its data
streams to the coordinator's shards (`gradsync.path.shard_streams`), and a
shard's control link to its leader (`gradsync_server.rpc.shard_link`). Each
used to build its own queue, reader task, cancellation and translation of
gRPC's errors; `StreamClient` is that machinery once:

- a writer: `send` queues an item and never blocks; the writer task turns it
  into wire messages with `encode` only when it reaches it (so that what it
  says, a heartbeat's step or a chunk's epoch, is read at send time), and
  writes each one under `write_timeout_s`;
- a reader: each message is handed to `on_message`, in order, on the loop;
  a silence longer than `idle_timeout_s` ends the stream;
- bounds: the connection must be READY within `connect_timeout_s` (a TLS
  handshake that fails is then named, not retried in silence), and closing
  waits for the peer's goodbye at most `timeout_s`, then cancels, and waits for
  its own tasks at most `TASK_END_TIMEOUT_S`: closing never hangs;
- one error boundary: however the stream ends (the peer's status, a clean
  end, a bound that ran out, a handler that raised, this side closing), that
  becomes one `StreamEnded` value, handed once to `on_end` and kept in
  `ended`. Only this module catches gRPC's exceptions.

Messages are raw bytes both ways unless `serializer` / `deserializer` are
given (the worker encodes and decodes gradient chunks itself, without copying
payloads through protobuf objects).

Everything but construction runs on the event loop of the caller of
`start`; another thread hands items over with `loop.call_soon_threadsafe`.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import grpc

from gradsync_proto.codes import Code
from gradsync_proto.net.channels import ChannelSecurity, handshake_failure

log = logging.getLogger("gradsync.net")

__all__ = ["TASK_END_TIMEOUT_S", "EndKind", "StreamClient", "StreamEnded"]

#: Bound on the wait for a stream's own tasks (and channel) to end once cancelled.
TASK_END_TIMEOUT_S = 5.0

#: In the writer's queue: write no more (half-close), the peer ends the stream.
_END_WRITES = object()


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


def _bytes(item: object) -> Iterable[object]:
    """The default `encode`: the item is one message as it is."""
    return (item,)


class StreamClient:
    """One bidirectional stream on its own channel: writer queue, reader loop, bounded close.

    Args:
        target: "host:port" to dial.
        method: the full method name ("/gradsync.v1.Coordinator/Sync").
        on_message: called with every message read, in order (loop thread; quick).
            What it raises ends the stream as a FAULT.
        on_end: called once with why the stream ended (loop thread; must not raise).
        security: TLS and token of the call (default: plaintext, no token).
        options: the channel's gRPC options.
        encode: the wire messages of a queued item (default: the item itself).
        serializer, deserializer: for protobuf messages both ways (default: raw bytes).
        wait_for_ready: wait for the server instead of failing at once when it is
            not there yet (bound it with `connect_timeout_s` or the caller's own wait).
        connect_timeout_s: the connection must be READY this soon; None = unbounded.
        idle_timeout_s: the longest silence of the peer once started; None = unbounded.
            May be changed while the stream runs (read before each wait).
        write_timeout_s: the longest a single write may take; None = unbounded.
            May be changed while the stream runs (read before each write).
        name: for log messages and task names.
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
    ) -> None:
        self.target = target
        self.name = name
        self._method = method
        self._on_message = on_message
        self._on_end = on_end
        self._security = security or ChannelSecurity()
        self._options = list(options)
        self._encode = encode
        self._serializer = serializer
        self._deserializer = deserializer
        self._wait_for_ready = wait_for_ready
        self._connect_timeout_s = connect_timeout_s
        self.idle_timeout_s = idle_timeout_s
        self.write_timeout_s = write_timeout_s
        self._queue: asyncio.Queue[Any] = asyncio.Queue()
        self._channel: grpc.aio.Channel | None = None
        self._call: Any = None
        self._tasks: list[asyncio.Task[None]] = []
        self._closing = False
        self._done: asyncio.Event | None = None
        #: Why the stream ended; None while it runs (or before it started).
        self.ended: StreamEnded | None = None

    # ------------------------------------------------------------ public API
    def start(self, channel: grpc.aio.Channel | None = None) -> None:
        """Open the channel (or take `channel`, then owned) and the call, start reading and
        writing (loop; returns at once). Items sent before `start` are written first, in order.
        """
        self._done = asyncio.Event()
        self._channel = channel or self._security.aio_channel(self.target, self._options)
        multi = self._channel.stream_stream(
            self._method,
            request_serializer=self._serializer,
            response_deserializer=self._deserializer,
        )
        self._call = multi(metadata=self._security.metadata, wait_for_ready=self._wait_for_ready)
        self._spawn(self._read(), "read")
        self._spawn(self._write(), "write")
        if self._connect_timeout_s is not None:
            self._spawn(self._watch_connect(self._connect_timeout_s), "connect")

    def send(self, item: object) -> None:
        """Queue `item` for writing (loop thread). Never blocks; dropped once the stream ended."""
        if self.ended is None:
            self._queue.put_nowait(item)

    @property
    def connected(self) -> bool:
        """The channel is READY (a goodbye can reach the peer)."""
        channel = self._channel
        return channel is not None and channel.get_state() == grpc.ChannelConnectivity.READY

    async def wait(self, timeout_s: float | None = None) -> StreamEnded | None:
        """Wait (bounded) until the stream ended; return why, or None if it still runs."""
        if self.ended is None and self._done is not None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._done.wait(), timeout_s)
        return self.ended

    async def close(self, timeout_s: float, farewell: object | None = None) -> None:
        """End the stream: say `farewell` and half-close, wait for the peer (bounded), cancel.

        The goodbye is sent only while the stream runs and the channel is
        READY (without a connection there is nobody to wait for). Then the call
        is cancelled, the tasks awaited (at most `TASK_END_TIMEOUT_S`) and the
        channel closed. Idempotent; `on_end` gets CLOSED if nothing ended it first.
        """
        self._closing = True
        if farewell is not None and self.ended is None and self._tasks and self.connected:
            self._queue.put_nowait(farewell)
            self._queue.put_nowait(_END_WRITES)
            await self.wait(timeout_s)
        self._finish(StreamEnded(EndKind.CLOSED, Code.CANCELLED, "closed by this side", True))
        await self._stop()

    # ------------------------------------------------------------ the tasks
    def _spawn(self, coroutine: Awaitable[None], what: str) -> None:
        task = asyncio.ensure_future(coroutine)
        task.set_name(f"gradsync-{self.name}-{what}")
        self._tasks.append(task)

    async def _read(self) -> None:
        """Hand every message to `on_message` until the call ends; then say why."""
        try:
            messages = self._call.__aiter__()
            while True:
                idle_s = self.idle_timeout_s
                try:
                    message = await asyncio.wait_for(anext(messages), idle_s)
                except StopAsyncIteration:
                    self._finish(self._ended(EndKind.STATUS, Code.OK, ""))
                    return
                except TimeoutError:
                    details = f"the peer was silent for more than {idle_s:g}s"
                    self._finish(self._timeout(Code.DEADLINE_EXCEEDED, details, "idle"))
                    return
                self._on_message(message)
        except grpc.aio.AioRpcError as exc:
            code, details = int(exc.code().value[0]), exc.details() or ""
            if code == Code.INTERNAL and details == CORE_WRITE_FAILURE:
                # grpc-python replaces the call's status with this when a write fails in
                # core because the call is over (a peer gone, a connection reset): the
                # peer's own status is lost, and what is known is a broken transport.
                code = int(Code.UNAVAILABLE)
                details = f"the stream broke under a write (gRPC: {CORE_WRITE_FAILURE})"
            self._finish(self._ended(EndKind.STATUS, code, details, exc))
        except asyncio.CancelledError:
            self._finish(self._ended(EndKind.CLOSED, Code.CANCELLED, "closed by this side"))
            raise
        except Exception as exc:  # a handler's bug: end the stream and say so, never hang
            self._finish(self._ended(EndKind.FAULT, Code.UNKNOWN, repr(exc), exc))
        finally:
            self._stop_soon()

    async def _write(self) -> None:
        """Write every queued item's messages (each bounded); half-close at `_END_WRITES`."""
        timeout_s = self.write_timeout_s
        try:
            while True:
                item = await self._queue.get()
                timeout_s = self.write_timeout_s
                if item is _END_WRITES:
                    await asyncio.wait_for(self._call.done_writing(), timeout_s)
                    return
                for message in self._encode(item):
                    await asyncio.wait_for(self._call.write(message), timeout_s)
        except TimeoutError:
            details = f"a write took longer than {timeout_s:g}s"
            self._finish(self._timeout(Code.DEADLINE_EXCEEDED, details, "write"))
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError):
            return  # the call has ended: the reader reports its status
        except Exception as exc:  # an encoder's bug
            self._finish(self._ended(EndKind.FAULT, Code.UNKNOWN, repr(exc), exc))
        if self.ended is not None:
            self._stop_soon()

    async def _watch_connect(self, timeout_s: float) -> None:
        """End the stream when the connection is not READY within `timeout_s`.

        gRPC retries a failed TLS handshake as quietly as a refused connection:
        the handshake is tried once more with Python's `ssl` to say which it was.
        """
        assert self._channel is not None
        try:
            await asyncio.wait_for(self._channel.channel_ready(), timeout_s)
        except TimeoutError:
            if self.ended is not None or self._closing:
                return
            tls = await asyncio.to_thread(handshake_failure, self.target, self._security)
            details = f"could not connect within {timeout_s:g}s" + (f": {tls}" if tls else "")
            self._finish(self._timeout(Code.UNAVAILABLE, details, "connect"))
            self._stop_soon()

    # ------------------------------------------------------------ ending
    def _ended(
        self, kind: EndKind, code: int, details: str, cause: BaseException | None = None
    ) -> StreamEnded:
        return StreamEnded(kind, code, details, self._closing, cause)

    def _timeout(self, code: int, details: str, bound: str) -> StreamEnded:
        return StreamEnded(EndKind.TIMEOUT, code, details, self._closing, bound=bound)

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
        """Once ended: cancel the call, so that the other tasks end too (they are not awaited)."""
        if self._call is not None:
            self._call.cancel()
        current = asyncio.current_task()
        for task in self._tasks:
            if task is not current:
                task.cancel()

    async def _stop(self) -> None:
        """Cancel the call and the tasks, wait for them (bounded), close the channel."""
        self._stop_soon()
        current = asyncio.current_task()
        tasks = [task for task in self._tasks if task is not current]
        if tasks:
            await asyncio.wait(tasks, timeout=TASK_END_TIMEOUT_S)
        for task in tasks:  # retrieve what they raised: no "exception never retrieved"
            if task.done() and not task.cancelled():
                task.exception()
        if self._channel is not None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._channel.close(), TASK_END_TIMEOUT_S)
