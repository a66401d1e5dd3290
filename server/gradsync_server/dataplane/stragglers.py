"""DiLoCo stragglers in the open step: weights, merged late contributions, late answers, closing.

The open step (`open_step`) calls these at four points; the policy itself is
`rounds` (when a round may close, what a weight may be) and `late` (what a
late contribution becomes). Kept apart so that the synchronized step reads as
it always did, and a job without partial rounds or weights runs exactly the
code it ran before: every function here returns at once for it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from gradsync_proto import chunking, dtypes
from gradsync_proto.codec import ChunkHeader
from gradsync_proto.codes import Code

from gradsync_server.dataplane.accumulators import from_accumulator, to_accumulator
from gradsync_server.dataplane.actions import Action
from gradsync_server.dataplane.aggregation import BucketReduction, Magnitude, examine
from gradsync_server.dataplane.late import LATE_RANK_BASE
from gradsync_server.dataplane.rounds import check_weight
from gradsync_server.dataplane.wire_replies import answer_sends
from gradsync_server.errors import RejectedMessage

if TYPE_CHECKING:
    from gradsync_server.dataplane.open_step import OpenStep

__all__ = ["answer_late", "close_round_if_due", "merge_late", "weight_of"]


def weight_of(step: OpenStep, rank: int, chunk: ChunkHeader) -> float | None:
    """The checked weight of `rank`'s chunk in the open round (None: summed unweighted).

    Raises:
        RejectedMessage: a weight in an unweighted job, or a bad or changing one.
    """
    bucket, stragglers = chunk.bucket_index, step.stragglers
    if not step.outer.holds(bucket):
        return None  # the presence vector is not a pseudo-gradient: never weighted
    weighted = stragglers.policy.weighted
    earlier, seen_at = stragglers.weights.get(rank, (None, ""))
    weight = check_weight(rank, chunk, weighted, earlier, seen_at)
    stragglers.weights.setdefault(rank, (weight, f"bucket {bucket} at offset {chunk.offset}"))
    # The seed round averages identical parameters: weighing them would only round them.
    return weight if weighted and step.outer.seeded else None


def merge_late(step: OpenStep, bucket: int, reduction: BucketReduction) -> tuple[int, int]:
    """Add the late contributions the open round merges into `bucket`'s new reduction.

    Each is summed as rank LATE_RANK_BASE + r, after every live rank.

    Returns:
        (how many were merged, the largest staleness among them in rounds).
    """
    stragglers = step.stragglers
    if not stragglers.merging or not step.outer.holds(bucket):
        return 0, 0
    weighted = stragglers.policy.weighted
    chosen = []
    for late in stragglers.merging:
        kept = [(o, entry) for (b, o), entry in late.kept.items() if b == bucket]
        if kept and all(wire == reduction.dtype for _, (wire, _, _) in kept):
            chosen.append((late, kept))
            reduction.add_rank(LATE_RANK_BASE + late.rank)
    for late, kept in chosen:
        for offset, (_, payload, magnitude) in kept:
            weight = late.weight if weighted else None
            reduction.add(LATE_RANK_BASE + late.rank, offset, payload, magnitude, 1, weight)
    staleness = max((step.step - late.step for late, _ in chosen), default=0)
    return len(chosen), staleness


def answer_late(step: OpenStep, rank: int, chunk: ChunkHeader, payload: memoryview) -> list[Action]:
    """A chunk of `rank` for a round that closed without it: keep or drop it, answer at once.

    The answer is the current global parameters of the chunk (the echo of the
    rank's own upload, for a bucket that holds none), with `next_step` the open
    step, where the rank continues.

    Raises:
        RejectedMessage: the chunk does not fit the layout, repeats one, or its weight is bad.
    """
    stragglers, layout, bucket = step.stragglers, step.layout, chunk.bucket_index
    where = f"rank {rank} sent bucket {bucket} at offset {chunk.offset} of late round {chunk.step}"
    if bucket >= layout.count:
        raise RejectedMessage(
            Code.INVALID_ARGUMENT,
            f"{where}, but the model has {layout.count} buckets",
            step=chunk.step,
            bucket_index=bucket,
        )
    if chunk.membership_epoch > step.membership.epoch or chunk.covered_ranks:
        raise RejectedMessage(
            Code.FAILED_PRECONDITION,
            f"{where} in membership epoch {chunk.membership_epoch} covering ranks "
            f"{list(chunk.covered_ranks)}; the coordinator is at epoch {step.membership.epoch} "
            "and late rounds carry one rank's own contribution",
            step=chunk.step,
            bucket_index=bucket,
        )
    outer = step.outer.holds(bucket)
    reply_check = step.outer.check_reply if outer else None
    checked = layout.check(rank, chunk, payload, None, -1, reply_check, step.budget)
    late = stragglers.late_upload(rank, chunk.step)
    if outer:
        earlier = f"first chunk of late round {late.step}"
        weighted = stragglers.policy.weighted
        late.weight = check_weight(rank, chunk, weighted, late.weight or None, earlier)
    lo, hi = checked.byte_range
    late.chunks_needed[bucket] = chunking.num_chunks(hi - lo, layout.chunk_bytes)
    seen = late.seen.setdefault(bucket, set())
    if chunk.offset in seen:
        raise RejectedMessage(
            Code.INVALID_ARGUMENT,
            f"{where} twice",
            step=chunk.step,
            bucket_index=bucket,
        )
    seen.add(chunk.offset)
    if outer and stragglers.policy.merge_late:
        contribution, magnitude = examine(checked.payload, checked.payload_dtype)
        if magnitude is Magnitude.NONFINITE:  # reported, or the open step aborted ("abort")
            step.nonfinite.check(rank, chunk, contribution, checked.payload_dtype)
        if late.reservation is None:
            late.reservation = step.budget.reserve(step.membership.job_id)
        late.kept[(bucket, chunk.offset)] = (checked.wire_dtype, bytes(contribution), magnitude)
        late.reservation.hold(late.held_bytes())
    elements = len(checked.payload) // dtypes.itemsize(checked.payload_dtype)
    if outer:
        answer = step.outer.current(bucket, chunk.offset, checked.wire_dtype, elements)
    else:
        values = to_accumulator(checked.payload, checked.payload_dtype)
        answer = from_accumulator(values, checked.reply_dtype)
    header = ChunkHeader(
        step=chunk.step,
        membership_epoch=step.membership.epoch,
        bucket_index=bucket,
        offset=chunk.offset,
        dtype=checked.reply_dtype,
        next_step=step.step,
    )
    # Always as a message (not through a same-host segment): one rank, rarely.
    sends = answer_sends(header, answer, checked.wire_dtype, layout.chunk_bytes, (rank,), ())
    if late.complete(layout.count):
        stragglers.finish_upload(rank)
    return list(sends)


def close_round_if_due(step: OpenStep) -> list[Action]:
    """Close the open round without the ranks that sent nothing, if the policy says so now.

    Called after every accepted chunk and from the coordinator's watchdog (the
    deadline passes while nothing arrives). The round completes at once (every
    rank that began uploading has finished: `RoundPolicy.may_close`).
    """
    stragglers, progress = step.stragglers, step.progress
    if not stragglers.policy.partial or progress is None or not step.outer.seeded:
        return []
    participants = step.participants()
    age = None if progress.started_at is None else progress.age()
    complete = [r for r in participants if progress.delivered_all(r)]
    started = [r for r in participants if progress.delivered_any(r)]
    excused = stragglers.policy.may_close(age, participants, complete, started)
    if not excused:
        return []
    for rank in excused:
        stragglers.excuse(rank, step.step)
    actions: list[Action] = []
    for rank in excused:  # the last one completes the round (after it, the step moved on)
        actions += step.drop_rank(rank)
    return actions
