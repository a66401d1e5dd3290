"""The worker's side of the Sync stream: gRPC on a background event loop.

`Transport` is a thread-safe, blocking facade over a `grpc.aio` stream that
lives on its own asyncio loop in a daemon thread. The training thread and the
autograd hooks only call non-blocking methods (`submit_bucket` enqueues) or
bounded waits (`wait_step`, `wait_welcome`, `receive_state`). This module is
the sending side and the gRPC plumbing; everything the coordinator sends back
(averaged chunks, aborted steps, a dead stream) goes into a
`gradsync.inbox.Inbox`, which records it under one condition variable and
raises stored failures at the next wait, translated into `GradSyncError`s in
one place.

A stream's end is classified by cause, not only by status code: the
coordinator's last message is a `StreamEnd` naming the reason (declared dead,
checkpoint failed, shutting down, ...), which is recorded and combined with
the status that follows in `gradsync.errors.error_from_status`. Only a stream
that broke without one, or a coordinator going away, becomes a
`CoordinatorUnavailableError`, the one error the model wrapper reconnects on.

It implements `gradsync.link.CoordinatorLink`, the seam the model wrapper
uses, so the wrapper can be tested without it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import grpc
import numpy as np
import numpy.typing as npt

from gradsync.buffers import BucketBuffer
from gradsync.errors import (
    ClosedError,
    CoordinatorUnavailableError,
    GradSyncError,
    SyncTimeoutError,
)
from gradsync.inbox import Inbox
from gradsync.link import BucketEventHandler
from gradsync.protocol import chunking, defaults
from gradsync.protocol.codec import ChunkHeader, encode_gradient
from gradsync.protocol.codes import Code
from gradsync.v1 import gradsync_pb2 as pb

log = logging.getLogger("gradsync.client")

#: Largest message the client accepts or sends: a chunk of the largest size a
#: coordinator may be configured with (64 MiB) plus its header. The coordinator's
#: own limit (announced in Welcome) is the binding one for uploads.
CLIENT_MAX_MESSAGE_BYTES = 64 * defaults.MIB + chunking.HEADER_SLACK_BYTES
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
        self._inbox = Inbox(
            target, rank, lambda step, bucket: self._bucket_event("averaged", step, bucket)
        )
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
        self.on_bucket_event: BucketEventHandler | None = None

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
            return self._inbox.wait_welcome(timeout_s)
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

    def configure_buckets(self, bucket_bytes: list[int]) -> None:
        """Tell the transport the size of each bucket (to assemble results)."""
        self._inbox.configure_buckets(bucket_bytes)

    def send_state(self, blob: npt.NDArray[np.uint8]) -> None:
        """Queue rank 0's state blob for broadcast (non-blocking)."""
        self._put(_StateUpload(blob))

    def receive_state(self, num_bytes: int, timeout_s: float) -> bytearray:
        """Block until rank 0's whole state blob has arrived; return it."""
        return self._inbox.receive_state(num_bytes, timeout_s)

    def receive_resume(self, num_bytes: int, timeout_s: float) -> bytes:
        """Block until the checkpoint this job resumes from has arrived; return it."""
        return self._inbox.receive_resume(num_bytes, timeout_s)

    def send_checkpoint(self, step: int, blob: bytes) -> None:
        """Queue a checkpoint upload (rank 0). Never blocks."""
        self._put(_CheckpointUpload(step, blob))

    def abandon_step(self, step: int, reason: str) -> None:
        """Tell the coordinator this rank gives up on `step`. Never blocks."""
        self._put(pb.WorkerMessage(abandon=pb.AbandonStep(step=step, reason=reason)))

    def take_heal_request(self) -> bool:
        """True (once) when a rejoining rank needs this rank's state."""
        return self._inbox.take_heal_request()

    def send_heal(self, step: int, blob: bytes) -> None:
        """Queue this rank's state for a rejoining rank. Never blocks."""
        self._put(_CheckpointUpload(step, blob, heal=True))

    def wait_checkpoint(self, step: int, timeout_s: float) -> pb.CheckpointSaved:
        """Block until the coordinator answered the checkpoint upload of `step`."""
        return self._inbox.wait_checkpoint(step, timeout_s)

    def submit_bucket(self, step: int, bucket_index: int, buffer: BucketBuffer, dtype: int) -> None:
        """Queue one bucket for upload; its averages will be written back into `buffer`.

        Never blocks on the network; safe from any thread (autograd hooks call it).
        """
        self._inbox.expect_bucket(step, bucket_index, buffer)
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
        return self._inbox.wait_step(step, timeout_s)

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
                    self._inbox.wait_stream_done(timeout_s)
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
            welcome = self._inbox.welcome
            await asyncio.sleep(
                welcome.heartbeat_interval_s if welcome else defaults.HEARTBEAT_INTERVAL_S
            )
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
            welcome = self._inbox.welcome
            if welcome is not None:
                chunk_bytes, epoch = welcome.chunk_bytes, self._inbox.membership_epoch
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
                self._inbox.on_message(raw)
            if not self._closed:
                failure = self._inbox.stream_failure(None, "")
        except grpc.aio.AioRpcError as exc:
            code = exc.code().value[0]
            if not (self._closed and code == Code.CANCELLED):
                failure = self._inbox.stream_failure(code, exc.details() or "")
                failure.__cause__ = exc
        except asyncio.CancelledError:
            failure = ClosedError("the transport was closed", rank=self.rank)
        except Exception as exc:  # a bug in message handling: surface it, don't hang
            failure = GradSyncError(f"unexpected error in the transport: {exc!r}", rank=self.rank)
        self._inbox.stream_ended(failure)

    def _bucket_event(self, event: str, step: int, bucket_index: int) -> None:
        if self.on_bucket_event is not None:
            try:
                self.on_bucket_event(event, step, bucket_index)
            except Exception:  # instrumentation must never break the data path
                log.exception("bucket event handler failed")

    async def _shutdown(self) -> None:
        if self._heartbeat is not None:
            self._heartbeat.cancel()
        if self._receiver is not None and not self._receiver.done():
            self._receiver.cancel()
        if self._channel is not None:
            await self._channel.close()

    # --------------------------------------------------------------- helpers
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
