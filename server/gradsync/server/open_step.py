"""The one step a job has in flight: its reductions, its progress and how it ends.

Steps are lock-step: ranks start step s + 1 only after receiving every
averaged bucket of step s, so exactly one step per job is open. This module
owns it: it validates each gradient chunk against the step (number, epoch,
bucket, dtype, offset, length, the byte budget), folds it into the bucket's
`BucketReduction`, hands back the averaged chunks the moment they complete
(architecture invariant 4), and frees the step's memory whether it completes,
is aborted for everyone, or loses a rank under the elastic policy. Every byte
it buffers is held through a `Reservation` of the coordinator's `ByteBudget`.

Two refinements of "every member contributes, divide by the contributions":
a rank that ran out of inputs (DDP's `join()`, `out_of_inputs`) is not
expected, yet averages keep dividing by the membership's size; and a comm
hook may send a float32/float64 bucket as float16/bfloat16 (every rank the
same per step and bucket), which is accumulated in float32 and answered in
the same 16-bit type. Pure logic, no gRPC, no asyncio.

A sharded coordinator runs one `OpenStep` per shard over the same membership
rules: shard i of S holds byte range i of every bucket (in wire bytes,
`chunking.shard_byte_range`) and expects exactly that range's chunks
(`chunking.range_chunk_spans`). A bucket whose range is empty at this shard
(fewer elements than shards) counts as complete from the step's start. With
one shard the range is the whole bucket and everything is as unsharded.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

from gradsync.protocol import chunking, dtypes
from gradsync.protocol.codec import ChunkHeader, encode_gradient
from gradsync.protocol.codes import Code
from gradsync.server import signature as signatures
from gradsync.server.actions import Action, Send
from gradsync.server.aggregation import BucketReduction, DuplicateContributionError
from gradsync.server.budget import ByteBudget, Reservation
from gradsync.server.chunk_checks import check_chunk, check_range_chunk
from gradsync.server.errors import RejectedMessage
from gradsync.server.metrics import CoordinatorMetrics
from gradsync.server.progress import StepProgress
from gradsync.server.wire_replies import (
    COMPRESSED_WIRE,
    reply_dtype_of,
    reply_dtype_problem,
    reply_pieces,
)
from gradsync.v1 import gradsync_pb2 as pb

__all__ = ["OpenStep", "StepMembership", "abort_message", "check_chunk", "check_range_chunk"]

#: Aborted step numbers remembered so that late chunks for them are dropped
#: quietly instead of being reported as stale.
_ABORTED_STEPS_REMEMBERED = 64


class StepMembership(Protocol):
    """What an open step reads of its job's membership.

    `Membership` at the leader; a replica of the leader's view at a shard
    (`gradsync.server.shard_view`), which knows only ranks and incarnations.
    """

    @property
    def job_id(self) -> str: ...

    @property
    def epoch(self) -> int: ...

    @property
    def members(self) -> Mapping[int, object]: ...

    def ranks(self) -> tuple[int, ...]:
        """Members of the current epoch, ascending."""
        ...


def abort_message(
    ranks: tuple[int, ...],
    step: int,
    code: Code,
    details: str,
    bucket_index: int,
    reason: pb.AbortReason,
    culprit: int = -1,
) -> Send:
    """A StepAborted for `ranks`."""
    aborted = pb.StepAborted(
        step=step,
        code=int(code),
        message=details,
        culprit_rank=culprit,
        bucket_index=bucket_index,
        reason=reason,
    )
    return Send(ranks, pb.CoordinatorMessage(step_aborted=aborted))


_COMPRESSIBLE = (pb.DTYPE_FLOAT32, pb.DTYPE_FLOAT64)


@dataclass
class _Bucket:
    """One bucket's reduction, the budget it holds, and who set its wire and reply dtypes."""

    reduction: BucketReduction
    reservation: Reservation
    first_rank: int

    def account(self) -> None:
        self.reservation.hold(self.reduction.buffered_bytes)


class OpenStep:
    """The open step of one job.

    Args:
        membership: the job's membership (ranks and epoch the step runs over).
        chunk_bytes: chunk size every rank must use.
        budget: coordinator-wide cap on buffered gradient bytes.
        clock: monotonic time source (injectable for tests).
        metrics: where bucket and step latencies go, if anywhere.
        shard_index: which byte range of every bucket this step aggregates.
        shard_count: how many shards the buckets are cut into (1 = unsharded).

    Raises:
        ValueError: `shard_index` is not in 0..shard_count - 1.
    """

    def __init__(
        self,
        membership: StepMembership,
        chunk_bytes: int,
        budget: ByteBudget,
        clock: Callable[[], float],
        metrics: CoordinatorMetrics | None,
        shard_index: int = 0,
        shard_count: int = 1,
    ) -> None:
        if not 0 <= shard_index < shard_count:
            raise ValueError(f"shard index {shard_index} is not in 0..{shard_count - 1}")
        self.shard_index = shard_index
        self.shard_count = shard_count
        #: How errors name this shard (set by a shard process to add its address).
        self.shard_name = f"shard {shard_index}"
        self._membership = membership
        self._chunk_bytes = chunk_bytes
        self._budget = budget
        self._clock = clock
        self._metrics = metrics
        #: The step number in flight.
        self.step = 0
        #: Steps whose every bucket was averaged.
        self.steps_completed = 0
        #: None until the job is assembled (the bucket layout is known).
        self.progress: StepProgress | None = None
        self._start_epoch = 0
        self._bucket_bytes: list[int] = []
        self._bucket_dtypes: list[int] = []
        self._bucket_elements: list[int] = []
        #: Buckets of which this shard holds no byte: complete from the start.
        self._empty_buckets = 0
        self._buckets: dict[int, _Bucket] = {}
        self._buckets_done = 0
        self._aborted: deque[int] = deque(maxlen=_ABORTED_STEPS_REMEMBERED)
        #: Ranks that ran out of inputs (join()): not expected in reductions.
        self.out_of_inputs: set[int] = set()

    def participants(self) -> tuple[int, ...]:
        """Members expected in the open step's reductions, ascending."""
        return tuple(r for r in self._membership.ranks() if r not in self.out_of_inputs)

    def _divisor(self) -> int | None:
        """While some ranks ran out of inputs, averages divide by the membership's size."""
        return len(self._membership.members) if self.out_of_inputs else None

    def has_contributions(self) -> bool:
        """True once any chunk of the open step has arrived."""
        return bool(self._buckets) or (
            self.progress is not None and self.progress.started_at is not None
        )

    def configure(self, signature: pb.ModelSignature, step: int) -> None:
        """The job is assembled: learn the bucket layout and start at `step`.

        The first step accepts any epoch up to the current one (a resumed job
        starts in its checkpoint's epoch); later steps only the epoch they began in.
        """
        self._bucket_bytes = [signatures.bucket_bytes(b) for b in signature.buckets]
        self._bucket_dtypes = [b.dtype for b in signature.buckets]
        self._bucket_elements = [b.num_elements for b in signature.buckets]
        spans = [self.byte_range(b, dtype) for b, dtype in enumerate(self._bucket_dtypes)]
        self.progress = StepProgress(
            [chunking.num_chunks(hi - lo, self._chunk_bytes) for lo, hi in spans], self._clock
        )
        self._empty_buckets = sum(1 for lo, hi in spans if lo == hi)
        self._buckets_done = self._empty_buckets
        self.step = step

    def byte_range(self, bucket: int, wire_dtype: int) -> tuple[int, int]:
        """Bytes [lo, hi) of `bucket`, sent as `wire_dtype`, that this shard aggregates."""
        return chunking.shard_byte_range(
            self._bucket_elements[bucket],
            dtypes.itemsize(wire_dtype),
            self.shard_count,
            self.shard_index,
        )

    def was_aborted(self, step: int) -> bool:
        """True if `step` is a recently aborted one (late chunks for it are dropped)."""
        return step in self._aborted

    def remember_aborted(self, step: int) -> None:
        """Note that every rank was told `step` cannot complete."""
        self._aborted.append(step)

    # -------------------------------------------------------------- gradients
    def accept(self, rank: int, chunk: ChunkHeader, payload: memoryview) -> list[Action]:
        """Validate `chunk`, fold it in, and return the averaged chunk once complete.

        Raises:
            RejectedMessage: the chunk does not belong to this step or is malformed.
        """
        averaged = self._fold(rank, chunk, payload)
        if averaged is None:
            return []
        bucket = chunk.bucket_index
        sends = self._averaged(bucket, chunk.offset, averaged)
        return [*sends, *self._close_bucket_if_complete(bucket)]

    def _fold(self, rank: int, chunk: ChunkHeader, payload: memoryview) -> memoryview | None:
        step, bucket, epoch = chunk.step, chunk.bucket_index, self._membership.epoch
        # A step begun before a membership change may finish in the old epoch.
        if not self._start_epoch <= chunk.membership_epoch <= epoch:
            raise RejectedMessage(
                Code.FAILED_PRECONDITION,
                f"rank {rank} sent step {step} for membership epoch {chunk.membership_epoch}, "
                f"expected epoch {epoch}",
                step=step,
            )
        if rank not in self._membership.members:
            raise RejectedMessage(
                Code.FAILED_PRECONDITION,
                f"rank {rank} sent step {step} but is not a member of job "
                f"'{self._membership.job_id}' (epoch {epoch}); it must rejoin first",
                step=step,
            )
        if step != self.step:
            kind = "stale" if step < self.step else "future"
            raise RejectedMessage(
                Code.FAILED_PRECONDITION,
                f"rank {rank} sent {kind} step {step} (bucket {bucket}), expected step {self.step}",
                step=step,
                bucket_index=bucket,
            )
        if bucket >= len(self._bucket_bytes):
            raise RejectedMessage(
                Code.INVALID_ARGUMENT,
                f"rank {rank} sent bucket {bucket} for step {step}, but the model has "
                f"{len(self._bucket_bytes)} buckets (0..{len(self._bucket_bytes) - 1})",
                step=step,
            )
        if rank in self.out_of_inputs:
            raise RejectedMessage(
                Code.FAILED_PRECONDITION,
                f"rank {rank} sent bucket {bucket} of step {step} after running out of inputs "
                "(join()); it contributes nothing until every rank has joined",
                step=step,
                bucket_index=bucket,
            )
        held = self._buckets.get(bucket)
        wire_dtype = self._check_wire_dtype(rank, chunk, held)
        reply_dtype = self._check_reply_dtype(rank, chunk, held, wire_dtype)
        native = self._bucket_dtypes[bucket]
        wire_bytes = (
            self._bucket_bytes[bucket] // dtypes.itemsize(native) * dtypes.itemsize(wire_dtype)
        )
        if chunk.encoding != pb.ENCODING_RAW:
            raise RejectedMessage(
                Code.INVALID_ARGUMENT,
                f"rank {rank} sent bucket {bucket} of step {step} with encoding "
                f"{chunk.encoding}, this coordinator only accepts raw (0)",
                step=step,
                bucket_index=bucket,
            )
        byte_range = self.byte_range(bucket, wire_dtype)
        problem = self._check_offset(rank, chunk, len(payload), wire_bytes, wire_dtype, byte_range)
        if problem is not None:
            raise RejectedMessage(problem[0], problem[1], step=step, bucket_index=bucket)
        if not self._budget.fits(len(payload)):
            raise RejectedMessage(
                Code.RESOURCE_EXHAUSTED,
                f"rank {rank} sent {len(payload)} bytes for bucket {bucket} of step "
                f"{step}, but the coordinator already buffers {self._budget.used} bytes "
                f"(limit {self._budget.limit} bytes, --max-buffered-mb)",
                step=step,
                bucket_index=bucket,
            )
        if held is None:
            reduction = BucketReduction(
                self.participants(),
                wire_dtype,
                wire_bytes,
                self._chunk_bytes,
                self._divisor(),
                byte_range=byte_range,
                reply_dtype=reply_dtype,
            )
            held = self._buckets[bucket] = _Bucket(
                reduction, self._budget.reserve(self._membership.job_id), rank
            )
        try:
            averaged = held.reduction.add(rank, chunk.offset, payload)
        except DuplicateContributionError:
            raise RejectedMessage(
                Code.INVALID_ARGUMENT,
                f"rank {rank} sent the chunk at offset {chunk.offset} of bucket {bucket} "
                f"twice for step {step}",
                step=step,
                bucket_index=bucket,
            ) from None
        held.account()
        if self.progress is None:
            raise RuntimeError("a step accepts gradients only once the job is assembled")
        # A 16-bit bucket (and its range) is cut into fewer chunks than its native size says.
        chunks = held.reduction.chunks_total if wire_dtype != native else None
        lag = self.progress.record(rank, bucket, chunks)
        if lag is not None and self._metrics is not None:
            self._metrics.observe_bucket_arrival(rank, lag)
        return averaged

    def _check_offset(
        self,
        rank: int,
        chunk: ChunkHeader,
        length: int,
        wire_bytes: int,
        wire_dtype: int,
        byte_range: tuple[int, int],
    ) -> tuple[Code, str] | None:
        """Why the chunk's offset or length is not one this shard expects, or None."""
        what = f"bucket {chunk.bucket_index} of step {chunk.step}"
        container = f"bucket {chunk.bucket_index} as {dtypes.dtype_name(wire_dtype)}"
        if self.shard_count == 1:
            return check_chunk(
                what, chunk.offset, length, wire_bytes, container, self._chunk_bytes, rank
            )
        if byte_range[0] == byte_range[1]:
            return (
                Code.INVALID_ARGUMENT,
                f"rank {rank} sent {what} at offset {chunk.offset} to {self.shard_name}, which "
                f"holds no byte of it ({self._bucket_elements[chunk.bucket_index]} elements "
                f"cut into {self.shard_count} shards)",
            )
        return check_range_chunk(
            what,
            chunk.offset,
            length,
            byte_range,
            f"{container} ({wire_bytes} bytes)",
            self._chunk_bytes,
            rank,
            self.shard_name,
        )

    def _check_wire_dtype(self, rank: int, chunk: ChunkHeader, held: _Bucket | None) -> int:
        """The chunk's wire dtype, if allowed: the bucket's, or 16-bit for a wider float."""
        step, bucket = chunk.step, chunk.bucket_index
        native = self._bucket_dtypes[bucket]
        if chunk.dtype != native and not (
            chunk.dtype in COMPRESSED_WIRE and native in _COMPRESSIBLE
        ):
            allowed = dtypes.dtype_name(native)
            if native in _COMPRESSIBLE:
                allowed += " (or float16/bfloat16 from a comm hook)"
            raise RejectedMessage(
                Code.INVALID_ARGUMENT,
                f"rank {rank} sent bucket {bucket} of step {step} as "
                f"{dtypes.dtype_name(chunk.dtype)}, expected {allowed}",
                step=step,
                bucket_index=bucket,
            )
        if held is not None and chunk.dtype != held.reduction.dtype:
            raise RejectedMessage(
                Code.INVALID_ARGUMENT,
                f"rank {rank} sent bucket {bucket} of step {step} as "
                f"{dtypes.dtype_name(chunk.dtype)}, but rank {held.first_rank} sent it as "
                f"{dtypes.dtype_name(held.reduction.dtype)} (every rank must use the same "
                "comm hook)",
                step=step,
                bucket_index=bucket,
            )
        return chunk.dtype

    def _check_reply_dtype(
        self, rank: int, chunk: ChunkHeader, held: _Bucket | None, wire_dtype: int
    ) -> int:
        """The dtype the chunk asks its average back in, if allowed and the same as the others'."""
        step, bucket = chunk.step, chunk.bucket_index
        reply_dtype = reply_dtype_of(chunk.reply_dtype, wire_dtype)
        problem = reply_dtype_problem(reply_dtype, wire_dtype, self._bucket_dtypes[bucket])
        if problem is not None:
            raise RejectedMessage(
                Code.INVALID_ARGUMENT,
                f"rank {rank} sent bucket {bucket} of step {step} and {problem}",
                step=step,
                bucket_index=bucket,
            )
        # One reply serves every rank, so the first chunk's choice binds the others.
        if held is not None and reply_dtype != held.reduction.reply_dtype:
            raise RejectedMessage(
                Code.INVALID_ARGUMENT,
                f"rank {rank} asked for the average of bucket {bucket} of step {step} as "
                f"{dtypes.dtype_name(reply_dtype)}, but rank {held.first_rank} asked for "
                f"{dtypes.dtype_name(held.reduction.reply_dtype)} (every rank must use the "
                "same wire_answer_dtype)",
                step=step,
                bucket_index=bucket,
            )
        return reply_dtype

    def _averaged(self, bucket: int, offset: int, averaged: memoryview) -> list[Send]:
        """The averaged chunk for every live rank, encoded once (as pieces for a float32 reply)."""
        reduction = self._buckets[bucket].reduction
        participants = self.participants()
        return [
            Send(
                participants,
                encode_gradient(
                    ChunkHeader(
                        step=self.step,
                        membership_epoch=self._membership.epoch,
                        bucket_index=bucket,
                        offset=piece_offset,
                        dtype=reduction.reply_dtype,
                        contributors=reduction.last_contributors,
                    ),
                    piece,
                ),
            )
            for piece_offset, piece in reply_pieces(
                offset, averaged, reduction.dtype, reduction.reply_dtype, self._chunk_bytes
            )
        ]

    def _close_bucket_if_complete(self, bucket: int) -> list[Action]:
        """Once every chunk of `bucket` went out: count it, and close the step after the last.

        Called after the bucket's final averaged chunks were queued (never between
        two of them: a rank dropped under the elastic policy can complete several
        chunks at once, and closing the step frees the reductions they come from).
        """
        if not self._buckets[bucket].reduction.complete:
            return []
        self._buckets_done += 1
        if self._metrics is not None and self.progress is not None:
            reduction = self._buckets[bucket].reduction
            widening = dtypes.itemsize(reduction.reply_dtype) // dtypes.itemsize(reduction.dtype)
            sent = reduction.range_bytes * widening * len(self.participants())
            self._metrics.observe_bucket_done(self.progress.bucket_age(bucket), sent)
        if self._buckets_done != len(self._bucket_bytes):
            return []
        report = self._step_report()
        if self._metrics is not None and self.progress is not None:
            self._metrics.observe_step_done(self.progress.age(), self.step)
        self._advance()
        self.steps_completed += 1
        return report

    def _step_report(self) -> list[Action]:
        """The completed step's StepReport for the lowest participant (its step log)."""
        participants = self.participants()
        if not participants:
            return []
        slowest = self._metrics.lag_tracker.slowest(1) if self._metrics is not None else []
        rank, lag_s = slowest[0] if slowest and slowest[0][1] > 0 else (-1, 0.0)
        report = pb.StepReport(step=self.step, slowest_rank=rank, slowest_lag_s=lag_s)
        return [Send((min(participants),), pb.CoordinatorMessage(step_report=report))]

    # ------------------------------------------------------ membership changes
    def drop_rank(self, lost: int) -> list[Action]:
        """Elastic: finish what `lost` never contributed to over the live ranks."""
        actions: list[Action] = []
        step = self.step
        for bucket, held in list(self._buckets.items()):
            completed = held.reduction.drop_rank(lost)
            held.account()
            for offset, averaged in completed:
                actions += self._averaged(bucket, offset, averaged)
            if completed:
                actions += self._close_bucket_if_complete(bucket)
            if self.step != step:
                break  # the step completed over the live ranks
        return actions

    def run_out_of_inputs(self, rank: int) -> list[Action]:
        """`rank` ran out of inputs: finish what waits only for it, dividing by the membership."""
        self.out_of_inputs.add(rank)
        divisor = self._divisor()
        for held in self._buckets.values():
            held.reduction.divisor = divisor
        return self.drop_rank(rank)

    def add_rank(self, rank: int) -> None:
        """Elastic: a healed newcomer contributes to the open step from now on."""
        for held in self._buckets.values():
            held.reduction.add_rank(rank)

    # ------------------------------------------------------------------ ending
    def abort(self, culprit: int, rejection: RejectedMessage) -> list[Action]:
        """Abandon the open step: free its buffers and tell every rank why."""
        step = self.step
        self.remember_aborted(step)
        self._advance()
        others = tuple(r for r in self._membership.ranks() if r != culprit)
        actions: list[Action] = [
            abort_message(
                (culprit,),
                step,
                rejection.code,
                rejection.message,
                rejection.bucket_index,
                pb.ABORT_REASON_MESSAGE_REJECTED,
                culprit,
            )
        ]
        if others:
            actions.append(
                abort_message(
                    others,
                    step,
                    Code.ABORTED,
                    f"step {step} aborted because rank {culprit}'s message was rejected: "
                    f"{rejection.message}",
                    rejection.bucket_index,
                    pb.ABORT_REASON_PEER_MESSAGE_REJECTED,
                    culprit,
                )
            )
        return actions

    def drop_step(self) -> None:
        """Abandon the open step without telling anyone and start the next one.

        A coordinator shard follows its leader's abort this way: the leader
        already told every rank why (`abort` is the leader's version).
        """
        self._advance()

    def release(self) -> None:
        """Free every buffer of the open step; it will never complete (job broken or refused)."""
        for held in self._buckets.values():
            held.reservation.release()
        self._buckets.clear()
        if self.progress is not None:
            self.progress.reset()

    def _advance(self) -> None:
        self.release()
        self._buckets_done = self._empty_buckets
        self.step += 1
        self._start_epoch = self._membership.epoch

    def late_ranks(self) -> dict[int, list[int]]:
        """Ranks the open step waits for, with the buckets others already delivered."""
        if self.progress is None:
            return {}
        return self.progress.late_ranks(self.participants())
