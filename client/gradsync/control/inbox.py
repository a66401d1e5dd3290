"""What the coordinator has told one worker: the receive side of the Sync stream.

`Inbox` turns the coordinator's messages into state that the training thread
waits on: how the job's assembly is going, the Welcome, rank 0's state and the
checkpoint to resume from as they arrive in chunks, averaged gradients
scattered straight into the buckets that were uploaded, collective results
(checked by `gradsync.control.collective_results`), join() progress, aborted steps,
checkpoint acknowledgements, heal requests and, last, why the stream ended.
One condition variable guards it all (the state itself is an
`gradsync.control.inbox_state.InboxState`), and every wait is bounded; a failure is
stored and raised at the next wait.

With a sharded coordinator the averages of shard i arrive on this worker's
data stream to shard i and land here too (offsets are absolute); a failed
shard stream waits for the leader's verdict (`gradsync.path.shard_streams.ShardFault`).

It imports neither grpc nor asyncio: `gradsync.control.transport` feeds it raw bytes
from its I/O thread, and tests feed it messages in any order they like.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable

from gradsync_proto import chunking
from gradsync_proto.blobs import BlobAssembly
from gradsync_proto.codec import ChunkHeader, decode_gradient, header_of
from gradsync_proto.v1 import gradsync_pb2 as pb

from gradsync.control.collective_results import CollectiveResults
from gradsync.control.inbox_state import (
    Expected,
    InboxState,
    end_reason_name,
    ended_stream_error,
    welcome_problem,
)
from gradsync.errors import (
    CollectiveError,
    GradSyncError,
    ShardUnavailableError,
    SyncTimeoutError,
)
from gradsync.path.buffers import BucketBuffer
from gradsync.path.shard_streams import SHARD_GRACE_MARGIN_S, shard_grace_s
from gradsync.path.step_results import RoundReport, StepResults

log = logging.getLogger("gradsync.client")


class Inbox:
    """The coordinator's messages to one worker, and bounded waits on them.

    Args:
        target: "host:port" of the coordinator (for error messages).
        rank: this worker's rank (for error messages).
        on_averaged: called as (step, bucket_index) when a bucket's averages are
            complete, under the lock; must be quick and must not raise.
        shard_grace_margin_s: a failed shard stream is raised this long plus 3
            heartbeat intervals after it failed, unless the leader spoke first.
    """

    def __init__(
        self,
        target: str,
        rank: int,
        on_averaged: Callable[[int, int], None] | None = None,
        *,
        shard_grace_margin_s: float = SHARD_GRACE_MARGIN_S,
    ) -> None:
        self.target = target
        self.rank = rank
        self.shard_grace_margin_s = shard_grace_margin_s
        self._cond = threading.Condition()
        self._shared = InboxState()
        self._steps = StepResults(rank, on_averaged)
        self._collectives = CollectiveResults(rank)
        #: What the Welcome must say, from this worker's own Join (None: not checked).
        self._expected: Expected | None = None
        #: Told (step, dtype, payload bytes) of every averaged chunk of the leader's
        #: stream, on the loop thread (the upload pacer's clock, `gradsync.path.pacing`).
        self.on_answer: Callable[[int, int, int], None] | None = None

    def expect(self, join: pb.Join) -> None:
        """Check the Welcome (and size the state and resume buffers) against `join`."""
        self._expected = Expected.of(join)

    # ------------------------------------------------------------ training-thread side
    def configure_buckets(self, bucket_bytes: list[int]) -> None:
        """Set the size of each bucket (a step is complete when all are averaged)."""
        self._steps.bucket_bytes = list(bucket_bytes)

    @property
    def welcome(self) -> pb.Welcome | None:
        """The Welcome, once the job is assembled."""
        return self._shared.welcome

    @property
    def membership_epoch(self) -> int:
        """The latest membership epoch the coordinator announced."""
        return self._shared.membership_epoch

    @property
    def heartbeat_interval_s(self) -> float | None:
        """The heartbeat interval the coordinator asked for, once it said (else None)."""
        return self._shared.heartbeat_interval_s

    def wait(self, predicate: Callable[[InboxState], bool], timeout_s: float, what: str) -> None:
        """Block until `predicate` holds; raise a recorded failure, or time out naming `what`."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            shared = self._shared
            while not predicate(shared):
                if shared.fatal is not None:
                    raise shared.fatal
                now = time.monotonic()
                shard_error = shared.shard_fault.due(now)
                if shard_error is not None:  # the leader said nothing within the grace
                    shared.fatal = shard_error
                    raise shard_error
                remaining = deadline - now
                if remaining <= 0:
                    raise SyncTimeoutError(
                        f"timed out after {timeout_s:g}s waiting for {what}"
                        + shared.shard_fault.pending_note(),
                        rank=self.rank,
                    )
                self._cond.wait(shared.shard_fault.bound(now, remaining))

    def wait_welcome(self, timeout_s: float) -> pb.Welcome:
        """Block until the job is assembled (see `Transport.wait_welcome`)."""
        self.wait(lambda s: s.welcome is not None, timeout_s, "the job to assemble")
        welcome = self._shared.welcome
        assert welcome is not None
        return welcome

    def wait_assembly(
        self, timeout_s: float, seen_count: int
    ) -> tuple[pb.Welcome | None, pb.AssemblyProgress | None, int]:
        """Block until the Welcome or an AssemblyProgress newer than `seen_count` arrives.

        Returns at the timeout without raising, so that the caller can report
        progress every few seconds and decide itself when to give up.

        Returns:
            (the Welcome or None, the latest AssemblyProgress or None, its count).

        Raises:
            GradSyncError: a recorded failure (the join was refused, the stream failed).
        """
        with contextlib.suppress(SyncTimeoutError):  # the caller decides when to give up
            self.wait(
                lambda s: s.welcome is not None or s.assembly_count > seen_count,
                timeout_s,
                "the job to assemble",
            )
        with self._cond:
            shared = self._shared
            return shared.welcome, shared.assembly, shared.assembly_count

    def expect_collective(
        self,
        sequence: int,
        op: int,
        dtype: int,
        input_bytes: int,
        result_bytes: int | None,
        on_ready: Callable[[], None] | None = None,
    ) -> None:
        """Register an issued collective before its input is sent (see `CollectiveResults`).

        `on_ready` is called once on the stream's reading thread, outside the inbox's
        lock, when the result is whole or failed, or when the stream failed (a
        `wait_collective` then returns or raises at once). It must not block.

        Raises:
            CollectiveError: the job has not assembled yet (no chunk size, no world size).
        """
        with self._cond:
            welcome = self._shared.welcome
            if welcome is None:
                raise CollectiveError(
                    "collectives need an assembled job (after the Welcome)",
                    rank=self.rank,
                    sequence=sequence,
                )
            self._collectives.expect(
                sequence,
                op,
                dtype,
                input_bytes,
                world_size=welcome.world_size,
                chunk_bytes=welcome.chunk_bytes or chunking.DEFAULT_CHUNK_BYTES,
                result_bytes=result_bytes,
                on_ready=on_ready,
            )
            # Issued on a stream that already failed: its wait raises at once, so it is told.
            hooks = self._collectives.take_all_hooks() if self._shared.fatal is not None else []
        _run_hooks(hooks)

    def wait_collective(self, sequence: int, timeout_s: float) -> tuple[bytearray, int]:
        """Block until the result of collective `sequence` is complete.

        Returns:
            (the result's bytes, how many ranks contributed).

        Raises:
            CollectiveError: the result was malformed or not what was asked.
            SyncTimeoutError: it did not complete in time (names what is missing).
            GradSyncError: the stream failed.
        """
        try:
            self.wait(
                lambda _: self._collectives.is_ready(sequence),
                timeout_s,
                f"the result of collective {sequence}",
            )
        except SyncTimeoutError as exc:
            with self._cond:
                missing = self._collectives.describe(sequence)
                self._collectives.forget(sequence)
            raise SyncTimeoutError(f"{exc.args[0]} ({missing})", rank=self.rank) from None
        except GradSyncError:
            with self._cond:
                self._collectives.forget(sequence)
            raise
        with self._cond:
            return self._collectives.take(sequence)

    # ------------------ the waits and reads `CoordinatorLink` documents (the transport binds them)
    def wait_join_progress(self, timeout_s: float) -> pb.JoinProgress:
        """Block until a JoinProgress not yet taken is there; take and return the oldest."""
        self.wait(
            lambda s: bool(s.join_progress), timeout_s, "join() progress from the coordinator"
        )
        with self._cond:
            return self._shared.join_progress.popleft()

    def receive_state(self, num_bytes: int, timeout_s: float) -> bytearray:
        self.wait(lambda s: _arrived(s.state, num_bytes), timeout_s, "rank 0's state")
        with self._cond:
            assert self._shared.state is not None
            return self._shared.state.blob()

    def receive_resume(self, num_bytes: int, timeout_s: float) -> bytearray:
        """Block until the checkpoint this job resumes from has arrived; return it.

        Not copied (a 1 GB copy held the GIL, and the heartbeats, for seconds); it is
        handed over: the inbox keeps nothing of it.
        """
        self.wait(
            lambda s: _arrived(s.resume, num_bytes), timeout_s, "the checkpoint to resume from"
        )
        with self._cond:
            assert self._shared.resume is not None
            blob = self._shared.resume.blob()
            self._shared.resume = None
            return blob

    def step_report(self) -> pb.StepReport | None:
        with self._cond:
            return self._shared.step_report

    def live_ranks(self) -> tuple[int, ...] | None:
        with self._cond:
            return self._shared.live_ranks

    def take_heal_request(self) -> bool:
        with self._cond:
            requested, self._shared.heal_requested = self._shared.heal_requested, False
            if requested:
                self._shared.heal_epoch = self._shared.membership_epoch
            return requested

    def heal_relay_requested(self) -> bool:
        with self._cond:
            return self._shared.heal_relay

    def wait_heal_answer(self, step: int, timeout_s: float) -> bool:
        with self._cond:
            epoch = self._shared.heal_epoch
        if epoch is None:
            return True  # no state sent: nothing to wait for
        what = f"the coordinator to admit the ranks healed with this rank's state (epoch {epoch})"

        def answered(shared: InboxState) -> bool:
            moved = shared.membership_epoch > epoch or shared.heal_requested
            return moved or self._steps.was_aborted(step)

        try:
            self.wait(answered, timeout_s, what)
        except SyncTimeoutError:
            return False
        return True

    def wait_checkpoint(self, step: int, timeout_s: float) -> pb.CheckpointSaved:
        self.wait(lambda s: step in s.checkpoint_acks, timeout_s, f"the checkpoint of step {step}")
        with self._cond:
            return self._shared.checkpoint_acks.pop(step)

    def expect_bucket(
        self,
        step: int,
        bucket_index: int,
        buffer: BucketBuffer,
        dtype: int,
        segment_offset: int | None = None,
    ) -> None:
        """Register where the averages of an uploaded bucket (in `dtype`) are to be written.

        `segment_offset`: uploaded through the segment from there (the averages land in place).
        """
        with self._cond:
            self._steps.expect(step, bucket_index, buffer, dtype, segment_offset)

    def wait_step(self, step: int, timeout_s: float) -> int:
        with self._cond:
            self._steps.watch(step)
        try:
            self.wait(
                lambda _: self._steps.is_ready(step),
                timeout_s,
                f"the averaged gradients of step {step}",
            )
        except SyncTimeoutError as exc:
            with self._cond:
                missing = self._steps.describe_missing(step)
            raise SyncTimeoutError(f"{exc.args[0]}; {missing}", rank=self.rank, step=step) from None
        with self._cond:
            return self._steps.take(step)

    def round_report(self) -> RoundReport:
        with self._cond:
            return self._steps.last_report

    # ------------------------------------------------------------ I/O-thread side
    def on_message(self, raw: bytes) -> None:
        """Take in one serialized CoordinatorMessage and wake the waiters."""
        fast = decode_gradient(raw)
        if fast is not None:
            if self.on_answer is not None:
                self.on_answer(fast[0].step, fast[0].dtype, len(fast[1]))
            with self._cond:
                self._on_gradient(*fast)
                self._cond.notify_all()
            return
        message = pb.CoordinatorMessage.FromString(raw)
        kind = message.WhichOneof("kind")
        hooks: list[Callable[[], None]] = []
        with self._cond:
            shared = self._shared
            problem: str | None = None  # malformed: the stream is not trusted (`protocol_fault`)
            if kind == "welcome":
                expected = self._expected
                problem = None if expected is None else welcome_problem(message.welcome, expected)
                if problem is not None:
                    self.protocol_fault(problem)
                    self._cond.notify_all()
                    return
                shared.record_welcome(message.welcome)
                # The grid every bucket's averages come back on.
                self._steps.chunk_bytes = (
                    message.welcome.chunk_bytes or chunking.DEFAULT_CHUNK_BYTES
                )
                self._steps.shard_count = max(1, len(message.welcome.shards))
                if message.welcome.heartbeat_interval_s > 0:
                    shared.heartbeat_interval_s = message.welcome.heartbeat_interval_s
            elif kind == "state":
                problem = shared.append_state(message.state)
            elif kind == "gradient":
                chunk = message.gradient
                self._on_gradient(header_of(chunk), memoryview(chunk.payload))
            elif kind == "collective":
                problem = self._collectives.on_chunk(message.collective)
                hook = self._collectives.take_ready_hook(message.collective.sequence)
                if hook is not None:
                    hooks.append(hook)
            elif kind == "assembly":
                shared.record_assembly(message.assembly, self.rank)
            elif kind == "join_progress":
                shared.join_progress.append(message.join_progress)
            elif kind == "step_report":
                shared.step_report = message.step_report
            elif kind == "step_aborted":
                self._steps.on_aborted(message.step_aborted)
            elif kind == "membership":
                change = message.membership
                shared.membership_epoch = change.membership_epoch
                shared.live_ranks = tuple(change.ranks)
                log.warning("rank %d: membership changed: %s", self.rank, change.reason)
            elif kind == "state_request":
                shared.heal_requested = True
                shared.heal_relay = message.state_request.relay
                log.warning(
                    "rank %d: asked for its state to heal rejoining rank %d",
                    self.rank,
                    message.state_request.for_rank,
                )
            elif kind == "resume":
                problem = shared.append_resume(message.resume)
            elif kind == "stream_end":
                # Kept until the status arrives: the two together make the error.
                shared.stream_end = message.stream_end
                log.warning(
                    "rank %d: the coordinator is ending the stream (%s): %s",
                    self.rank,
                    end_reason_name(message.stream_end.reason),
                    message.stream_end.message,
                )
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
            if problem is not None:
                self.protocol_fault(problem)
            if shared.fatal is not None:
                hooks += self._collectives.take_all_hooks()
            self._cond.notify_all()
        _run_hooks(hooks)

    def on_averaged_chunk(self, chunk: ChunkHeader, payload: memoryview, source: str) -> None:
        """Take in an averaged chunk that came from a shard's data stream (`source` names it)."""
        with self._cond:
            problem = self._steps.on_gradient(chunk, payload)
            if problem is not None:
                self.protocol_fault(problem, source)
            self._cond.notify_all()

    def protocol_fault(self, what: str, source: str | None = None) -> None:
        """Record that `source` (default: the coordinator) sent something invalid.

        The stream is then not to be trusted: the next wait raises.
        """
        with self._cond:
            if self._shared.fatal is None:
                self._shared.fatal = GradSyncError(
                    f"{source or f'the coordinator at {self.target}'} sent an invalid "
                    f"message: {what}",
                    rank=self.rank,
                )
            self._cond.notify_all()

    def shard_failed(self, error: ShardUnavailableError) -> None:
        """Record a failed shard data stream, raised by waits after the grace.

        The grace (3 heartbeat intervals plus a margin, from now) leaves the
        leader time to end the job with SHARD_LOST, which every rank then sees
        alike. Only the first failure is kept.
        """
        with self._cond:
            grace = shard_grace_s(self._shared.heartbeat_interval_s, self.shard_grace_margin_s)
            if self._shared.shard_fault.record(error, time.monotonic(), grace):
                log.warning(
                    "rank %d: %s; waiting up to %gs for the leader to end the job",
                    self.rank,
                    error,
                    grace,
                )
            self._cond.notify_all()

    def stream_failure(self, code: int | None, details: str) -> GradSyncError:
        """The error for a stream that ended with status `code` (None: ended without one)."""
        with self._cond:
            end = self._shared.stream_end
        return ended_stream_error(end, code, details, self.target, self.rank)

    def stream_ended(self, failure: GradSyncError | None) -> None:
        """Record the end of the stream (and its failure, unless one is already recorded).

        Closing waits for the end itself (`StreamClient.close`), not here.
        """
        with self._cond:
            if failure is not None and self._shared.fatal is None:
                self._shared.fatal = failure
            hooks = self._collectives.take_all_hooks() if self._shared.fatal is not None else []
            self._cond.notify_all()
        _run_hooks(hooks)

    def _on_gradient(self, chunk: ChunkHeader, payload: memoryview) -> None:
        problem = self._steps.on_gradient(chunk, payload)
        if problem is not None:
            self.protocol_fault(problem)


def _run_hooks(hooks: list[Callable[[], None]]) -> None:
    """Call collectives' `on_ready` hooks; one that raises is logged, never the reader's end."""
    for hook in hooks:
        try:
            hook()
        except Exception:
            log.exception("a collective's completion hook failed")


def _arrived(blob: BlobAssembly | None, num_bytes: int) -> bool:
    """True once every chunk of a blob of (at least) `num_bytes` is in."""
    return blob is not None and blob.complete and blob.received >= num_bytes
