"""The worker's side of the Sync stream: a blocking facade over a background I/O thread.

`Transport` is thread-safe. The training thread and the autograd hooks only
call non-blocking methods (`submit_bucket` enqueues) or bounded waits
(`wait_step`, `wait_welcome`, `receive_state`). This module is the sending
side and the plumbing (the messages are cut by
`gradsync.control.worker_messages`); everything the coordinator sends back
(averaged chunks, aborted steps, a dead stream) goes into a
`gradsync.control.inbox.Inbox`, which records it under one condition variable
and raises stored failures at the next wait, translated into `GradSyncError`s
in one place.

Heartbeats, the wait for the Welcome (`gradsync.control.joining`) and the
numbering of collectives keep the contract of `gradsync.control.link`.

A stream's end is classified by cause, not only by status code: the
coordinator's last message is a `StreamEnd` naming the reason, combined with
the status that follows in `gradsync.errors.error_from_status`. Only a stream
that broke without one becomes a `CoordinatorUnavailableError`, the one error
the model wrapper reconnects on.

With a sharded coordinator, range 0 of every bucket (`gradsync.path.bucket_uploads`)
goes on the Sync stream and range i on shard i's (`gradsync.path.shard_streams`).

The stream itself is a `gradsync_proto.net.stream_client.StreamClient` whose
pipe a `gradsync_proto.net.frame_stream.FrameDiscovery` picks: length-prefixed
frames on the coordinator's frame port (plain or TLS), or gRPC where there is
none. Its asyncio loop runs in a daemon thread. On frames a small item (a
small model's whole bucket) is written by the thread that sends it and the
answers are read by the socket's own reader thread, so a step crosses no
event loop; gRPC and the shard streams (gRPC until shards serve frames) run
on the loop. `_on_message` therefore runs on either thread, `_on_end` on the
loop. TLS and the token come from one
`gradsync_proto.net.channels.ChannelSecurity`: a wrong token ends the stream
UNAUTHENTICATED (`AuthenticationError`); a TLS handshake that keeps failing is
raised as `TransportSecurityError` at the first progress report of the join.

It implements `gradsync.control.link.CoordinatorLink`, the seam the model
wrapper uses, so the wrapper can be tested without it.

Heartbeats also ride a connection that carries no gradient bytes (`SideBeats`).
On a slow link a worker's frame socket can hold seconds of gradient bytes in
its send queue; a Heartbeat on the Sync stream waits behind them, and the
coordinator would declare a busy rank dead. So, once the Welcome issued the
rank's session secret and while the Sync stream runs on frames, every
heartbeat also goes as a unary `Coordinator.Beat` call on the frame pipe's
gRPC side channel (`StreamClient.side_channel`, open anyway for keepalive
pings), which no bulk data travels on. Each beat carries a sequence and a MAC
keyed with the session (`gradsync_proto.auth.beat_proof`): the coordinator
counts it only when both check out. On the gRPC pipe (no frame port) the Sync
stream's Heartbeat is the only one. A coordinator without `Beat`
(UNIMPLEMENTED) turns this off; any other failure is logged and the next
interval tries again. At most one call is in flight, bounded by the heartbeat
interval.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import threading
from collections.abc import Callable, Iterator
from typing import Any, cast

import grpc
import numpy as np
import numpy.typing as npt
from gradsync_proto import auth, chunking, defaults
from gradsync_proto.net.channels import ChannelSecurity
from gradsync_proto.net.frame_stream import FrameDiscovery
from gradsync_proto.net.stream_client import StreamClient, StreamEnded
from gradsync_proto.v1 import gradsync_pb2 as pb

from gradsync.control.collective_results import op_name
from gradsync.control.inbox import Inbox
from gradsync.control.inbox_state import stream_end_failure
from gradsync.control.joining import wait_for_welcome
from gradsync.control.link import IssuesCollectives
from gradsync.control.worker_messages import (
    CheckpointUpload,
    CollectiveUpload,
    StateUpload,
    Upload,
    check_collective_input,
    upload_messages,
    written_inline,
)
from gradsync.errors import ClosedError, ShardUnavailableError
from gradsync.path.bucket_uploads import BucketUpload, RangeUpload, range_messages, split_upload
from gradsync.path.buffers import BucketBuffer
from gradsync.path.gradient_path import BucketEventHandler
from gradsync.path.pacing import UploadPacer, chunk_bytes_of
from gradsync.path.shard_streams import (
    CLIENT_MAX_MESSAGE_BYTES,
    SHARD_GRACE_MARGIN_S,
    ShardStreams,
    channel_options,
)

log = logging.getLogger("gradsync.client")

__all__ = ["BEAT_METHOD", "CLIENT_MAX_MESSAGE_BYTES", "SYNC_METHOD", "SideBeats", "Transport"]

SYNC_METHOD = "/gradsync.v1.Coordinator/Sync"
BEAT_METHOD = "/gradsync.v1.Coordinator/Beat"


class SideBeats:
    """Sends `Beat`s for one Sync stream (all on its loop).

    Args:
        stream: the Sync stream (its side channel carries the beats).
        rank: this worker's rank.
        security: the token every call presents.
        welcome: the Welcome once there is one (its job, rank and session).
        step: the step to report.
    """

    def __init__(
        self,
        stream: StreamClient,
        rank: int,
        security: ChannelSecurity,
        welcome: Callable[[], pb.Welcome | None],
        step: Callable[[], int],
    ) -> None:
        self._stream = stream
        self._rank = rank
        self._security = security
        self._welcome = welcome
        self._step = step
        self._sequence = 0
        self._in_flight: asyncio.Task[None] | None = None
        #: False once the coordinator said it has no `Beat`.
        self.enabled = True
        #: Beats the coordinator accepted (for tests and logs).
        self.accepted = 0

    def beat(self, timeout_s: float) -> bool:
        """Start one beat if it can go now; whether it was started."""
        if not self.enabled or (self._in_flight is not None and not self._in_flight.done()):
            return False
        welcome = self._welcome()
        channel = self._stream.side_channel
        if welcome is None or not welcome.session or channel is None:
            return False
        self._sequence += 1
        step = self._step()
        request = pb.BeatRequest(
            job_id=welcome.job_id,
            rank=self._rank,
            sequence=self._sequence,
            step=step,
            proof=auth.beat_proof(
                welcome.session, welcome.job_id, self._rank, self._sequence, step
            ),
        )
        self._in_flight = asyncio.create_task(self._call(channel, request, timeout_s))
        return True

    async def _call(
        self, channel: grpc.aio.Channel, request: pb.BeatRequest, timeout_s: float
    ) -> None:
        call = channel.unary_unary(
            BEAT_METHOD,
            request_serializer=pb.BeatRequest.SerializeToString,
            response_deserializer=pb.BeatReply.FromString,
        )
        try:
            await call(request, metadata=self._security.metadata, timeout=timeout_s)
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
                self.enabled = False
                log.info(
                    "rank %d: the coordinator has no Beat; heartbeats ride the Sync stream only",
                    request.rank,
                )
            else:
                log.debug(
                    "rank %d: beat %d: %s %s",
                    request.rank,
                    request.sequence,
                    exc.code().name,
                    exc.details(),
                )
            return
        except Exception as exc:  # the channel closed under the call (the stream ended)
            log.debug("rank %d: beat %d failed: %r", request.rank, request.sequence, exc)
            return
        self.accepted += 1

    async def stop(self) -> None:
        """Cancel a beat in flight and wait for it."""
        task, self._in_flight = self._in_flight, None
        if task is not None and not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


class _Heartbeat:
    """A heartbeat in the outgoing queue: its step is read when it is sent."""


_HEARTBEAT = _Heartbeat()


class Transport(IssuesCollectives):
    """One worker's connection to one coordinator.

    Args:
        target: "host:port" of the coordinator (the leader, when sharded).
        rank: this worker's rank (for error messages).
        shard_grace_margin_s: a failed shard stream is raised this long plus 3
            heartbeat intervals after it failed, unless the leader spoke first.
        security: TLS and token for every stream (default: plaintext, no token).
    """

    averages_land_early = True  # (each bucket's, as its last chunk comes in)

    def __init__(
        self,
        target: str,
        rank: int,
        *,
        shard_grace_margin_s: float = SHARD_GRACE_MARGIN_S,
        security: ChannelSecurity | None = None,
    ) -> None:
        self.target = target
        self.rank = rank
        self._security = security or ChannelSecurity()
        self._inbox = Inbox(
            target,
            rank,
            lambda step, bucket: self._bucket_event("averaged", step, bucket),
            shard_grace_margin_s=shard_grace_margin_s,
        )
        # Every wait and read of what the coordinator sent is the inbox's own (the
        # contract is `CoordinatorLink`'s); the transport adds the sending side.
        self.configure_buckets = self._inbox.configure_buckets
        self.receive_state = self._inbox.receive_state
        self.receive_resume = self._inbox.receive_resume
        self.wait_checkpoint = self._inbox.wait_checkpoint
        self.wait_join_progress = self._inbox.wait_join_progress
        self.take_heal_request = self._inbox.take_heal_request
        self.heal_relay_requested = self._inbox.heal_relay_requested
        self.wait_heal_answer = self._inbox.wait_heal_answer
        self.step_report = self._inbox.step_report
        self.live_ranks = self._inbox.live_ranks
        self.wait_step = self._inbox.wait_step
        #: The second half of `run_collective` (`issue_collective` is the first).
        self.wait_collective = self._inbox.wait_collective
        self.round_report = self._inbox.round_report
        self._closed = False
        options = channel_options()  # before the thread: a bad setting leaves nothing behind
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name=f"gradsync-transport-r{rank}", daemon=True
        )
        self._thread.start()
        # Raw bytes both ways (chunks are coded by gradsync_proto.codec); it waits for a
        # coordinator that is not up yet (the join timeout bounds how long).
        self._sync = StreamClient(
            target,
            SYNC_METHOD,
            self._on_message,
            self._on_end,
            security=self._security,
            options=options,
            encode=self._messages,
            name=f"sync-r{rank}",
            discovery=FrameDiscovery(CLIENT_MAX_MESSAGE_BYTES, written_inline),
            loop=self._loop,
        )
        self._heartbeat: asyncio.Task[None] | None = None
        #: The same heartbeats on the frame pipe's side channel (no bulk data there).
        self._side_beats = SideBeats(
            self._sync,
            rank,
            self._security,
            lambda: self._inbox.welcome,
            lambda: self.current_step,
        )
        #: A heartbeat is queued, not yet sent (loop thread): beats must not pile up.
        self._heartbeat_queued = False
        self._join: pb.Join | None = None
        #: Data streams to shards 1..S-1 (loop thread), opened at the Welcome.
        self._shards: ShardStreams | None = None
        self._shards_opening = False
        #: Hands each bucket's ranges to the streams, clocked by the answers (loop thread).
        self._pacer = UploadPacer(rank, self._send_to, self._inbox, self._loop.call_later, target)
        if self._pacer.window_bytes > 0:  # unpaced: no answer to count on the receive path
            self._inbox.on_answer = functools.partial(self._on_loop, self._pacer.answered, 0)
        self._sequence_lock = threading.Lock()
        self._next_collective = 0
        #: The step heartbeats report (set by the model wrapper).
        self.current_step = 0
        #: Told (shard index, chunk) of each collective result chunk a shard sends, and of
        #: each shard stream that fails (a process group's `ShardRoutes` sets both).
        self.on_shard_collective: Callable[[int, pb.CollectiveChunk], None] | None = None
        self.on_shard_failed: Callable[[ShardUnavailableError], None] | None = None
        #: Called on the transport thread as (event, step, bucket_index) for
        #: "upload_start", "upload_end" and "averaged"; must be quick, must not raise.
        self.on_bucket_event: BucketEventHandler | None = None

    # ------------------------------------------------------------ public API
    def open(self, join: pb.Join) -> None:
        """Open the stream and send Join (returns at once; see `wait_welcome`)."""
        self._inbox.expect(join)  # the Welcome is checked against what this worker joined with
        self._run(self._open(join), timeout_s=30.0)

    def wait_welcome(self, timeout_s: float, unreachable_s: float | None = None) -> pb.Welcome:
        """Block until the job is assembled, logging every ~10 s what it waits for.

        See `gradsync.control.joining.wait_for_welcome` (and its errors:
        CoordinatorUnavailableError, SyncTimeoutError, JoinRefusedError,
        AuthenticationError, TransportSecurityError).
        """
        return wait_for_welcome(
            self._inbox,
            self.target,
            self.rank,
            timeout_s,
            lambda: bool(self._sync.connected),
            security=self._security,
            unreachable_s=unreachable_s,
        )

    # ---------------------------------------- the sending side (documented on CoordinatorLink)
    # Each queues its messages on the Sync stream (a collective then waits for its result).
    def issue_collective(
        self,
        op: int,
        dtype: int,
        payload: npt.NDArray[np.uint8],
        root: int,
        *,
        result_bytes: int | None = None,
        template: pb.CollectiveChunk | None = None,
        on_ready: Callable[[], None] | None = None,
    ) -> int:
        """The first half of `run_collective`: number the collective and queue its input
        (never blocks); return its sequence number for `wait_collective`.

        Several may be outstanding at once (the coordinator holds up to
        `MAX_OPEN_COLLECTIVES` of a job open); their results are kept by sequence
        number until taken. `payload` must not change until the result was taken.
        `on_ready` is told on the reading thread once `wait_collective` would not
        block (see `Inbox.expect_collective`).
        """
        check_collective_input(op, payload)
        with self._sequence_lock:
            sequence = self._next_collective
            self._inbox.expect_collective(
                sequence, op, dtype, payload.nbytes, result_bytes, on_ready
            )
            self._next_collective = sequence + 1
            # Queued under the lock: the stream carries the inputs in sequence order.
            self._put(CollectiveUpload(sequence, op, dtype, root, payload, template))
        size = payload.nbytes
        log.debug("rank %d: collective %d: %s of %d bytes", self.rank, sequence, op_name(op), size)
        return sequence

    @property
    def collective_sequence(self) -> int:
        return self._next_collective

    def set_collective_sequence(self, sequence: int) -> None:
        if sequence < 0:
            raise ValueError(f"a collective sequence number cannot be negative, got {sequence}")
        with self._sequence_lock:
            self._next_collective = sequence

    def send_out_of_inputs(self, step: int) -> None:
        self._put(pb.WorkerMessage(out_of_inputs=pb.OutOfInputs(step=step)))

    def send_local_posted(self, step: int, bucket_index: int) -> None:
        posted = pb.LocalPosted(step=step, bucket_index=bucket_index)
        self._put(pb.WorkerMessage(local_posted=posted))

    def send_state(self, blob: npt.NDArray[np.uint8]) -> None:
        self._put(StateUpload(blob))

    def send_checkpoint(self, step: int, blob: bytes) -> None:
        self._put(CheckpointUpload(step, blob))

    def abandon_step(self, step: int, reason: str) -> None:
        self._put(pb.WorkerMessage(abandon=pb.AbandonStep(step=step, reason=reason)))

    def send_heal(self, step: int, blob: bytes | bytearray) -> None:
        self._put(CheckpointUpload(step, blob, heal=True))

    def submit_bucket(
        self,
        step: int,
        bucket_index: int,
        buffer: BucketBuffer,
        dtype: int,
        *,
        result: BucketBuffer | None = None,
        result_dtype: int = 0,
        covered_ranks: tuple[int, ...] = (),
        nonfinite_ranks: tuple[int, ...] = (),
        segment_offset: int | None = None,
    ) -> None:
        """Sharded, range i of the bucket goes to shard i; with `segment_offset` (a local
        leader whose segment the coordinator holds; unsharded, no `result`) chunks travel
        header-only and averages land in place.

        Raises:
            ValueError: `buffer` is not a whole number of `dtype` elements (sharded only).
        """
        welcome = self._inbox.welcome
        shard_count = max(1, len(welcome.shards)) if welcome is not None else 1
        reply_dtype = 0 if result is None else result_dtype
        if shard_count > 1 or result is not None:
            segment_offset = None  # the coordinator reads whole buckets in their own dtype
        upload = BucketUpload(
            step,
            bucket_index,
            buffer,
            dtype,
            reply_dtype,
            covered_ranks,
            segment_offset,
            nonfinite_ranks,
        )
        parts = split_upload(upload, shard_count)
        self._inbox.expect_bucket(
            step,
            bucket_index,
            buffer if result is None else result,
            reply_dtype or dtype,
            segment_offset,
        )
        if self._loop.is_closed():
            raise ClosedError("the transport is closed", rank=self.rank)
        if len(parts) == 1 and self._pacer.window_bytes <= 0 and parts[0] is not None:
            self._sync.send_threadsafe(parts[0])  # unpaced, one stream: straight out
        else:
            self._loop.call_soon_threadsafe(self._pacer.dispatch, parts)

    def close(self, timeout_s: float = 10.0) -> None:
        """Say goodbye, wait (bounded) for the streams to end, stop the loop thread.

        Every shard stream gets a Leave too, closed in parallel with the leader's.
        """
        if self._closed:
            return
        self._closed = True
        try:
            # Bounded inside (the goodbye by `timeout_s`, the teardown by the stream's
            # own bound); torn down by `_shutdown` regardless.
            with contextlib.suppress(Exception):
                self._run(self._close_streams(timeout_s), timeout_s=2 * timeout_s)
            self._run(self._shutdown(), timeout_s=timeout_s)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=timeout_s)
            if not self._thread.is_alive():
                self._loop.close()

    # ------------------------------------------------------ loop-thread side
    async def _open(self, join: pb.Join) -> None:
        self._join = join
        self._sync.send(pb.WorkerMessage(join=join))
        self._sync.start()
        self._heartbeat = asyncio.create_task(self._send_heartbeats())

    async def _send_heartbeats(self) -> None:
        """Queue a Heartbeat every interval from the moment the stream is open.

        Also while the job assembles: the coordinator counts a waiting rank as
        alive only if it hears from it. The interval is the coordinator's (from
        its first AssemblyProgress or the Welcome), else the default. A beat
        is queued only once the previous one has left, so that nothing piles
        up while the coordinator is unreachable. Once there is a session and
        while the stream runs on frames, each beat also goes on the side
        channel (`SideBeats`), where gradient bytes cannot delay it.
        """
        while True:
            interval_s = self._inbox.heartbeat_interval_s or defaults.HEARTBEAT_INTERVAL_S
            await asyncio.sleep(interval_s)
            self._side_beats.beat(interval_s)
            if not self._heartbeat_queued:
                self._heartbeat_queued = True
                self._sync.send(_HEARTBEAT)

    def _send_to(self, index: int, part: RangeUpload) -> None:
        """Queue range 0 of a bucket here, range i on shard i's stream (loop; the pacer's)."""
        if index == 0:
            self._sync.send(part)
            return
        self._open_shards()  # (the Welcome may have been read on another thread just now)
        if self._shards is not None:
            self._shards.send(index, part)

    def send_to_shard(self, index: int, upload: CollectiveUpload) -> None:
        """Queue a collective input on shard `index`'s data stream (returns at once).

        For a process group's ranges of an all-reduce (`gradsync.distributed.shard_routes`);
        its results reach `on_shard_collective`. A shard with no stream open is reported
        to `on_shard_failed`.
        """
        if self._loop.is_closed():
            raise ClosedError("the transport is closed", rank=self.rank)
        self._on_loop(self._send_collective_to_shard, index, upload)

    def _send_collective_to_shard(self, index: int, upload: CollectiveUpload) -> None:
        self._open_shards()
        if self._shards is not None and self._shards.send(index, upload):
            return
        self._shard_failed(
            ShardUnavailableError(
                f"rank {self.rank} has no data stream open to shard {index}",
                rank=self.rank,
                shard_index=index,
            )
        )

    def _shard_collective(self, index: int, chunk: pb.CollectiveChunk) -> None:
        if self.on_shard_collective is not None:
            self.on_shard_collective(index, chunk)
        else:
            self._inbox.protocol_fault(
                f"shard {index} sent a result of collective {chunk.sequence}, which this "
                "rank never sent it"
            )

    def _shard_failed(self, error: ShardUnavailableError) -> None:
        if self.on_shard_failed is not None:
            self.on_shard_failed(error)

    def _range_messages(self, part: RangeUpload) -> Iterator[bytes]:
        """A range's chunks with the Welcome's chunk size and the current epoch."""
        epoch = self._inbox.membership_epoch
        return range_messages(part, chunk_bytes_of(self._inbox.welcome), epoch, self._bucket_event)

    async def _close_streams(self, timeout_s: float) -> None:
        """Say goodbye on every stream in parallel, each bounded."""
        leave = pb.WorkerMessage(leave=pb.Leave(reason="closed by the worker"))
        closing = [self._sync.close(timeout_s, farewell=leave)]
        if self._shards is not None:
            closing.append(self._shards.close(timeout_s))
        await asyncio.gather(*closing)

    def _messages(self, item: Upload | _Heartbeat) -> Iterator[bytes]:
        """The Sync stream's wire messages of a queued item (read when it is written).

        The chunk size and membership epoch are the Welcome's and the latest
        announced; a heartbeat reports the step at the moment it leaves.
        """
        if isinstance(item, _Heartbeat):
            self._heartbeat_queued = False
            beat = pb.WorkerMessage(heartbeat=pb.Heartbeat(step=self.current_step))
            return iter((beat.SerializeToString(),))
        welcome = self._inbox.welcome
        chunk_bytes, epoch = chunking.DEFAULT_CHUNK_BYTES, 0
        if welcome is not None:
            chunk_bytes, epoch = welcome.chunk_bytes, self._inbox.membership_epoch
        return upload_messages(item, chunk_bytes, epoch, self._bucket_event)

    def _on_message(self, raw: bytes) -> None:
        """Take in a message (the loop's thread, or a frame socket's reader thread)."""
        self._inbox.on_message(raw)
        if not self._shards_opening and self._inbox.welcome is not None:
            self._shards_opening = True
            self._on_loop(self._open_shards)

    def _open_shards(self) -> None:
        """At the first Welcome: the data streams to shards 1..S-1 (none unsharded)."""
        welcome = self._inbox.welcome
        if self._shards is not None or welcome is None:
            return
        # (answers may be read on a frame socket's thread; the pacer is the loop's)
        closing, answered = (
            (lambda: self._closed),
            functools.partial(self._on_loop, self._pacer.answered),
        )
        self._shards = ShardStreams(
            self.target,
            self._inbox,
            self._range_messages,
            closing,
            answered,
            self._security,
            encode_other=lambda item: self._messages(cast(Upload, item)),
            on_collective=self._shard_collective,
            on_failed=self._shard_failed,
        )
        self._shards.open(welcome, self._join or pb.Join())

    def _on_end(self, ended: StreamEnded) -> None:
        """Record how the Sync stream ended as the error every later wait raises (or None)."""
        failure = stream_end_failure(ended, self._closed, self.rank, self._inbox.stream_failure)
        self._inbox.stream_ended(failure)

    def _bucket_event(self, event: str, step: int, bucket_index: int) -> None:
        if self.on_bucket_event is not None:
            try:
                self.on_bucket_event(event, step, bucket_index)
            except Exception:  # instrumentation must never break the data path
                log.exception("bucket event handler failed")

    async def _shutdown(self) -> None:
        """Cancel the call and every task of the loop, and wait for them (no asyncio noise:
        "Task was destroyed but it is pending!", "Future exception was never retrieved")."""
        if self._heartbeat is not None:
            self._heartbeat.cancel()
        await self._side_beats.stop()
        self._pacer.close()
        await self._sync.close(0.0)  # no-op for a stream already closed by `close`
        if self._shards is not None:
            await self._shards.close(0.0)
        current = asyncio.current_task()
        for _ in range(3):  # closing the channel can start gRPC's own last tasks
            others = [task for task in asyncio.all_tasks() if task is not current]
            if not others:
                break
            for task in others:
                task.cancel()
            await asyncio.gather(*others, return_exceptions=True)

    # --------------------------------------------------------------- helpers
    def _put(self, item: object) -> None:
        if self._loop.is_closed():
            raise ClosedError("the transport is closed", rank=self.rank)
        self._sync.send_threadsafe(item)

    def _on_loop(self, callback: Any, *args: Any) -> None:
        """Run `callback(*args)` on the loop: now when called there, else soon."""
        if threading.get_ident() == self._thread.ident:
            callback(*args)
        elif not self._loop.is_closed():
            with contextlib.suppress(RuntimeError):  # closed meanwhile
                self._loop.call_soon_threadsafe(callback, *args)

    def _run(self, coroutine: Any, timeout_s: float) -> Any:
        future = asyncio.run_coroutine_threadsafe(coroutine, self._loop)
        return future.result(timeout=timeout_s)
