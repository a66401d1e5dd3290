"""One job's screen at one coordinator process: measures, verdicts and the names it gives.

The open step asks for a verdict on each complete chunk of a screened bucket:
with every contribution held (`verdict`: a DiLoCo round, or a per-step job under
a policy that holds them), or from the sums of squares noted as the
contributions were folded (`note`, then `noted_verdict`: a per-step job under
"report", which holds nothing and measures no cosine); the rules are
`screening`. A "round" is a DiLoCo round or a per-step job's step. Per round
it keeps each rank's totals (norm over all the chunks it screened, cosine to
the other ranks' sum over them, the worst ratio, the flagged buckets, what was
done), and at the round's end (`close_round`)
names every flagged rank: one log line per rank and round ("rank 2 ..."), the
`gradsync_contribution_*` metrics, `gradsync status` (`count`, `last`), and
the answer header of each flagged chunk (`header_fields`), which the rank's
own worker turns into a warning. Each rank's last `HISTORY_ROUNDS` rounds are
kept (`history`).

With a sharded coordinator every shard screens the chunks of its own byte
range: the numbers it logs and exports cover that range.

Pure logic (logging only), no gRPC, no asyncio.
"""

from __future__ import annotations

import logging
import math
from collections import deque
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from gradsync_server.dataplane.screening import (
    ChunkVerdict,
    Finding,
    Floats,
    Geometry,
    Measure,
    Quarantine,
    ScreenPolicy,
    ScreenThresholds,
    judge,
    measure_chunk,
    median_of,
)

__all__ = ["HISTORY_ROUNDS", "ContributionScreen", "RankRound", "ScreenObserver"]

_log = logging.getLogger("gradsync_server.screen")

#: Rounds of each rank's screening kept (`ContributionScreen.history`).
HISTORY_ROUNDS = 8


@runtime_checkable
class ScreenObserver(Protocol):
    """Where the per-rank screening numbers go (`CoordinatorMetrics`)."""

    def observe_contribution(
        self, rank: int, norm: float, cosine: float, flagged: bool, excluded: bool
    ) -> None:
        """`rank`'s contribution to a round: its norm, cosine, and what the screen did."""


@dataclass
class RankRound(Geometry):
    """One rank's contribution to one round, as screened here."""

    rank: int
    round: int
    square_sum: float = 0.0
    dot: float = 0.0
    reference_square_sum: float = 0.0
    chunks: int = 0
    flagged_chunks: int = 0
    #: The largest ratio to a chunk's median norm, among its chunks.
    worst_ratio: float = 0.0
    reasons: set[str] = field(default_factory=set)
    action: str = ""
    #: The buckets of its flagged chunks.
    buckets: set[int] = field(default_factory=set)

    def describe(self, job_id: str, thresholds: ScreenThresholds) -> str:
        """Names the rank, round, what was wrong and what was done (for people)."""
        what = []
        if "nonfinite" in self.reasons:
            what.append("NaN/Inf values")
        if "norm" in self.reasons:
            what.append(f"norm {self.worst_ratio:.3g}x the median")
        if "cosine" in self.reasons:
            what.append(f"cosine {self.cosine:.3f} to the other ranks' sum")
        if "quarantined" in self.reasons:
            what.append("quarantined")
        buckets = ", ".join(str(b) for b in sorted(self.buckets))
        cosine = "not measured" if math.isnan(self.cosine) else f"{self.cosine:.3f}"
        return (
            f"rank {self.rank} in job '{job_id}' round (step) {self.round}: "
            f"{', '.join(what)} in {self.flagged_chunks} of {self.chunks} chunks "
            f"(bucket {buckets}): {self.action} (thresholds: {thresholds.describe()}; "
            f"norm {self.norm:.4g}, cosine {cosine})"
        )


class ContributionScreen:
    """A job's screening at one process (see the module docstring).

    Args:
        job_id: the job (for messages).
        policy: the policy the job runs under (its own or the coordinator's floor).
        thresholds: when a contribution is flagged.
        observer: where per-rank numbers go, if anywhere.
    """

    def __init__(
        self,
        job_id: str,
        policy: ScreenPolicy,
        thresholds: ScreenThresholds,
        observer: ScreenObserver | None = None,
    ) -> None:
        self.job_id = job_id
        self.policy = policy
        self.thresholds = thresholds
        self._observer = observer
        self._round: dict[int, RankRound] = {}
        self._round_number = -1
        self.quarantine = Quarantine(thresholds.quarantine_after, thresholds.quarantine_rounds)
        self.history: dict[int, deque[RankRound]] = {}
        #: Flagged contributions (one per rank and round) so far.
        self.count = 0
        #: The latest of them, described; "" before any.
        self.last = ""
        #: (bucket, offset) -> [(rank, sum of squares, non-finite elements)] (`note`).
        self._noted: dict[tuple[int, int], list[tuple[int, float, int]]] = {}

    def note(self, key: tuple[int, int], rank: int, square_sum: float, nonfinite: int) -> None:
        """`rank`'s contribution to chunk `key` (bucket, offset) was folded: its sum of
        squares (inf: non-finite or overflowing) and its NaN/Inf element count."""
        self._noted.setdefault(key, []).append((rank, square_sum, nonfinite))

    def noted_verdict(self, round_number: int, key: tuple[int, int]) -> ChunkVerdict | None:
        """Judge the complete chunk `key` of `round_number` by what `note` measured: norm
        ratio and non-finite values (no cosine); None if nothing was noted."""
        noted = self._noted.pop(key, None)
        if not noted:
            return None
        noted.sort()
        norms = [math.sqrt(square_sum) for _, square_sum, _ in noted]  # inf stays inf
        median_norm = median_of(norms)
        calm = median_norm <= 0 or max(norms) / median_norm <= self.thresholds.norm_ratio
        if calm and not any(nonfinite for _, _, nonfinite in noted):
            # Nothing to flag (what `judge` would find, without building its measures):
            # the usual chunk of an honest step, counted and done.
            self._start_round(round_number)
            for rank, square_sum, _ in noted:
                totals = self._totals(rank, round_number)
                totals.square_sum += square_sum
                totals.chunks += 1
            return ChunkVerdict((), frozenset(), median_norm)
        measures = [
            (rank, Measure(square_sum, math.nan, 0.0, nonfinite))
            for rank, square_sum, nonfinite in noted
        ]
        return self._judge(round_number, key, measures)

    def verdict(
        self, round_number: int, key: tuple[int, int], rows: list[tuple[int, Floats]]
    ) -> ChunkVerdict:
        """Measure and judge the complete chunk `key` (bucket, offset) of `round_number`
        (`rows`: its contributions in ascending rank order), counting each rank's totals."""
        return self._judge(round_number, key, measure_chunk(rows, self.thresholds.norm_ratio))

    def _judge(
        self, round_number: int, key: tuple[int, int], measures: list[tuple[int, Measure]]
    ) -> ChunkVerdict:
        self._start_round(round_number)
        for rank, measured in measures:
            totals = self._totals(rank, round_number)
            totals.square_sum += measured.square_sum
            if math.isfinite(measured.dot):
                totals.dot += measured.dot
                totals.reference_square_sum += measured.reference_square_sum
            totals.chunks += 1
        quarantined: frozenset[int] = frozenset()
        if self.policy is ScreenPolicy.EXCLUDE:
            quarantined = self.quarantine.quarantined(round_number)
        verdict = judge(self.policy, self.thresholds, measures, quarantined)
        for finding in verdict.findings:
            self._record(finding, key[0])
        return verdict

    def _start_round(self, round_number: int) -> None:
        if round_number != self._round_number:
            self._round.clear()
            self._round_number = round_number

    def _totals(self, rank: int, round_number: int) -> RankRound:
        totals = self._round.get(rank)
        if totals is None:
            totals = self._round[rank] = RankRound(rank, round_number)
        return totals

    def _record(self, finding: Finding, bucket: int) -> None:
        totals = self._round.get(finding.rank)
        if totals is None:
            return
        totals.flagged_chunks += 1
        totals.buckets.add(bucket)
        totals.reasons.update(finding.reasons)
        if math.isfinite(finding.ratio):
            totals.worst_ratio = max(totals.worst_ratio, finding.ratio)
        else:
            totals.worst_ratio = math.inf
        if finding.action == "excluded" or not totals.action:
            totals.action = finding.action

    def header_fields(self, verdict: ChunkVerdict) -> tuple[tuple[int, ...], str]:
        """(screened ranks, note) for the answer of a chunk with this verdict."""
        if not verdict.findings:
            return (), ""
        parts = []
        for finding in verdict.findings:
            cosine = "" if math.isnan(finding.cosine) else f", cosine {finding.cosine:.3f}"
            parts.append(
                f"rank {finding.rank}: {'/'.join(finding.reasons)} (norm {finding.ratio:.3g}x "
                f"the median{cosine}): {finding.action}"
            )
        note = (
            f"round {self._round_number}: {'; '.join(parts)} (screen {self.policy.value}, "
            f"thresholds: {self.thresholds.describe()})"
        )
        return tuple(f.rank for f in verdict.findings), note

    def close_round(self, round_number: int) -> list[str]:
        """The round completed: name its flagged ranks; returns the lines logged."""
        if round_number != self._round_number:
            return []
        lines = []
        excluded = set()
        for rank, totals in sorted(self._round.items()):
            history = self.history.setdefault(rank, deque(maxlen=HISTORY_ROUNDS))
            history.append(totals)
            out = totals.action == "excluded"
            if out:
                excluded.add(rank)
            if self._observer is not None:
                flagged = bool(totals.flagged_chunks)
                self._observer.observe_contribution(rank, totals.norm, totals.cosine, flagged, out)
            if totals.flagged_chunks:
                line = totals.describe(self.job_id, self.thresholds)
                self.count += 1
                self.last = line
                lines.append(line)
                _log.warning("screen: %s", line)
        for rank in sorted(self.quarantine.close_round(round_number, frozenset(excluded))):
            line = (
                f"rank {rank} in job '{self.job_id}' is quarantined after "
                f"{self.quarantine.after} excluded rounds in a row: left out of rounds "
                f"{round_number + 1}..{round_number + self.quarantine.rounds}"
            )
            lines.append(line)
            _log.warning("screen: %s", line)
        self._round.clear()
        return lines

    def discard(self) -> None:
        """The round was aborted: nothing of it counts."""
        self._round.clear()
        self._noted.clear()
