"""Averaged gradients of each step as they arrive, written into the uploaded buckets (pure logic).

The coordinator answers every uploaded bucket with averaged chunks, possibly
while later buckets of the same step are still uploading. `StepResults`
scatters each chunk straight into the `BucketBuffer` that was submitted (the
gradients' own memory; for a 16-bit upload answered in float32, the bucket's
float32 buffer, submitted beside it), counts complete buckets per step, keeps a
`StepAborted` against its step, and says what is still missing when a wait
runs out. It holds no lock: `gradsync.control.inbox` calls it under its condition
variable, which is also what waiters sleep on.

The coordinator's byte counts are not trusted: every bucket's chunk grid is
known in advance (each shard's range chunked on its own grid, see
`gradsync.path.bucket_uploads.expected_chunks`), and a bucket completes only when
every expected chunk arrived, once. A chunk off the grid, of the wrong length
or arriving twice is a protocol fault: counting bytes alone let a duplicate
chunk stand in for a missing one, and the step "completed" with stale bytes in
the gradients.

An answer asked for in int8 (DiLoCo's compact answer, `gradsync.quantized_wire.Int8Answer`)
carries each chunk's scale in its header: the chunk must say int8, the scale
must be finite and >= 0, and it is kept in the bucket's buffer (`scales`) for
the dequantization. Any other answer carries no scale. A sparse int8 answer
(`ENCODING_TOPK2`, DiLoCo's sparse 2-bit wire) is decoded on arrival, on its
chunk's length of the grid, into the int8 levels and step it stands for, and
then lands like a dense one; a payload the rule refuses is a protocol fault.
"""

from __future__ import annotations

import dataclasses
import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from gradsync_proto import chunking, dtypes, sparse_wire
from gradsync_proto.codec import ChunkHeader
from gradsync_proto.codes import Code
from gradsync_proto.v1 import gradsync_pb2 as pb

from gradsync.errors import (
    MessageRejectedError,
    NonFiniteGradientError,
    PeerLostError,
    StepAbortedError,
)
from gradsync.path.bucket_uploads import expected_chunks
from gradsync.path.buffers import BucketBuffer

#: How many aborted steps are remembered to drop their late averages.
_ABORTED_STEPS_REMEMBERED = 64


@dataclass(frozen=True)
class RoundReport:
    """What the answers of one step said beyond the averages (DiLoCo's rounds)."""

    #: Ranks whose contributions made the average (0: this rank's was late).
    contributors: int = 0
    #: Late contributions merged in on top of them, and the stalest one's age in rounds.
    merged_late: int = 0
    staleness: int = 0
    #: Non-zero: the step's round closed without this rank (its upload was late); the
    #: answers are the current global parameters and the rank continues at this step.
    next_step: int = 0
    #: The coordinator's screen flagged this rank's contribution: what it said (else "").
    screened: str = ""
    #: Payload bytes of the step's answers as they arrived (a sparse answer's
    #: encoded bytes, not what it decodes to).
    payload_bytes: int = 0


@dataclass
class _StepResult:
    """Progress of one step: averaged bytes written back into each uploaded bucket."""

    buffers: dict[int, BucketBuffer] = field(default_factory=dict)
    #: Per bucket: {offset: length} of every chunk its averages come in.
    expected: dict[int, dict[int, int]] = field(default_factory=dict)
    #: Per bucket: the offsets of the averaged chunks written back so far.
    arrived: dict[int, set[int]] = field(default_factory=dict)
    #: Per bucket uploaded through the segment: its offset there (the averages land in place).
    segment_offsets: dict[int, int] = field(default_factory=dict)
    #: Per bucket: the dtype its answer was asked in.
    answer_dtypes: dict[int, int] = field(default_factory=dict)
    received: dict[int, int] = field(default_factory=dict)
    contributors: int = 0
    merged_late: int = 0
    staleness: int = 0
    next_step: int = 0
    screened: str = ""
    complete_buckets: int = 0
    aborted: pb.StepAborted | None = None
    payload_bytes: int = 0


class StepResults:
    """Where each step's averages go, and how far each step has come.

    Args:
        rank: this worker's rank (for error messages).
        on_averaged: called as (step, bucket_index) when a bucket's averages are
            complete; must be quick and must not raise.
    """

    def __init__(self, rank: int, on_averaged: Callable[[int, int], None] | None) -> None:
        self.rank = rank
        self._on_averaged = on_averaged
        self._results: dict[int, _StepResult] = {}
        self.bucket_bytes: list[int] = []
        #: The chunk grid averages come on (the Welcome's chunk size and shard count).
        self.chunk_bytes = chunking.DEFAULT_CHUNK_BYTES
        self.shard_count = 1
        #: Recently aborted steps: a shard that had not yet heard of an abort may
        #: still average a range of it and send that after the step was taken.
        self._aborted: deque[int] = deque(maxlen=_ABORTED_STEPS_REMEMBERED)
        #: What the answers of the step taken last said.
        self.last_report = RoundReport()

    def expect(
        self,
        step: int,
        bucket_index: int,
        buffer: BucketBuffer,
        dtype: int,
        segment_offset: int | None = None,
    ) -> None:
        """Register where the averages of an uploaded bucket are to be written.

        Args:
            buffer: the uploaded buffer, or where averages that come back in
                another dtype than the upload's go (a float32 answer to a 16-bit
                upload: twice the bytes, on the grid of its own ranges).
            dtype: the dtype the averages come back in (where the shards' ranges
                are cut depends on its element size).
            segment_offset: the bucket was uploaded from the segment the
                coordinator holds, from this offset (same-host payload path): an
                average may come back written there, in a header-only chunk.
        """
        result = self._ensure(step)
        result.buffers[bucket_index] = buffer
        result.expected[bucket_index] = expected_chunks(
            buffer.size, dtype, self.shard_count, self.chunk_bytes
        )
        result.arrived[bucket_index] = set()
        result.answer_dtypes[bucket_index] = dtype
        if segment_offset is None:
            result.segment_offsets.pop(bucket_index, None)
        else:
            result.segment_offsets[bucket_index] = segment_offset

    def watch(self, step: int) -> None:
        """Start tracking `step` (a wait on it may begin before any bucket was uploaded).

        Older steps that nothing was uploaded for are forgotten: a local
        follower (hierarchical aggregation) polls every step for an abort and
        never takes one that completes.
        """
        for old in [
            s for s, r in self._results.items() if s < step and not r.buffers and r.aborted is None
        ]:
            del self._results[old]
        self._ensure(step)

    def is_ready(self, step: int) -> bool:
        """True once every bucket of `step` is averaged, or the step was aborted."""
        result = self._results.get(step)
        if result is None:
            return False
        return result.aborted is not None or result.complete_buckets == len(self.bucket_bytes)

    def take(self, step: int) -> int:
        """Forget `step` (and older steps); return how many ranks were averaged over.

        Raises:
            StepAbortedError (or a subclass): the coordinator abandoned the step.
        """
        result = self._results.pop(step)
        for old in [s for s in self._results if s < step]:
            del self._results[old]
        if result.aborted is not None:
            raise abort_error(result.aborted, self.rank)
        fields = dataclasses.fields(RoundReport)
        self.last_report = RoundReport(**{f.name: getattr(result, f.name) for f in fields})
        return result.contributors

    def on_aborted(self, aborted: pb.StepAborted) -> None:
        """Record that the coordinator abandoned a step."""
        self._ensure(aborted.step).aborted = aborted
        self._aborted.append(aborted.step)

    def was_aborted(self, step: int) -> bool:
        """True if the coordinator said `step` is abandoned (among the recent ones)."""
        return step in self._aborted

    def on_gradient(self, chunk: ChunkHeader, payload: memoryview) -> str | None:
        """Write one averaged chunk into its bucket.

        Returns:
            None, or what is wrong with the chunk (the stream is then not to be trusted).
        """
        if chunk.step in self._aborted:
            # Late: a shard averaged its range of a step the leader aborted before the
            # abort reached it (control and data travel apart). Nothing is written.
            return None
        result = self._ensure(chunk.step)
        bucket = chunk.bucket_index
        buffer = result.buffers.get(bucket)
        if buffer is None:
            return (
                f"averaged bucket {bucket} of step {chunk.step} arrived before this rank "
                "uploaded it"
            )
        arrived_bytes = len(payload)
        if chunk.encoding == pb.ENCODING_TOPK2:  # a sparse answer: its int8 levels and step
            decoded = _sparse_answer(chunk, payload, result, bucket)
            if isinstance(decoded, str):
                return decoded
            payload = memoryview(decoded.q.tobytes())
            chunk = dataclasses.replace(chunk, scale=decoded.step)
        elif chunk.encoding != pb.ENCODING_RAW:
            return (
                f"averaged chunk of bucket {bucket} of step {chunk.step} has encoding "
                f"{chunk.encoding}; only raw (0) and sparse (1) answers exist"
            )
        length = len(payload)
        if chunk.in_segment:
            problem = _segment_problem(chunk, length, result.segment_offsets.get(bucket))
            if problem is not None:
                return problem
            # Already in place: the coordinator wrote it where the upload came from.
            length = result.expected[bucket].get(chunk.offset, 0)
        problem = _check_chunk(chunk, length, result.expected[bucket], result.arrived[bucket])
        if problem is None:
            problem = _scale_problem(chunk, result.answer_dtypes[bucket])
        if problem is not None:
            return problem
        if chunk.next_step and chunk.next_step <= chunk.step:
            return (
                f"averaged chunk of bucket {bucket} of step {chunk.step} says the round closed "
                f"without this rank and to continue at step {chunk.next_step}, not after it"
            )
        if not chunk.in_segment:
            buffer.write(chunk.offset, payload)
        if result.answer_dtypes[bucket] == pb.DTYPE_INT8:
            buffer.scales[chunk.offset] = chunk.scale
        arrived = result.arrived[bucket]
        arrived.add(chunk.offset)
        result.received[bucket] = result.received.get(bucket, 0) + length
        result.payload_bytes += arrived_bytes
        result.contributors = (
            min(result.contributors, chunk.contributors)
            if result.contributors
            else chunk.contributors
        )
        if self.rank in chunk.screened_ranks and not result.screened:
            result.screened = chunk.screen_note
        result.merged_late = max(result.merged_late, chunk.merged_late)
        result.staleness = max(result.staleness, chunk.staleness)
        # The open step moves on while a late upload is answered: its last word counts.
        result.next_step = max(result.next_step, chunk.next_step)
        if len(arrived) == len(result.expected[bucket]):
            result.complete_buckets += 1
            if self._on_averaged is not None:
                self._on_averaged(chunk.step, bucket)
        return None

    def describe_missing(self, step: int) -> str:
        """Which buckets of `step` are incomplete, for a timeout's message."""
        result = self._results.get(step)
        if result is None:
            return "no results arrived"
        missing = [
            f"bucket {index} ({result.received.get(index, 0)}/{size} bytes)"
            for index, size in enumerate(self.bucket_bytes)
            if result.received.get(index, 0) < size
        ]
        return "still waiting for " + ", ".join(missing)

    def _ensure(self, step: int) -> _StepResult:
        result = self._results.get(step)
        if result is None:
            result = self._results[step] = _StepResult()
        return result


def _check_chunk(
    chunk: ChunkHeader, length: int, expected: dict[int, int], arrived: set[int]
) -> str | None:
    """What is wrong with an averaged chunk's place in its bucket's grid, or None."""
    where = f"averaged chunk of bucket {chunk.bucket_index} of step {chunk.step}"
    wanted = expected.get(chunk.offset)
    if wanted is None:
        nearest = max((o for o in expected if o < chunk.offset), default=min(expected, default=0))
        return (
            f"{where} at offset {chunk.offset} is not on the bucket's chunk grid "
            f"(expected a chunk at offset {nearest}, {len(expected)} chunks in all)"
        )
    if length != wanted:
        return f"{where} at offset {chunk.offset} has {length} bytes, expected {wanted}"
    if chunk.offset in arrived:
        return (
            f"{where} at offset {chunk.offset} arrived twice "
            f"({length} bytes, {len(arrived)} of {len(expected)} chunks received)"
        )
    return None


def _sparse_answer(
    chunk: ChunkHeader, payload: memoryview, result: _StepResult, bucket: int
) -> sparse_wire.SparseChunk | str:
    """A sparse answer decoded on its chunk's grid length, or what is wrong with it."""
    where = f"averaged chunk of bucket {bucket} of step {chunk.step} at offset {chunk.offset}"
    if result.answer_dtypes[bucket] != pb.DTYPE_INT8 or chunk.in_segment or chunk.scale != 0:
        return (
            f"{where} is sparse, but it was asked for as "
            f"{dtypes.dtype_name(result.answer_dtypes[bucket])} (a sparse answer is int8, "
            f"travels in the message and has no header scale, got {chunk.scale!r})"
        )
    elements = result.expected[bucket].get(chunk.offset)
    if elements is None:
        return f"{where} is not on the bucket's chunk grid"
    try:
        return sparse_wire.decode(payload, elements)
    except sparse_wire.SparseWireError as error:
        return f"{where}: {error}"


def _scale_problem(chunk: ChunkHeader, asked: int) -> str | None:
    """What is wrong with an answer's dtype and scale, or None (see the module docstring)."""
    where = (
        f"averaged chunk of bucket {chunk.bucket_index} of step {chunk.step} "
        f"at offset {chunk.offset}"
    )
    if asked != pb.DTYPE_INT8:
        if chunk.scale != 0:  # NaN included
            return f"{where} carries a scale ({chunk.scale!r}), but only an int8 answer has one"
        return None
    if chunk.dtype != pb.DTYPE_INT8:
        return f"{where} is {dtypes.dtype_name(chunk.dtype)}, but it was asked for as int8"
    if not (math.isfinite(chunk.scale) and chunk.scale >= 0):
        return (
            f"{where} has the int8 scale {chunk.scale!r}; a scale must be finite and >= 0 "
            "(a non-finite one means the global parameters are no longer finite)"
        )
    return None


def _segment_problem(chunk: ChunkHeader, length: int, base: int | None) -> str | None:
    """What is wrong with an average said to be written into the segment, or None.

    It must answer a chunk this rank uploaded through the segment, at the very
    place that chunk came from, and carry no payload.
    """
    where = f"averaged chunk of bucket {chunk.bucket_index} of step {chunk.step}"
    if base is None:
        return f"{where} says it was written into the segment, but was not uploaded from there"
    if chunk.segment_offset != base + chunk.offset or length:
        return (
            f"{where} at offset {chunk.offset} says it was written at segment offset "
            f"{chunk.segment_offset} with {length} payload bytes; its upload came from "
            f"{base + chunk.offset} and such a chunk carries none"
        )
    return None


def abort_error(aborted: pb.StepAborted, rank: int) -> StepAbortedError:
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
    shown = code.name if code else aborted.code
    what = f"step {aborted.step} was aborted by the coordinator ({shown})"
    context = {"rank": rank, "step": aborted.step, "bucket_index": aborted.bucket_index}
    if aborted.reason == pb.ABORT_REASON_NONFINITE:
        return NonFiniteGradientError(
            f"{what} because rank {aborted.culprit_rank} sent non-finite gradients: "
            f"{aborted.message}",
            code=code,
            culprit_rank=aborted.culprit_rank,
            **context,
        )
    return cls(f"{what}: {aborted.message}", code=code, **context)
