"""Screening of DiLoCo contributions: the rules, per chunk and per round (pure numpy).

The coordinator sees every rank's pseudo-gradient before it is merged, so it
can tell a broken or hostile one from the rest and name its rank. Every
contribution to a chunk of an outer bucket is held until the chunk is
complete; then each is measured against the others (`measure_chunk`: its sum
of squares and its dot product with the chunk's sum, two BLAS passes) and
judged (`judge`):

- norm ratio: its norm over the median norm of the chunk's contributions
  (`ScreenThresholds.norm_ratio`, default 8: an honest rank's norm stays within
  a small factor of the others', a x100 one does not);
- cosine: to the sum of the *other* ranks' contributions (those within the norm
  ratio), below `ScreenThresholds.cosine_min` (default 0.05: a sign-flipped
  contribution points against the others, Gaussian noise across them), judged
  only where the ranks agree on a direction (the chunk's median cosine is at
  least `consensus`, default 0.5; pseudo-gradients that are mostly noise agree
  on none, and then no rank is flagged by its cosine);
- non-finite values (the `--nonfinite` policy handles those; they are flagged here too).

The job's policy (`gradsync.DiLoCo(screen=...)`, floored by `gradsync serve
--screen`) says what a flagged contribution does; the order below is also
the floor's order (a policy is at least as strict as those before it):

- "report": merged as usual; named in the log, metrics, status and to its worker;
- "clip": every contribution whose norm exceeds `clip_ratio` x the median norm
  is scaled down to that norm, then all are averaged;
- "exclude": flagged contributions are left out of the chunk's average, whose
  divisor counts only the kept ones; a rank excluded `quarantine_after` rounds in
  a row is quarantined (left out, flagged or not) for `quarantine_rounds` rounds;
- "trimmed_mean": per coordinate, the `trim` largest and smallest values are
  dropped and the rest averaged (trim = W // 4, at least 1 from W = 3 on);
- "median": the coordinate-wise median.

Every rule is deterministic in rank order: contributions are taken in
ascending rank, sums are formed row by row in that order, sorts are by value.
Robust merges are coordinate-wise, so their result does not depend on where
chunks (or a sharded coordinator's ranges) are cut; norm and cosine rules are
judged per chunk, so with S shards each shard judges the chunks of its own range.

Every policy holds all contributions of a chunk until the chunk is complete:
at most W x chunk_bytes per chunk in flight, counted in the byte budget as any
parked contribution is.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
from gradsync_proto.v1 import gradsync_pb2 as pb

__all__ = [
    "POLICIES",
    "ChunkVerdict",
    "Finding",
    "Geometry",
    "Measure",
    "Quarantine",
    "ScreenPolicy",
    "ScreenThresholds",
    "check_screen",
    "judge",
    "measure",
    "measure_chunk",
    "median_of",
    "merge",
    "screen_problem",
    "step_screen_problem",
    "stricter",
    "trim_count",
]

#: A chunk's values in its accumulation dtype (float32; float64 for a float64 bucket).
Floats = npt.NDArray[np.floating]


class ScreenPolicy(enum.StrEnum):
    """What a flagged contribution does (the values are the spellings users pass)."""

    REPORT = "report"
    CLIP = "clip"
    EXCLUDE = "exclude"
    TRIMMED_MEAN = "trimmed_mean"
    MEDIAN = "median"


#: The policies from the weakest to the strictest (a floor is met by itself and those after it).
ORDER = tuple(ScreenPolicy)
POLICIES = tuple(policy.value for policy in ScreenPolicy)


def check_screen(policy: str) -> ScreenPolicy:
    """`policy` as a `ScreenPolicy` ("" = "report").

    Raises:
        ValueError: it is none (names the allowed ones).
    """
    if policy == "":
        return ScreenPolicy.REPORT
    if policy not in POLICIES:
        raise ValueError(f"screen policy must be one of {', '.join(POLICIES)}; got {policy!r}")
    return ScreenPolicy(policy)


def screen_problem(outer: pb.OuterOptimizer | None, local_groups: bool) -> str | None:
    """What keeps a DiLoCo job from running its screen, or None (checked at its start).

    A policy that holds contributions (all but "report") screens each rank's own
    pseudo-gradient, unweighted: not a local group's sum, a weighted round or a
    late contribution merged into a later round.
    """
    if outer is None:
        return None
    policy = check_screen(outer.screen)
    if policy is ScreenPolicy.REPORT:
        return None
    if local_groups:
        return step_screen_problem(policy.value, local_groups)
    if outer.weighted or outer.merge_late:
        return (
            f"screen {policy.value!r} needs unweighted rounds without late merges "
            f"(weighted={outer.weighted}, merge_late={outer.merge_late})"
        )
    return None


def step_screen_problem(policy: str, local_groups: bool) -> str | None:
    """What keeps a per-step (DDP) job from running its screen `policy` ("" = none), or None.

    A policy that holds contributions screens each rank's own gradients: not a
    local group's sum ("report" then screens nothing of such a job).
    """
    if policy in ("", ScreenPolicy.REPORT.value) or not local_groups:
        return None
    return (
        f"screen {policy!r} needs flat ranks; this job formed local groups "
        "(pass hierarchical=False)"
    )


def stricter(job: ScreenPolicy, floor: ScreenPolicy) -> ScreenPolicy:
    """The policy a job runs under: its own, or the coordinator's floor if that is stricter."""
    return job if ORDER.index(job) >= ORDER.index(floor) else floor


@dataclass(frozen=True)
class ScreenThresholds:
    """When a contribution is flagged, and what clip and quarantine do."""

    #: Flag a contribution whose norm is more than this times the chunk's median norm.
    norm_ratio: float = 8.0
    #: Flag a contribution whose cosine to the other ranks' sum is below this ...
    cosine_min: float = 0.05
    #: ... when the ranks agree on a direction: the chunk's median cosine is at least this.
    consensus: float = 0.5
    #: "clip": scale contributions down to this times the chunk's median norm.
    clip_ratio: float = 2.0
    #: "exclude": quarantine a rank after this many excluded rounds in a row ...
    quarantine_after: int = 3
    #: ... for this many rounds.
    quarantine_rounds: int = 10

    def describe(self) -> str:
        """The thresholds, for messages."""
        return (
            f"norm ratio > {self.norm_ratio:g}, cosine < {self.cosine_min:g} "
            f"where the median cosine >= {self.consensus:g}"
        )


class Geometry:
    """A contribution's norm and cosine to a reference, from its sums."""

    square_sum: float
    dot: float
    reference_square_sum: float

    @property
    def norm(self) -> float:
        return math.sqrt(self.square_sum) if math.isfinite(self.square_sum) else math.inf

    @property
    def cosine(self) -> float:
        """Cosine to the reference (nan when it or the contribution is zero)."""
        denominator = math.sqrt(self.square_sum * self.reference_square_sum)
        if not (denominator > 0 and math.isfinite(denominator) and math.isfinite(self.dot)):
            return math.nan
        return self.dot / denominator


@dataclass(frozen=True)
class Measure(Geometry):
    """One contribution to one chunk, measured on arrival."""

    #: Sum of squares of its elements (inf if it overflows or holds NaN/Inf).
    square_sum: float
    #: Dot product with the reference: the other ranks' contributions summed (nan: none).
    dot: float
    #: Sum of squares of the reference (0: none).
    reference_square_sum: float
    #: NaN or Inf elements.
    nonfinite: int


def measure_chunk(
    rows: Sequence[tuple[int, Floats]], norm_ratio: float
) -> list[tuple[int, Measure]]:
    """Measure every contribution to one complete chunk (`rows` in ascending rank order).

    The reference of contribution i is the sum of the *other* contributions whose
    norm is within `norm_ratio` of the median (so a x100 one does not drag the
    direction every other rank is compared with). One sum and two dot products per
    contribution: |g|^2, g.S; the rest follows (S - g is never formed).
    """
    with np.errstate(over="ignore", invalid="ignore"):
        squares = [float(np.dot(values, values)) for _, values in rows]
        norms = [math.sqrt(s) if math.isfinite(s) else math.inf for s in squares]
        median_norm = median_of(norms) if norms else 0.0
        kept = [
            math.isfinite(n) and (median_norm <= 0 or n <= norm_ratio * median_norm) for n in norms
        ]
        total = (
            _row_sum([values for (_, values), keep in zip(rows, kept, strict=True) if keep])
            if any(kept)
            else None
        )
        total_square = float(np.dot(total, total)) if total is not None else 0.0
        measures = []
        for (rank, values), square, keep in zip(rows, squares, kept, strict=True):
            nonfinite = 0 if math.isfinite(square) else int(np.count_nonzero(~np.isfinite(values)))
            if total is None or not math.isfinite(square):
                measures.append((rank, Measure(square, math.nan, 0.0, nonfinite)))
                continue
            dot_total = float(np.dot(values, total))
            if keep:  # (S - g).g and |S - g|^2 from the dots already taken
                dot, other = dot_total - square, total_square - 2 * dot_total + square
            else:
                dot, other = dot_total, total_square
            measures.append((rank, Measure(square, dot, max(other, 0.0), nonfinite)))
    return measures


def measure(values: Floats, reference: Floats | None) -> Measure:
    """Measure a contribution (`values`) against a reference direction."""
    with np.errstate(over="ignore", invalid="ignore"):
        square_sum = float(np.dot(values, values))
        nonfinite = 0 if math.isfinite(square_sum) else int(np.count_nonzero(~np.isfinite(values)))
        if reference is None:
            return Measure(square_sum, math.nan, 0.0, nonfinite)
        dot = float(np.dot(values, reference))
        return Measure(square_sum, dot, float(np.dot(reference, reference)), nonfinite)


@dataclass(frozen=True)
class Finding:
    """What was wrong with one rank's contribution to a chunk, and what was done about it."""

    rank: int
    #: "norm", "cosine", "nonfinite" or "quarantined" (the reasons, in that order).
    reasons: tuple[str, ...]
    #: Its norm over the chunk's median norm.
    ratio: float
    cosine: float
    #: "reported", "clipped", "excluded" or "trimmed" (robust merges bound it).
    action: str


@dataclass(frozen=True)
class ChunkVerdict:
    """The flagged ranks of one chunk and the ranks left out of its average."""

    findings: tuple[Finding, ...]
    excluded: frozenset[int]
    median_norm: float


_ACTIONS = {
    ScreenPolicy.REPORT: "reported",
    ScreenPolicy.CLIP: "clipped",
    ScreenPolicy.EXCLUDE: "excluded",
    ScreenPolicy.TRIMMED_MEAN: "trimmed",
    ScreenPolicy.MEDIAN: "trimmed",
}


def judge(
    policy: ScreenPolicy,
    thresholds: ScreenThresholds,
    measures: Sequence[tuple[int, Measure]],
    quarantined: frozenset[int] = frozenset(),
) -> ChunkVerdict:
    """Flag the contributions of one complete chunk (`measures` in ascending rank order).

    Under "exclude" the flagged and quarantined ranks are left out, unless that
    would leave none (then every contribution is kept, and still named).
    """
    norms = [m.norm for _, m in measures]
    median_norm = median_of(norms) if norms else 0.0
    cosines = [m.cosine for _, m in measures if not math.isnan(m.cosine)]
    agreed = bool(cosines) and median_of(cosines) >= thresholds.consensus
    findings = []
    excluded = set()
    for rank, measured in measures:
        ratio = measured.norm / median_norm if median_norm > 0 else 1.0
        reasons = []
        if measured.nonfinite:
            reasons.append("nonfinite")
        elif ratio > thresholds.norm_ratio:
            reasons.append("norm")
        cosine = measured.cosine
        if agreed and cosine < thresholds.cosine_min:  # nan compares False
            reasons.append("cosine")
        if rank in quarantined:
            reasons.append("quarantined")
        if reasons:
            findings.append(Finding(rank, tuple(reasons), ratio, cosine, _ACTIONS[policy]))
            excluded.add(rank)
    if policy is not ScreenPolicy.EXCLUDE or len(excluded) == len(measures):
        if policy is ScreenPolicy.EXCLUDE:
            findings = [dataclasses.replace(f, action="reported") for f in findings]
        excluded = set()
    return ChunkVerdict(tuple(findings), frozenset(excluded), median_norm)


def merge(
    policy: ScreenPolicy,
    thresholds: ScreenThresholds,
    contributions: Sequence[tuple[int, Floats]],
    verdict: ChunkVerdict,
) -> tuple[Floats, int]:
    """The chunk's sum and its divisor under `policy` (`contributions` in ascending rank order).

    Returns a fresh array of the contributions' dtype (the caller divides it by the divisor).
    """
    if policy is ScreenPolicy.TRIMMED_MEAN or policy is ScreenPolicy.MEDIAN:
        stacked = np.stack([values for _, values in contributions])
        ordered = np.sort(stacked, axis=0)  # per coordinate, by value: arrival-independent
        count = len(contributions)
        if policy is ScreenPolicy.MEDIAN:
            middle = count // 2
            if count % 2:
                return ordered[middle].copy(), 1
            return _row_sum(ordered[middle - 1 : middle + 1]), 2
        trim = trim_count(count)
        return _row_sum(ordered[trim : count - trim]), count - 2 * trim
    kept = [(rank, values) for rank, values in contributions if rank not in verdict.excluded]
    if policy is ScreenPolicy.CLIP:
        limit = thresholds.clip_ratio * verdict.median_norm
        rows = []
        for _, values in kept:
            with np.errstate(over="ignore", invalid="ignore"):
                norm = float(np.sqrt(np.dot(values, values)))
            if limit > 0 and norm > limit and math.isfinite(norm):
                values = values * np.float32(limit / norm)
            rows.append(values)
        return _row_sum(rows), len(rows)
    return _row_sum([values for _, values in kept]), len(kept)


def median_of(values: Sequence[float]) -> float:
    """The median of a few numbers, as `np.median` gives it, at a fraction of its cost
    (a per-step screen takes one or two per chunk)."""
    ordered = sorted(values)
    middle = len(ordered) // 2
    if len(ordered) % 2:
        return float(ordered[middle])
    return (ordered[middle - 1] + ordered[middle]) / 2


def trim_count(count: int) -> int:
    """Values dropped at each end per coordinate by "trimmed_mean" among `count`."""
    return 0 if count < 3 else max(1, count // 4)


def _row_sum(rows: Sequence[Floats] | Floats) -> Floats:
    """The rows summed one after the other, in order (the same bits whatever the row length)."""
    total = np.array(rows[0], copy=True)
    with np.errstate(over="ignore", invalid="ignore"):
        for row in rows[1:]:
            total += row
    return total


class Quarantine:
    """Which ranks "exclude" leaves out whatever they send, and for how long.

    A rank excluded from some chunk in `after` rounds in a row is quarantined for
    the next `rounds` rounds; a round without an exclusion resets its streak.
    """

    def __init__(self, after: int, rounds: int) -> None:
        self.after = after
        self.rounds = rounds
        self._streaks: dict[int, int] = {}
        #: rank -> the last round it is quarantined in.
        self._until: dict[int, int] = {}

    def quarantined(self, round_number: int) -> frozenset[int]:
        """The ranks left out of `round_number`."""
        return frozenset(r for r, last in self._until.items() if round_number <= last)

    def close_round(self, round_number: int, excluded: frozenset[int]) -> frozenset[int]:
        """Count `round_number`'s excluded ranks; returns those newly quarantined.

        A rank in quarantine during the round is not counted (its exclusion was the
        quarantine's, not a new finding).
        """
        serving = self.quarantined(round_number)
        started = set()
        for rank in sorted(set(self._streaks) | set(excluded)):
            if rank in serving:
                continue
            if rank not in excluded:
                self._streaks.pop(rank, None)
                continue
            self._streaks[rank] = self._streaks.get(rank, 0) + 1
            if self.after > 0 and self._streaks[rank] >= self.after:
                self._until[rank] = round_number + self.rounds
                self._streaks.pop(rank)
                started.add(rank)
        return frozenset(started)
