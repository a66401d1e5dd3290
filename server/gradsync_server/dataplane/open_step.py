"""The one step a job has in flight: its reductions, its progress and how it ends.

Steps are lock-step: ranks start step s + 1 only after receiving every
averaged bucket of step s, so exactly one step per job is open. This module
owns it: it validates each gradient chunk against the step (number, epoch,
bucket, dtype, offset, length, the byte budget; the rules are in
`chunk_checks`), folds it into the bucket's `BucketReduction`, hands back the
averaged chunks the moment they complete (architecture invariant 4), and
frees the step's memory whether it completes, is aborted for everyone, or
loses a rank under the elastic policy. Every byte it buffers is held through
a `Reservation` of the coordinator's `ByteBudget`.

Two refinements of "every member contributes, divide by the contributions":
a rank that ran out of inputs (DDP's `join()`, `out_of_inputs`) is not
expected, yet averages keep dividing by the membership's size; and a comm
hook may send a float32/float64 bucket as float16/bfloat16 (every rank the
same per step and bucket), accumulated in float32 and answered in the same
16-bit type (or float32), or DiLoCo a float32 one as int8 with a scale per
chunk, dequantized on arrival (`chunk_checks`), answered in float32 (or `outer_answer`).

With local groups (`host_groups`) only unit leaders upload and receive
averages; a leader's chunk weighs its (checked) `covered_ranks`, and counts
as every covered rank's arrival, so followers never look late.

Every contribution is classified as it arrives (`aggregation.examine`): one
holding NaN or Inf is handled by the coordinator's `--nonfinite` policy
(`gradsync_server.dataplane.nonfinite`: reported and summed, or the step aborted for
every rank, or allowed silently), and one large enough to overflow a float32
sum is summed with a float64 shadow. Pure logic, no gRPC, no asyncio.

DiLoCo's stragglers live here too, at four points of the step: a chunk's
weight is checked as it is folded, a bucket's reduction opens with the late
contributions the round merges, a chunk for a round that closed without its
rank is answered at once, and a round closes without the ranks that sent
nothing once its policy allows. The policy itself is `rounds` (when a round
may close, what a weight may be) and `late` (what a late contribution
becomes); a job without partial rounds or weights returns from each at once.

A sharded coordinator runs one `OpenStep` per shard over the same membership
rules: shard i of S holds byte range i of every bucket (in wire bytes,
`chunking.shard_byte_range`) and expects exactly that range's chunks
(`chunking.range_chunk_spans`). A bucket whose range is empty at this shard
(fewer elements than shards) counts as complete from the step's start. With
one shard the range is the whole bucket and everything is as unsharded.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from gradsync_proto import chunking, dtypes
from gradsync_proto.codec import ChunkHeader
from gradsync_proto.codes import Code
from gradsync_proto.v1 import gradsync_pb2 as pb

from gradsync_server import defaults
from gradsync_server.dataplane import grace
from gradsync_server.dataplane.accumulators import from_accumulator, to_accumulator
from gradsync_server.dataplane.actions import Action, Send
from gradsync_server.dataplane.aggregation import (
    BucketReduction,
    DuplicateContributionError,
    Magnitude,
    count_nonfinite,
    examine,
    measured_examine,
)
from gradsync_server.dataplane.budget import ByteBudget, OwnerBudget, Reservation
from gradsync_server.dataplane.chunk_checks import BucketLayout, CheckedChunk, check_sender, refused
from gradsync_server.dataplane.contribution_screen import ContributionScreen, ScreenObserver
from gradsync_server.dataplane.host_groups import LocalGroups, check_covers
from gradsync_server.dataplane.late import LATE_RANK_BASE, Stragglers
from gradsync_server.dataplane.nonfinite import NonFiniteContribution, NonFiniteGuard
from gradsync_server.dataplane.observer import ReportSchedule, StepObserver
from gradsync_server.dataplane.outer import OuterState
from gradsync_server.dataplane.progress import StepProgress
from gradsync_server.dataplane.rounds import RoundPolicy, check_weight
from gradsync_server.dataplane.screening import (
    ChunkVerdict,
    Floats,
    ScreenPolicy,
    ScreenThresholds,
    check_screen,
    merge,
)
from gradsync_server.dataplane.step_aborts import abort_actions
from gradsync_server.dataplane.wire_replies import answer_sends
from gradsync_server.errors import RejectedMessage

__all__ = ["MembershipView", "OpenStep", "PlaneMember"]

#: Aborted step numbers remembered so that late chunks for them are dropped
#: quietly instead of being reported as stale.
_ABORTED_STEPS_REMEMBERED = 64


@dataclass(frozen=True)
class PlaneMember:
    """A member as the data plane knows it: its rank, incarnation, and the session that
    admits its data stream (the incarnation is public: Status shows it; the session is not)."""

    rank: int
    incarnation: str
    session: bytes = field(default=b"", repr=False)


@dataclass
class MembershipView:
    """The membership of one job as the control plane last announced it (what `OpenStep`
    reads; the `JobPlane` of `gradsync_server.dataplane.plane` keeps it, at the leader
    and at every shard alike)."""

    job_id: str
    epoch: int = 0
    members: dict[int, PlaneMember] = field(default_factory=dict)
    #: The control plane's local groups: the same units at every process.
    groups: LocalGroups = field(default_factory=LocalGroups)

    def ranks(self) -> tuple[int, ...]:
        """Members of the current epoch, ascending."""
        return tuple(sorted(self.members))


@dataclass
class _Bucket:
    """One bucket's reduction, the budget it holds, and who set its wire and reply dtypes."""

    reduction: BucketReduction
    reservation: Reservation
    first_rank: int
    #: Late contributions (DiLoCo stragglers) summed in, and the stalest one's age.
    merged: int = 0
    staleness: int = 0

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
        nonfinite: the `--nonfinite` policy: "report", "abort" or "allow".
        shard_name: how errors name this process's range (default "shard <index>").
        on_nonfinite: called with each newly counted non-finite contribution (a
            shard forwards them to its leader); None = nobody.

    Raises:
        ValueError: `shard_index` is not in 0..shard_count - 1, or an unknown policy.
    """

    def __init__(
        self,
        membership: MembershipView,
        chunk_bytes: int,
        budget: ByteBudget | OwnerBudget,
        clock: Callable[[], float],
        metrics: StepObserver | None,
        shard_index: int = 0,
        shard_count: int = 1,
        nonfinite: str = defaults.NONFINITE,
        shard_name: str | None = None,
        on_nonfinite: Callable[[NonFiniteContribution], None] | None = None,
    ) -> None:
        if not 0 <= shard_index < shard_count:
            raise ValueError(f"shard index {shard_index} is not in 0..{shard_count - 1}")
        self.shard_index = shard_index
        self.shard_count = shard_count
        #: How errors name this shard ("shard 2 at 10.0.0.5:50051" in a shard process).
        self.shard_name = shard_name or f"shard {shard_index}"
        #: The --nonfinite policy applied to this step's contributions (count, last, log).
        self.nonfinite = NonFiniteGuard(
            membership.job_id, nonfinite, clock, metrics, shard_index, self.shard_name, on_nonfinite
        )
        #: The job's membership the step runs over.
        self.membership = membership
        self._chunk_bytes = chunk_bytes
        #: The coordinator-wide cap on buffered bytes the step holds its buffers in.
        self.budget = budget
        self._clock = clock
        self._metrics = metrics
        #: Which completed steps tell the lowest rank who was slowest.
        self._reports = ReportSchedule()
        #: The step number in flight.
        self.step = 0
        #: Steps whose every bucket was averaged.
        self.steps_completed = 0
        #: None until the job is assembled (the bucket layout is known).
        self.progress: StepProgress | None = None
        #: (bucket, offset, rank) of the open step's uploads read from a same-host segment.
        self._segment_uploads: set[tuple[int, int, int]] = set()
        self._start_epoch = 0
        #: Every bucket's shape, this shard's range of it, and the checks of a chunk's place.
        self.layout = BucketLayout(chunk_bytes, shard_index, shard_count, self.shard_name)
        #: Buckets of which this shard holds no byte: complete from the start.
        self._empty_buckets = 0
        self._buckets: dict[int, _Bucket] = {}
        self._buckets_done = 0
        self._aborted: deque[int] = deque(maxlen=_ABORTED_STEPS_REMEMBERED)
        #: Ranks that ran out of inputs (join()): not expected in reductions.
        self.out_of_inputs: set[int] = set()
        #: The members when the open step began (what a leader's chunk may cover).
        self._open_members: frozenset[int] = frozenset()
        #: Low-communication training: the global parameters and outer optimizer (if any).
        self.outer = OuterState()
        #: DiLoCo's partial rounds, late contributions and weights (`dataplane.rounds`).
        self.stragglers = Stragglers()
        #: The job's screen (None: not assembled), under the policy its view carries.
        self.screen: ContributionScreen | None = None
        #: A per-step job's screen (not DiLoCo's outer rounds).
        self._step_screen = False
        self._verdicts: dict[tuple[int, int], ChunkVerdict] = {}

    def participants(self) -> tuple[int, ...]:
        """Members expected in the open step's reductions, ascending."""
        skip = self.out_of_inputs | self.stragglers.excused
        return tuple(r for r in self.membership.ranks() if r not in skip)

    def units(self) -> tuple[int, ...]:
        """The participants that upload and receive averages: flat ranks and group leaders."""
        return self.membership.groups.units(self.participants())

    def _divisor(self) -> int | None:
        """While some ranks ran out of inputs, averages divide by the membership's size."""
        return len(self.membership.members) if self.out_of_inputs else None

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
        spans = self.layout.configure(signature)
        self.progress = StepProgress(
            [chunking.num_chunks(hi - lo, self._chunk_bytes) for lo, hi in spans], self._clock
        )
        outer = signature.outer if signature.HasField("outer") else None
        self.outer = OuterState(outer, signature.buckets, self.shard_count, self.shard_index)
        self.stragglers.release()
        self.stragglers = Stragglers(RoundPolicy.of(outer))
        self.screen = None
        self._step_screen = outer is None and bool(signature.buckets)
        if outer is not None or self._step_screen:
            policy = check_screen(outer.screen if outer is not None else signature.screen)
            observer = self._metrics if isinstance(self._metrics, ScreenObserver) else None
            self.screen = ContributionScreen(
                self.membership.job_id, policy, ScreenThresholds(), observer
            )
        self._empty_buckets = sum(1 for lo, hi in spans if lo == hi)
        self._buckets_done = self._empty_buckets
        self.step = step
        self._open_members = frozenset(self.membership.ranks())

    def byte_range(self, bucket: int, wire_dtype: int) -> tuple[int, int]:
        """Bytes [lo, hi) of `bucket`, sent as `wire_dtype`, that this shard aggregates."""
        return self.layout.byte_range(bucket, wire_dtype)

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
        if chunk.step < self.step and self.stragglers.owes(rank, chunk.step):
            return self._answer_late(rank, chunk, payload)
        averaged = self._fold(rank, chunk, payload)
        actions: list[Action] = []
        if averaged is not None:
            bucket = chunk.bucket_index
            actions += self._averaged(bucket, chunk.offset, averaged)
            actions += self._close_bucket_if_complete(bucket)
        return actions + self.close_round_if_due()

    def _fold(self, rank: int, chunk: ChunkHeader, payload: memoryview) -> memoryview | None:
        step, bucket = chunk.step, chunk.bucket_index
        check_sender(
            rank,
            chunk,
            job_id=self.membership.job_id,
            members=self.membership.members,
            epochs=(self._start_epoch, self.membership.epoch),
            open_step=self.step,
            bucket_count=self.layout.count,
            out_of_inputs=self.out_of_inputs,
        )
        # Only the leader (shard 0: a range of every bucket) knows whom each step began with.
        open_members = self._open_members if self.shard_index == 0 else None
        weight = check_covers(rank, chunk, self.membership.groups, open_members)
        held = self._buckets.get(bucket)
        checked = self.layout.check(
            rank,
            chunk,
            payload,
            None if held is None else held.reduction,
            -1 if held is None else held.first_rank,
            self.outer.check_reply if self.outer.holds(bucket) else None,
            self.budget,
        )
        sample_weight = self._weight_of(rank, chunk)
        contribution, magnitude, square = measured_examine(checked.payload, checked.payload_dtype)
        if magnitude is Magnitude.NONFINITE:
            # Raises under "abort".
            self.nonfinite.check(rank, chunk, contribution, checked.payload_dtype)
        if self.screen is not None and self._notes(bucket) and not math.isnan(square):
            nonfinite = magnitude is Magnitude.NONFINITE  # (counted on that rare path only)
            bad = count_nonfinite(contribution, checked.payload_dtype) if nonfinite else 0
            self.screen.note((bucket, chunk.offset), rank, square, bad)
        if not self.stragglers.begun:  # the round's first chunk: what it merges
            self.stragglers.begin(step, self.membership.members, self.layout.count)
        if held is None:
            held = self._open_bucket(bucket, checked, rank)
        try:
            averaged = held.reduction.add(
                rank, chunk.offset, contribution, magnitude, weight, sample_weight
            )
        except DuplicateContributionError:
            raise refused(
                chunk,
                f"rank {rank} sent the chunk at offset {chunk.offset} of bucket {bucket} "
                f"twice for step {step}",
            ) from None
        held.account()
        if chunk.in_segment:
            self._segment_uploads.add((bucket, chunk.offset, rank))
        if self.progress is None:
            raise RuntimeError("a step accepts gradients only once the job is assembled")
        # A 16-bit bucket (and its range) is cut into fewer chunks than its native size says.
        native = self.layout.bucket_dtypes[bucket]
        chunks = held.reduction.chunks_total if checked.wire_dtype != native else None
        # A leader's chunk is every covered rank's arrival: its followers are not late.
        window = self.stragglers.window
        for arrived in chunk.covered_ranks or (rank,):
            lag = self.progress.record(arrived, bucket, chunks)
            if lag is not None and self._metrics is not None:
                self._metrics.observe_bucket_arrival(arrived, lag)
            if lag is not None and window is not None and self.progress.delivered_all(arrived):
                window.arrived(arrived, self.progress.age())
        return averaged

    def _open_bucket(self, bucket: int, checked: CheckedChunk, rank: int) -> _Bucket:
        """Start `bucket`'s reduction in the open step (with the late contributions it merges)."""
        reduction = BucketReduction(
            self.units(),
            checked.wire_dtype,
            checked.wire_bytes,
            self._chunk_bytes,
            self._divisor(),
            byte_range=checked.byte_range,
            reply_dtype=checked.reply_dtype,
            average_dtype=pb.DTYPE_FLOAT32 if self.outer.holds(bucket) else None,
        )
        held = self._buckets[bucket] = _Bucket(
            reduction, self.budget.reserve(self.membership.job_id), rank
        )
        held.merged, held.staleness = self._merge_late(bucket, reduction)
        # Each rank's own unweighted pseudo-gradient (`screening.screen_problem`), once seeded.
        policy, screen = self.stragglers.policy, self.screen
        flat = not self.membership.groups.groups() and not policy.weighted
        held_policy = not policy.merge_late and not self._notes(bucket)
        if screen is not None and self._screens(bucket) and flat and held_policy:
            reduction.screened_merge = lambda offset, rows: self._screened_merge(
                bucket, offset, rows
            )
            reduction.screen_tame_only = screen.policy is ScreenPolicy.REPORT
        held.account()
        return held

    def _screens(self, bucket: int) -> bool:
        """True if `bucket`'s contributions are screened now: a DiLoCo outer round, or
        a per-step job with flat ranks."""
        if self.screen is None:
            return False
        if self._step_screen:
            return not self.membership.groups.groups()
        return self.outer.holds(bucket) and self.outer.seeded and not self.outer.replaying

    def _notes(self, bucket: int) -> bool:
        """True if `bucket`'s contributions are measured as they are folded, held by nobody
        (a per-step job under "report": norm and non-finite values only)."""
        screen = self.screen
        return (
            self._step_screen
            and screen is not None
            and screen.policy is ScreenPolicy.REPORT
            and self._screens(bucket)
        )

    def _screened_merge(
        self, bucket: int, offset: int, rows: list[tuple[int, Floats]]
    ) -> tuple[Floats, float, int]:
        """A complete chunk's merge under the job's screen (`BucketReduction.screened_merge`).

        While ranks are out of inputs (DDP's `join()`), they count as zeros, as their
        divisor says: a robust merge of the others is scaled by their share.
        """
        if self.screen is None:
            raise RuntimeError("a screened merge without a screen")
        key = (bucket, offset)
        verdict = self._verdicts[key] = self.screen.verdict(self.step, key, rows)
        policy = self.screen.policy
        total, divisor = merge(policy, self.screen.thresholds, rows, verdict)
        members = len(self.membership.members)
        if self.out_of_inputs and members > len(rows):
            if policy in (ScreenPolicy.TRIMMED_MEAN, ScreenPolicy.MEDIAN):
                return total, divisor * members / len(rows), len(rows)
            return total, divisor + members - len(rows), len(rows) - len(verdict.excluded)
        return total, divisor, len(rows) - len(verdict.excluded)

    def _screen_note(self, bucket: int, offset: int) -> tuple[tuple[int, ...], str]:
        """The screened ranks and note of a complete chunk's answer."""
        verdict = self._verdicts.pop((bucket, offset), None)
        if verdict is None and self.screen is not None and self._notes(bucket):
            verdict = self.screen.noted_verdict(self.step, (bucket, offset))
        if self.screen is None or verdict is None:
            return (), ""
        return self.screen.header_fields(verdict)

    def record_posted(self, rank: int, bucket: int) -> None:
        """A local group's member has `bucket` in shared memory (`LocalPosted`): its
        delivery, so that the lag metric, the stall warning and status cover every
        member of a group, not only the leader that uploads for it."""
        if self.progress is None:
            return
        lag = self.progress.record_posted(rank, bucket)
        if lag is not None and self._metrics is not None:
            self._metrics.observe_bucket_arrival(rank, lag)

    def _averaged(self, bucket: int, offset: int, averaged: memoryview) -> list[Send]:
        """The averaged chunk for every unit leader, encoded once (pieces for a float32 reply).

        Followers get their averages from their local leader, over shared memory. A
        leader whose upload of this chunk came from its same-host segment gets a
        `SegmentAverage` instead: nothing is encoded for it.
        """
        held = self._buckets[bucket]
        reduction = held.reduction
        if self.outer.holds(bucket):  # DiLoCo: the new global parameters, not the average
            replayed = self.outer.replaying  # answered with the stored parameters
            nonfinite = 0 if replayed else count_nonfinite(averaged, pb.DTYPE_FLOAT32)
            elements = len(averaged) // 4
            averaged = self.outer.answer(bucket, offset, reduction.dtype, averaged)
            # Checked before anything of it is committed (raises under "abort").
            self.nonfinite.check_average(
                self.step,
                bucket,
                offset,
                nonfinite + self.outer.last_nonfinite,
                elements,
                self.participants(),
            )
        screened_ranks, screen_note = self._screen_note(bucket, offset)
        units = self.units()
        from_segment = tuple(u for u in units if (bucket, offset, u) in self._segment_uploads)
        self._segment_uploads.difference_update((bucket, offset, u) for u in from_segment)
        header = ChunkHeader(
            step=self.step,
            membership_epoch=self.membership.epoch,
            bucket_index=bucket,
            offset=offset,
            dtype=reduction.reply_dtype,
            contributors=reduction.last_contributors - held.merged,
            merged_late=held.merged,
            staleness=held.staleness,
            scale=self.outer.answer_scale(bucket, offset),  # an int8 answer's
            screened_ranks=screened_ranks,
            screen_note=screen_note,
            encoding=self.outer.public.encoding_at(bucket, offset),  # a sparse answer's
        )
        return answer_sends(
            header, averaged, reduction.dtype, self._chunk_bytes, units, from_segment
        )

    def _close_bucket_if_complete(self, bucket: int) -> list[Action]:
        """Once every chunk of `bucket` went out: count it, and close the step after the last.

        Called after the bucket's final averaged chunks were queued (never between
        two of them: a rank dropped under the elastic policy can complete several
        chunks at once, and closing the step frees the reductions they come from).
        """
        reduction = self._buckets[bucket].reduction
        if not reduction.complete:
            return []
        self._buckets_done += 1
        if self._metrics is not None and self.progress is not None:
            widening = dtypes.itemsize(reduction.reply_dtype) // dtypes.itemsize(reduction.dtype)
            sent = reduction.range_bytes * widening * len(self.units())
            self._metrics.observe_bucket_done(self.progress.bucket_age(bucket), sent)
        if self._buckets_done != self.layout.count:
            return []
        report = self._reports.report(self.step, self.participants(), self._metrics)
        if self._metrics is not None and self.progress is not None:
            self._metrics.observe_step_done(self.progress.age(), self.step)
        if self.screen is not None:
            self.screen.close_round(self.step)
        if self.stragglers.window is not None and self.progress is not None:
            expected = [r for r in self.membership.ranks() if r not in self.out_of_inputs]
            grace.round_closed(
                self.stragglers.window,
                self.membership.job_id,
                self.step,
                expected,
                self.progress.age(),
                self.outer.seeded,
                self._metrics,
            )
        report = self.outer.close_step(self.membership.job_id, self.step) + report
        self._advance()
        self.steps_completed += 1
        return report

    # ------------------------------------------------------------- stragglers
    def _weight_of(self, rank: int, chunk: ChunkHeader) -> float | None:
        """The checked weight of `rank`'s chunk in the open round (None: summed unweighted).

        Raises:
            RejectedMessage: a weight in an unweighted job, or a bad or changing one.
        """
        bucket, stragglers = chunk.bucket_index, self.stragglers
        if not self.outer.holds(bucket):
            return None  # the presence vector is not a pseudo-gradient: never weighted
        weighted = stragglers.policy.weighted
        earlier, seen_at = stragglers.weights.get(rank, (None, ""))
        weight = check_weight(rank, chunk, weighted, earlier, seen_at)
        stragglers.weights.setdefault(rank, (weight, f"bucket {bucket} at offset {chunk.offset}"))
        # The seed round averages identical parameters: weighing them would only round them.
        return weight if weighted and self.outer.seeded else None

    def _merge_late(self, bucket: int, reduction: BucketReduction) -> tuple[int, int]:
        """Add the late contributions the open round merges into `bucket`'s new reduction.

        Each is summed as rank LATE_RANK_BASE + r, after every live rank.

        Returns:
            (how many were merged, the largest staleness among them in rounds).
        """
        stragglers = self.stragglers
        if not stragglers.merging or not self.outer.holds(bucket):
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
        staleness = max((self.step - late.step for late, _ in chosen), default=0)
        return len(chosen), staleness

    def _answer_late(self, rank: int, chunk: ChunkHeader, payload: memoryview) -> list[Action]:
        """A chunk of `rank` for a round that closed without it: keep or drop it, answer at once.

        The answer is the current global parameters of the chunk (the echo of the
        rank's own upload, for a bucket that holds none), with `next_step` the open
        step, where the rank continues.

        Raises:
            RejectedMessage: the chunk does not fit the layout, repeats one, or its weight is bad.
        """
        stragglers, layout, bucket = self.stragglers, self.layout, chunk.bucket_index
        where = (
            f"rank {rank} sent bucket {bucket} at offset {chunk.offset} of late round {chunk.step}"
        )
        if bucket >= layout.count:
            raise refused(chunk, f"{where}, but the model has {layout.count} buckets")
        epoch = self.membership.epoch
        if chunk.membership_epoch > epoch or chunk.covered_ranks:
            raise refused(
                chunk,
                f"{where} in membership epoch {chunk.membership_epoch} covering ranks "
                f"{list(chunk.covered_ranks)}; the coordinator is at epoch {epoch} "
                "and late rounds carry one rank's own contribution",
                Code.FAILED_PRECONDITION,
            )
        outer = self.outer.holds(bucket)
        reply_check = self.outer.check_reply if outer else None
        checked = layout.check(rank, chunk, payload, None, -1, reply_check, self.budget)
        late = stragglers.late_upload(rank, chunk.step)
        if outer:
            earlier = f"first chunk of late round {late.step}"
            weighted = stragglers.policy.weighted
            late.weight = check_weight(rank, chunk, weighted, late.weight or None, earlier)
        lo, hi = checked.byte_range
        late.chunks_needed[bucket] = chunking.num_chunks(hi - lo, layout.chunk_bytes)
        seen = late.seen.setdefault(bucket, set())
        if chunk.offset in seen:
            raise refused(chunk, f"{where} twice")
        seen.add(chunk.offset)
        if outer and stragglers.policy.merge_late:
            contribution, magnitude = examine(checked.payload, checked.payload_dtype)
            if magnitude is Magnitude.NONFINITE:  # reported, or the open step aborted ("abort")
                self.nonfinite.check(rank, chunk, contribution, checked.payload_dtype)
            if late.reservation is None:
                late.reservation = self.budget.reserve(self.membership.job_id)
            late.kept[(bucket, chunk.offset)] = (checked.wire_dtype, bytes(contribution), magnitude)
            late.reservation.hold(late.held_bytes())
        elements = len(checked.payload) // dtypes.itemsize(checked.payload_dtype)
        if outer:
            answer = self.outer.current(bucket, chunk.offset, checked.wire_dtype, elements)
        else:
            values = to_accumulator(checked.payload, checked.payload_dtype)
            answer = from_accumulator(values, checked.reply_dtype)
        header = ChunkHeader(
            step=chunk.step,
            membership_epoch=epoch,
            bucket_index=bucket,
            offset=chunk.offset,
            dtype=checked.reply_dtype,
            next_step=self.step,
        )
        # Always as a message (not through a same-host segment): one rank, rarely.
        sends = answer_sends(header, answer, checked.wire_dtype, layout.chunk_bytes, (rank,), ())
        if late.complete(layout.count):
            stragglers.finish_upload(rank)
        return list(sends)

    def close_round_if_due(self) -> list[Action]:
        """Close the open round without the ranks that sent nothing, if the policy says so now.

        Called after every accepted chunk and from the coordinator's watchdog (the
        deadline passes while nothing arrives). The round completes at once (every
        rank that began uploading has finished: `RoundPolicy.may_close`).
        """
        stragglers, progress = self.stragglers, self.progress
        if not stragglers.policy.partial or progress is None or not self.outer.seeded:
            return []
        participants = self.participants()
        age = None if progress.started_at is None else progress.age()
        complete = [r for r in participants if progress.delivered_all(r)]
        started = [r for r in participants if progress.delivered_any(r)]
        window = None if stragglers.window is None else stragglers.window.deadline_s()
        excused = stragglers.policy.may_close(age, participants, complete, started, window)
        if not excused:
            return []
        for rank in excused:
            stragglers.excuse(rank, self.step)
        actions: list[Action] = []
        for rank in excused:  # the last one completes the round (after it, the step moved on)
            actions += self.drop_rank(rank)
        return actions

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
        ranks = self.membership.ranks()
        if culprit not in ranks:
            ranks = tuple(sorted((*ranks, culprit)))
        return abort_actions(ranks, culprit, step, rejection)

    def abort_completed(self, step: int) -> None:
        """`step` completed here but is aborted for everyone (a shard refused its range).

        It is remembered as aborted and no longer counted as completed, so that
        status says so. (The Prometheus counter of completed steps cannot be taken back.)
        """
        self.remember_aborted(step)
        self.steps_completed -= 1

    def drop_step(self) -> None:
        """Abandon the open step without telling anyone and start the next one.

        A coordinator shard follows its leader's abort this way: the leader
        already told every rank why (`abort` is the leader's version).
        """
        self._advance()

    def release(self) -> None:
        """Free every buffer of the open step; it will never complete (job broken or refused)."""
        self.outer.discard()  # after a commit nothing is pending: only an abort loses any
        if self.screen is not None:
            self.screen.discard()
        self._verdicts.clear()
        self.stragglers.end_round()
        for held in self._buckets.values():
            held.reservation.release()
        self._buckets.clear()
        self._segment_uploads.clear()
        if self.progress is not None:
            self.progress.reset()

    def _advance(self) -> None:
        self.release()
        self._buckets_done = self._empty_buckets
        self.step += 1
        self._start_epoch = self.membership.epoch
        self._open_members = frozenset(self.membership.ranks())

    def late_ranks(self) -> dict[int, list[int]]:
        """Ranks the open step waits for, with the buckets others already delivered."""
        if self.progress is None:
            return {}
        return self.progress.late_ranks(self.participants())
