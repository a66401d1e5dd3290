"""Straggler-tolerant DiLoCo rounds: when a round may close without every rank (pure logic).

By default a DiLoCo round is a synchronized step: it closes when every live
rank contributed. With `OuterOptimizer.min_contributors = k > 0` a round may
also close once `round_deadline_s` passed since its first contribution and at
least k ranks contributed; the ranks absent then are *excused* from it (they
are slow, not dead: they stay members). The decision is atomic: it is taken
only while no rank is half way through its upload, so every chunk of the round
averages the same contributors, and the round completes at that instant. A
rank whose upload is under way at the deadline is waited for (a slow link
still delivers), one that sent nothing is not.

What an excused rank sends for its round later is *late*
(`gradsync_server.dataplane.late`): it is answered at once with the current
global parameters and the step to continue at, and its pseudo-gradient is
dropped (the default) or merged into a later round within a staleness bound.

Weighting (`OuterOptimizer.weighted`): each rank's chunks carry its weight,
the samples it processed since its last round, and the average becomes
sum(w_i g_i) / sum(w_i) (`aggregation`, summed in rank order, divided in
float64). Weights are claims from the network and checked here: finite,
between `MIN_WEIGHT` and `MAX_WEIGHT`, the same on every chunk of a rank's
round. The minimum keeps every weight a normal float32 number far from 0:
weights that round to 0 in float32 (1e-300) would make the average 0/0 =
NaN in every element from finite pseudo-gradients.

The seed round (the coordinator learning the global parameters) is never
partial and never weighted: it must hold every rank's identical parameters.
Only an unsharded coordinator without local groups runs partial rounds (the
leader alone would have to decide for every shard's range; see the README).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from gradsync_proto.codec import ChunkHeader
from gradsync_proto.v1 import gradsync_pb2 as pb

from gradsync_server.dataplane.chunk_checks import refused
from gradsync_server.dataplane.screening import screen_problem

__all__ = [
    "MAX_WEIGHT",
    "MIN_WEIGHT",
    "RoundPolicy",
    "check_weight",
    "job_problem",
    "policy_problem",
]

#: The largest weight a chunk may claim: 2**53, past which float64 stops counting samples.
MAX_WEIGHT = 2.0**53
#: The smallest weight a chunk may claim: 2**-20 (about 1e-6 of a sample), so that a weight
#: and the products w * g it scales stay normal float32 numbers.
MIN_WEIGHT = 2.0**-20


@dataclass(frozen=True)
class RoundPolicy:
    """A job's straggler settings (`pb.OuterOptimizer` fields 4-8 and 10; all off by default)."""

    #: k: a round may close with this many contributors (0 = every live rank).
    min_contributors: int = 0
    #: Seconds from the round's first contribution before it may close with k.
    deadline_s: float = 0.0
    #: Keep late contributions for a later round (else drop them).
    merge_late: bool = False
    #: The oldest late contribution merged, in rounds.
    max_staleness: int = 0
    #: The average weighs each contribution by its chunk's `weight`.
    weighted: bool = False
    #: The deadline is the adaptive grace window (`gradsync_server.dataplane.grace`).
    auto: bool = False

    @classmethod
    def of(cls, outer: pb.OuterOptimizer | None) -> RoundPolicy:
        """The policy a job's outer optimizer sets (the defaults without one)."""
        if outer is None:
            return cls()
        return cls(
            outer.min_contributors,
            outer.round_deadline_s,
            outer.merge_late,
            outer.max_staleness,
            outer.weighted,
            outer.round_deadline_auto,
        )

    @property
    def partial(self) -> bool:
        """True if a round may close without every live rank."""
        return self.min_contributors > 0

    def may_close(
        self,
        age_s: float | None,
        participants: Iterable[int],
        complete: Iterable[int],
        started: Iterable[int],
        window_s: float | None = None,
    ) -> tuple[int, ...]:
        """The ranks to excuse from the open round now, or () to keep waiting.

        Args:
            age_s: seconds since the round's first contribution (None: none yet).
            participants: the ranks the round expects.
            complete: those that delivered every chunk.
            started: those that delivered at least one chunk (complete or not).
            window_s: with `auto`, the grace window now (None: no window yet, wait
                for every rank); ignored otherwise.
        """
        deadline = window_s if self.auto else self.deadline_s
        if not self.partial or age_s is None or deadline is None or age_s < deadline:
            return ()
        expected, done, begun = set(participants), set(complete), set(started)
        if begun - done or len(done & expected) < self.min_contributors:
            return ()  # an upload is under way (wait for it), or too few contributed
        return tuple(sorted(expected - begun))


def policy_problem(outer: pb.OuterOptimizer) -> str | None:
    """What is wrong with an outer optimizer's straggler settings, or None.

    The world size is checked at the job's start (`min_contributors` at most it).
    """
    k, deadline = outer.min_contributors, outer.round_deadline_s
    if not (math.isfinite(deadline) and deadline >= 0):
        return f"round_deadline_s must be finite and >= 0, got {deadline}"
    if k == 0 and deadline > 0:
        return f"round_deadline_s={deadline:g} needs min_contributors >= 1 (partial rounds)"
    if outer.round_deadline_auto and k == 0:
        return "round_deadline_auto needs min_contributors >= 1 (partial rounds)"
    if outer.round_deadline_auto and deadline > 0:
        return (
            f"round_deadline_auto and round_deadline_s={deadline:g} are both set: "
            "the deadline is either adaptive or fixed"
        )
    if outer.merge_late and k == 0:
        return "merge_late needs partial rounds (min_contributors >= 1): no round is late"
    if outer.merge_late and outer.max_staleness < 1:
        return f"merge_late needs max_staleness >= 1 round, got {outer.max_staleness}"
    if not outer.merge_late and outer.max_staleness:
        return f"max_staleness={outer.max_staleness} is set, but late contributions are dropped"
    return None


def job_problem(
    outer: pb.OuterOptimizer | None, world_size: int, shard_count: int, local_groups: bool
) -> str | None:
    """What keeps a job from running its straggler settings or its screen (`outer.screen`,
    the floor applied), or None (checked at its start)."""
    if outer is None:
        return None
    k = outer.min_contributors
    if k > world_size:
        return f"min_contributors={k} is more than the job's {world_size} ranks"
    if k and shard_count > 1:
        return (
            f"partial rounds (min_contributors={k}) need an unsharded coordinator; this one has "
            f"{shard_count} shards (each would have to close its range of the round alike)"
        )
    if k and local_groups:
        return (
            f"partial rounds (min_contributors={k}) need flat ranks; this job formed local "
            "groups (pass hierarchical=False)"
        )
    return screen_problem(outer, local_groups)


def check_weight(
    rank: int, chunk: ChunkHeader, weighted: bool, earlier: float | None, seen_at: str
) -> float:
    """A chunk's weight, checked: the value the round uses for `rank`.

    Args:
        weighted: the job weighs contributions (else the weight must be unset).
        earlier: the weight `rank`'s earlier chunks of this round claimed, if any.
        seen_at: where `earlier` was seen, for the message ("bucket 0 at offset 0").

    Raises:
        RejectedMessage: INVALID_ARGUMENT naming the rank, round, bucket and both values.
    """
    weight, step, bucket = chunk.weight, chunk.step, chunk.bucket_index
    where = f"rank {rank} sent bucket {bucket} at offset {chunk.offset} of round (step) {step}"
    if not weighted:
        if weight != 0:
            raise refused(
                chunk, f"{where} with weight {weight!r}, but the job is not weighted (expected 0)"
            )
        return 1.0
    if math.isfinite(weight) and 0 < weight < MIN_WEIGHT:
        raise refused(
            chunk,
            f"{where} with weight {weight!r}, below the minimum weight {MIN_WEIGHT!r} (2**-20; "
            "a weight that small rounds the weighted average towards 0/0)",
        )
    if not (math.isfinite(weight) and MIN_WEIGHT <= weight <= MAX_WEIGHT):
        raise refused(
            chunk,
            f"{where} with weight {weight!r}, expected a finite weight in [{MIN_WEIGHT!r}, "
            f"{MAX_WEIGHT:g}] (the samples it processed since its last round)",
        )
    if earlier is not None and weight != earlier:
        raise refused(
            chunk,
            f"{where} with weight {weight!r}, but its {seen_at} claimed weight {earlier!r} "
            "(every chunk of a rank's round carries the same weight)",
        )
    return weight
