"""The worker's side of the Sync stream: gRPC on a background event loop.

`Transport` is a thread-safe, blocking facade over a `grpc.aio` stream that
lives on its own asyncio loop in a daemon thread. The training thread and the
autograd hooks only call non-blocking methods (`submit_bucket` enqueues) or
bounded waits (`wait_step`, `wait_welcome`, `receive_state`). Everything the
background side learns (averaged chunks, aborted steps, a dead stream) is
recorded under one condition variable; failures are stored and raised at the
next wait, translated into `GradSyncError`s in one place.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import grpc
import numpy as np
import numpy.typing as npt

from gradsync.buffers import BucketBuffer
from gradsync.errors import (
    ClosedError,
    CoordinatorUnavailableError,
    GradSyncError,
    MessageRejectedError,
    PeerLostError,
    StepAbortedError,
    SyncTimeoutError,
    error_from_status,
)
from gradsync.protocol import chunking
from gradsync.protocol.codec import ChunkHeader, decode_gradient, encode_gradient, header_of
from gradsync.protocol.codes import Code
from gradsync.v1 import gradsync_pb2 as pb

log = logging.getLogger("gradsync.client")

#: Largest message the client accepts or sends; the coordinator's own limit
#: (announced in Welcome) is the binding one for uploads.
CLIENT_MAX_MESSAGE_BYTES = 64 * (1 << 20) + chunking.HEADER_SLACK_BYTES
SYNC_METHOD = "/gradsync.v1.Coordinator/Sync"


@dataclass
class _BucketUpload:
    step: int
    bucket_index: int
    buffer: BucketBuffer
    dtype: int


@dataclass
class _StateUpload:
    blob: npt.NDArray[np.uint8]


@dataclass
class _StepResult:
    """Progress of one step: averaged bytes written back into each uploaded bucket."""

    buffers: dict[int, BucketBuffer] = field(default_factory=dict)
    received: dict[int, int] = field(default_factory=dict)
    contributors: int = 0
    complete_buckets: int = 0
    aborted: pb.StepAborted | None = None


@dataclass
class _Shared:
    """State written by the loop thread and read by waiters (under `cond`)."""

    welcome: pb.Welcome | None = None
    state: bytearray | None = None
    state_received: int = 0
    results: dict[int, _StepResult] = field(default_factory=dict)
    fatal: GradSyncError | None = None
    stream_done: bool = False
    resume: bytearray | None = None
    resume_received: int = 0
    checkpoint_acks: dict[int, pb.CheckpointSaved] = field(default_factory=dict)
    membership_epoch: int = 0
    #: A live rank asked to donate its state to a rejoining rank (elastic).
    heal_requested: bool = False


@dataclass
class _CheckpointUpload:
    step: int
    blob: bytes
    heal: bool = False


_CLOSE = object()


class Transport:
    """One worker's connection to one coordinator.

    Args:
        target: "host:port" of the coordinator.
        rank: this worker's rank (for error messages).
    """

    def __init__(self, target: str, rank: int) -> None:
        self.target = target
        self.rank = rank
        self._cond = threading.Condition()
        self._shared = _Shared()
        self._bucket_bytes: list[int] = []
        self._closed = False
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name=f"gradsync-transport-r{rank}", daemon=True
        )
        self._thread.start()
        self._outgoing: asyncio.Queue[Any] = asyncio.Queue()
        self._channel: grpc.aio.Channel | None = None
        self._call: Any = None
        self._receiver: asyncio.Task[None] | None = None
        self._heartbeat: asyncio.Task[None] | None = None
        #: The step heartbeats report (set by the model wrapper).
        self.current_step = 0
        #: Called on the transport thread as (event, step, bucket_index) for
        #: "upload_start", "upload_end" and "averaged"; must be quick, must not raise.
        self.on_bucket_event: Callable[[str, int, int], None] | None = None

    # ------------------------------------------------------------ public API
    def open(self, join: pb.Join) -> None:
        """Open the stream and send Join (returns at once; see `wait_welcome`)."""
        self._run(self._open(join), timeout_s=30.0)

    def wait_welcome(self, timeout_s: float) -> pb.Welcome:
        """Block until the job is assembled.

        Raises:
            CoordinatorUnavailableError: the coordinator was not reachable in time.
            SyncTimeoutError: reachable, but the job did not assemble in time.
            JoinRefusedError: the coordinator refused this worker.
        """
        try:
            self._wait(lambda s: s.welcome is not None, timeout_s, "the job to assemble")
        except SyncTimeoutError:
            if not self._is_connected():
                raise CoordinatorUnavailableError(
                    f"could not reach the coordinator at {self.target} within {timeout_s:g}s",
                    rank=self.rank,
                ) from None
            raise SyncTimeoutError(
                f"connected to {self.target}, but the job did not assemble within "
                f"{timeout_s:g}s (are all ranks started with the same world size and job id?)",
                rank=self.rank,
            ) from None
        welcome = self._shared.welcome
        assert welcome is not None
        return welcome

    def configure_buckets(self, bucket_bytes: list[int]) -> None:
        """Tell the transport the size of each bucket (to assemble results)."""
        self._bucket_bytes = list(bucket_bytes)

    def send_state(self, blob: npt.NDArray[np.uint8]) -> None:
        """Queue rank 0's state blob for broadcast (non-blocking)."""
        self._put(_StateUpload(blob))

    def receive_state(self, num_bytes: int, timeout_s: float) -> bytearray:
        """Block until rank 0's whole state blob has arrived; return it."""
        self._wait(lambda s: s.state_received >= num_bytes, timeout_s, "rank 0's state")
        state = self._shared.state
        assert state is not None
        return state

    def receive_resume(self, num_bytes: int, timeout_s: float) -> bytes:
        """Block until the checkpoint this job resumes from has arrived; return it."""
        self._wait(
            lambda s: s.resume_received >= num_bytes, timeout_s, "the checkpoint to resume from"
        )
        assert self._shared.resume is not None
        return bytes(self._shared.resume)

    def send_checkpoint(self, step: int, blob: bytes) -> None:
        """Queue a checkpoint upload (rank 0). Never blocks."""
        self._put(_CheckpointUpload(step, blob))

    def abandon_step(self, step: int, reason: str) -> None:
        """Tell the coordinator this rank gives up on `step`. Never blocks."""
        self._put(pb.WorkerMessage(abandon=pb.AbandonStep(step=step, reason=reason)))

    def take_heal_request(self) -> bool:
        """True (once) when a rejoining rank needs this rank's state."""
        with self._cond:
            requested, self._shared.heal_requested = self._shared.heal_requested, False
            return requested

    def send_heal(self, step: int, blob: bytes) -> None:
        """Queue this rank's state for a rejoining rank. Never blocks."""
        self._put(_CheckpointUpload(step, blob, heal=True))

    def wait_checkpoint(self, step: int, timeout_s: float) -> pb.CheckpointSaved:
        """Block until the coordinator answered the checkpoint upload of `step`."""
        self._wait(lambda s: step in s.checkpoint_acks, timeout_s, f"the checkpoint of step {step}")
        with self._cond:
            return self._shared.checkpoint_acks.pop(step)

    def submit_bucket(self, step: int, bucket_index: int, buffer: BucketBuffer, dtype: int) -> None:
        """Queue one bucket for upload; its averages will be written back into `buffer`.

        Never blocks on the network; safe from any thread (autograd hooks call it).
        """
        with self._cond:
            self._ensure_step_locked(step).buffers[bucket_index] = buffer
        self._put(_BucketUpload(step, bucket_index, buffer, dtype))

    def wait_step(self, step: int, timeout_s: float) -> int:
        """Block until every averaged bucket of `step` was written back into its buffer.

        Returns:
            The number of ranks averaged over.

        Raises:
            StepAbortedError (or a subclass): the coordinator abandoned the step.
            SyncTimeoutError: the results did not arrive within `timeout_s`.
            CoordinatorUnavailableError / other GradSyncError: the stream failed.
        """
        self._ensure_step(step)

        num_buckets = len(self._bucket_bytes)

        def ready(shared: _Shared) -> bool:
            result = shared.results[step]
            return result.aborted is not None or result.complete_buckets == num_buckets

        try:
            self._wait(ready, timeout_s, f"the averaged gradients of step {step}")
        except SyncTimeoutError as exc:
            raise SyncTimeoutError(
                f"{exc.args[0]}; {self._describe_missing(step)}", rank=self.rank, step=step
            ) from None
        with self._cond:
            result = self._shared.results.pop(step)
            for old in [s for s in self._shared.results if s < step]:
                del self._shared.results[old]
        if result.aborted is not None:
            raise _abort_error(result.aborted, self.rank)
        return result.contributors

    def close(self, timeout_s: float = 10.0) -> None:
        """Say goodbye, wait (bounded) for the stream to end, stop the loop thread."""
        if self._closed:
            return
        self._closed = True
        try:
            if self._call is not None:
                self._put(pb.WorkerMessage(leave=pb.Leave(reason="closed by the worker")))
                self._put(_CLOSE)
                # Leaving anyway if the goodbye fails: the stream is torn down below.
                with contextlib.suppress(GradSyncError):
                    self._wait(lambda s: s.stream_done, timeout_s, "the coordinator's goodbye")
            self._run(self._shutdown(), timeout_s=timeout_s)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=timeout_s)
            if not self._thread.is_alive():
                self._loop.close()

    # ------------------------------------------------------ loop-thread side
    async def _open(self, join: pb.Join) -> None:
        options = [
            ("grpc.max_receive_message_length", CLIENT_MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", CLIENT_MAX_MESSAGE_BYTES),
            ("grpc.keepalive_time_ms", 10_000),
            ("grpc.keepalive_timeout_ms", 10_000),
            ("grpc.keepalive_permit_without_calls", 1),
        ]
        self._channel = grpc.aio.insecure_channel(self.target, options=options)
        # Raw bytes both ways: gradient chunks are encoded and decoded by
        # gradsync.protocol.codec without copying payloads through protobuf objects.
        sync = self._channel.stream_stream(SYNC_METHOD)
        self._outgoing.put_nowait(pb.WorkerMessage(join=join))
        # wait_for_ready: a worker may start before its coordinator; the join
        # timeout bounds how long it waits.
        self._call = sync(self._requests(), wait_for_ready=True)
        self._receiver = asyncio.create_task(self._receive())
        self._heartbeat = asyncio.create_task(self._send_heartbeats())

    async def _send_heartbeats(self) -> None:
        """Queue a Heartbeat every interval, so a busy but healthy worker is not declared dead."""
        while True:
            welcome = self._shared.welcome
            await asyncio.sleep(welcome.heartbeat_interval_s if welcome else 0.5)
            if welcome is not None:
                beat = pb.WorkerMessage(heartbeat=pb.Heartbeat(step=self.current_step))
                self._outgoing.put_nowait(beat)

    async def _requests(self) -> AsyncIterator[bytes]:
        chunk_bytes = chunking.DEFAULT_CHUNK_BYTES
        epoch = 0
        while True:
            item = await self._outgoing.get()
            if item is _CLOSE:
                return
            welcome = self._shared.welcome
            if welcome is not None:
                chunk_bytes, epoch = welcome.chunk_bytes, self._shared.membership_epoch
            if isinstance(item, _CheckpointUpload):
                view = memoryview(item.blob)
                for offset, length in chunking.chunk_spans(len(view), chunk_bytes):
                    piece = pb.CheckpointChunk(
                        step=item.step,
                        offset=offset,
                        total_bytes=len(view),
                        payload=bytes(view[offset : offset + length]),
                        heal=item.heal,
                    )
                    yield pb.WorkerMessage(checkpoint=piece).SerializeToString()
            elif isinstance(item, _StateUpload):
                view = memoryview(item.blob.data)
                for offset, length in chunking.chunk_spans(len(view), chunk_bytes):
                    payload = view[offset : offset + length].tobytes()
                    chunk = pb.StateChunk(offset=offset, payload=payload)
                    yield pb.WorkerMessage(state=chunk).SerializeToString()
            elif isinstance(item, _BucketUpload):
                self._bucket_event("upload_start", item.step, item.bucket_index)
                last_offset = (chunking.num_chunks(item.buffer.size, chunk_bytes) - 1) * chunk_bytes
                for offset, pieces in item.buffer.chunks(chunk_bytes):
                    header = ChunkHeader(
                        step=item.step,
                        membership_epoch=epoch,
                        bucket_index=item.bucket_index,
                        offset=offset,
                        dtype=item.dtype,
                    )
                    message = encode_gradient(header, pieces)
                    if offset == last_offset:  # handed to gRPC: the upload's end
                        self._bucket_event("upload_end", item.step, item.bucket_index)
                    yield message
            else:
                yield item.SerializeToString()

    async def _receive(self) -> None:
        assert self._call is not None
        failure: GradSyncError | None = None
        try:
            async for raw in self._call:
                self._on_message(raw)
            if not self._closed:
                failure = CoordinatorUnavailableError(
                    f"the coordinator at {self.target} ended the stream", rank=self.rank
                )
        except grpc.aio.AioRpcError as exc:
            code = exc.code().value[0]
            if not (self._closed and code == Code.CANCELLED):
                failure = error_from_status(code, exc.details() or "", rank=self.rank)
        except asyncio.CancelledError:
            failure = ClosedError("the transport was closed", rank=self.rank)
        except Exception as exc:  # a bug in message handling: surface it, don't hang
            failure = GradSyncError(f"unexpected error in the transport: {exc!r}", rank=self.rank)
        with self._cond:
            self._shared.stream_done = True
            if failure is not None and self._shared.fatal is None:
                self._shared.fatal = failure
            self._cond.notify_all()

    def _on_message(self, raw: bytes) -> None:
        fast = decode_gradient(raw)
        if fast is not None:
            with self._cond:
                self._on_gradient(*fast)
                self._cond.notify_all()
            return
        message = pb.CoordinatorMessage.FromString(raw)
        kind = message.WhichOneof("kind")
        with self._cond:
            shared = self._shared
            if kind == "welcome":
                shared.welcome = message.welcome
                shared.membership_epoch = message.welcome.membership_epoch
                # Rank 0's state may arrive before anyone waits for it: have room ready.
                shared.state = bytearray(message.welcome.state_bytes)
            elif kind == "state":
                self._on_state(message.state)
            elif kind == "gradient":
                chunk = message.gradient
                self._on_gradient(header_of(chunk), memoryview(chunk.payload))
            elif kind == "step_aborted":
                aborted = message.step_aborted
                self._ensure_step_locked(aborted.step).aborted = aborted
            elif kind == "membership":
                change = message.membership
                shared.membership_epoch = change.membership_epoch
                log.warning("rank %d: membership changed: %s", self.rank, change.reason)
            elif kind == "state_request":
                shared.heal_requested = True
                log.warning(
                    "rank %d: asked for its state to heal rejoining rank %d",
                    self.rank,
                    message.state_request.for_rank,
                )
            elif kind == "resume":
                self._on_resume(message.resume)
            elif kind == "checkpoint_saved":
                saved = message.checkpoint_saved
                shared.checkpoint_acks[saved.step] = saved
                if not saved.durable:
                    log.warning(
                        "rank %d: checkpoint of step %d was NOT saved: %s",
                        self.rank,
                        saved.step,
                        saved.message,
                    )
            self._cond.notify_all()

    def _on_resume(self, chunk: pb.CheckpointChunk) -> None:
        shared = self._shared
        if shared.resume is None:
            shared.resume = bytearray(chunk.total_bytes)
        end = chunk.offset + len(chunk.payload)
        if chunk.total_bytes != len(shared.resume) or end > len(shared.resume):
            self._protocol_fault(f"resume chunk [{chunk.offset}, {end}) is out of range")
            return
        shared.resume[chunk.offset : end] = chunk.payload
        shared.resume_received += len(chunk.payload)

    def _on_state(self, chunk: pb.StateChunk) -> None:
        state = self._shared.state
        if state is None or chunk.offset + len(chunk.payload) > len(state):
            self._protocol_fault(f"state chunk at offset {chunk.offset} is out of range")
            return
        state[chunk.offset : chunk.offset + len(chunk.payload)] = chunk.payload
        self._shared.state_received += len(chunk.payload)

    def _on_gradient(self, chunk: ChunkHeader, payload: memoryview) -> None:
        result = self._ensure_step_locked(chunk.step)
        bucket = chunk.bucket_index
        buffer = result.buffers.get(bucket)
        if buffer is None:
            self._protocol_fault(
                f"averaged bucket {bucket} of step {chunk.step} arrived before this rank "
                "uploaded it"
            )
            return
        try:
            buffer.write(chunk.offset, payload)
        except ValueError as exc:
            self._protocol_fault(f"averaged chunk of bucket {bucket}: {exc}")
            return
        received = result.received.get(bucket, 0) + len(payload)
        result.received[bucket] = received
        result.contributors = (
            min(result.contributors, chunk.contributors)
            if result.contributors
            else chunk.contributors
        )
        if received == buffer.size:
            result.complete_buckets += 1
            self._bucket_event("averaged", chunk.step, bucket)

    def _bucket_event(self, event: str, step: int, bucket_index: int) -> None:
        if self.on_bucket_event is not None:
            try:
                self.on_bucket_event(event, step, bucket_index)
            except Exception:  # instrumentation must never break the data path
                log.exception("bucket event handler failed")

    def _protocol_fault(self, what: str) -> None:
        if self._shared.fatal is None:
            self._shared.fatal = GradSyncError(
                f"the coordinator sent an invalid message: {what}", rank=self.rank
            )

    async def _shutdown(self) -> None:
        if self._heartbeat is not None:
            self._heartbeat.cancel()
        if self._receiver is not None and not self._receiver.done():
            self._receiver.cancel()
        if self._channel is not None:
            await self._channel.close()

    # --------------------------------------------------------------- helpers
    def _ensure_step(self, step: int) -> None:
        with self._cond:
            self._ensure_step_locked(step)

    def _ensure_step_locked(self, step: int) -> _StepResult:
        result = self._shared.results.get(step)
        if result is None:
            result = self._shared.results[step] = _StepResult()
        return result

    def _describe_missing(self, step: int) -> str:
        with self._cond:
            result = self._shared.results.get(step)
            if result is None:
                return "no results arrived"
            missing = [
                f"bucket {index} ({result.received.get(index, 0)}/{size} bytes)"
                for index, size in enumerate(self._bucket_bytes)
                if result.received.get(index, 0) < size
            ]
        return "still waiting for " + ", ".join(missing)

    def _put(self, item: object) -> None:
        if self._loop.is_closed():
            raise ClosedError("the transport is closed", rank=self.rank)
        self._loop.call_soon_threadsafe(self._outgoing.put_nowait, item)

    def _run(self, coroutine: Any, timeout_s: float) -> Any:
        future = asyncio.run_coroutine_threadsafe(coroutine, self._loop)
        return future.result(timeout=timeout_s)

    def _is_connected(self) -> bool:
        if self._channel is None:
            return False
        return bool(self._channel.get_state() == grpc.ChannelConnectivity.READY)

    def _wait(self, predicate: Callable[[_Shared], bool], timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while not predicate(self._shared):
                if self._shared.fatal is not None:
                    raise self._shared.fatal
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise SyncTimeoutError(
                        f"timed out after {timeout_s:g}s waiting for {what}", rank=self.rank
                    )
                self._cond.wait(remaining)


def _abort_error(aborted: pb.StepAborted, rank: int) -> StepAbortedError:
    """The exception for a StepAborted message, by its reason."""
    classes: dict[int, type[StepAbortedError]] = {
        pb.ABORT_REASON_MESSAGE_REJECTED: MessageRejectedError,
        pb.ABORT_REASON_PEER_LOST: PeerLostError,
    }
    cls = classes.get(aborted.reason, StepAbortedError)
    try:
        code: Code | None = Code(aborted.code)
    except ValueError:
        code = None
    return cls(
        f"step {aborted.step} was aborted by the coordinator "
        f"({code.name if code else aborted.code}): {aborted.message}",
        rank=rank,
        step=aborted.step,
        bucket_index=aborted.bucket_index,
        code=code,
    )
