"""How the core reports what it sees, without knowing who listens.

The open step measures bucket arrivals, lags, non-finite contributions and
completions; Prometheus (`gradsync_server.metrics.CoordinatorMetrics`) is one
listener, a test's recorder another. The core depends on this protocol only,
so it imports neither prometheus_client nor the RPC layer that owns the
registry (the purity rule of tests/unit/test_core_is_pure.py).

`LagTracker` lives here because it is pure logic the observer and `status`
both read: a windowed mean of each rank's lag behind the first arrival of
every bucket (or, in a process group's job, every collective), to name the
ranks that are persistently behind (a histogram shows the distribution, not
who).
"""

from __future__ import annotations

import math
from collections import deque
from typing import Protocol

from gradsync_proto.v1 import gradsync_pb2 as pb

from gradsync_server.dataplane.actions import Action, Send

__all__ = ["REPORT_EVERY_STEPS", "LagTracker", "ReportSchedule", "StepObserver"]

#: A StepReport that says nothing new is sent only every this many steps (the lag it carries).
REPORT_EVERY_STEPS = 16


class StepObserver(Protocol):
    """What the data plane tells whoever measures it (one call per bucket or step)."""

    def observe_bucket_arrival(self, rank: int, lag_s: float) -> None:
        """`rank`'s contribution to a bucket began `lag_s` after the first rank's (a
        process group's collectives report their inputs' lag through this too)."""

    def observe_nonfinite(self, rank: int) -> None:
        """`rank` sent NaN or Inf in a bucket (once per rank, step and bucket)."""

    def observe_bucket_done(self, round_trip_s: float, sent_bytes: int) -> None:
        """A bucket's average went out to every rank."""

    def observe_step_done(self, sync_s: float, step: int) -> None:
        """Step `step` completed `sync_s` after its first chunk arrived."""

    def observe_round_window(self, window_s: float | None, missed: tuple[int, ...]) -> None:
        """A DiLoCo round with the adaptive deadline closed: the grace window for the
        next one (None: none yet), and the ranks that missed it."""

    def slowest(self, k: int) -> list[tuple[int, float]]:
        """The `k` ranks with the largest mean lag, as (rank, seconds), slowest first."""

    def observe_restart(self, continued: bool, steps_recomputed: int) -> None:
        """A restarted job went on: from the ranks' own state or from a checkpoint."""

    def observe_collective(self, op: str, received_bytes: int, sent_bytes: int) -> None:
        """A collective completed (`op`: "all_reduce_sum", "broadcast", ...): the bytes
        of every rank's input, and of every rank's result (once per receiving rank)."""


class LagTracker:
    """Per rank, the mean lag over its last `window` buckets.

    A lag is how long after the first rank's arrival a rank's contribution to
    a bucket arrived (0 for the first). A windowed mean rather than a
    lifetime one, so a rank that recovers (or a host that was busy for a
    while) stops being named once `window` good buckets have passed.

    Args:
        window: how many of each rank's latest samples the mean covers.

    Raises:
        ValueError: `window` < 1.
    """

    def __init__(self, window: int = 50) -> None:
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        self.window = window
        self._samples: dict[int, deque[float]] = {}

    def record(self, rank: int, lag_s: float) -> None:
        """Add one bucket's lag of `rank`.

        Raises:
            ValueError: `lag_s` is negative or not finite (a clock bug upstream,
                which would otherwise poison the mean).
        """
        if not (math.isfinite(lag_s) and lag_s >= 0):
            raise ValueError(f"rank {rank}: lag must be a finite number >= 0 seconds, got {lag_s}")
        samples = self._samples.get(rank)
        if samples is None:
            samples = self._samples[rank] = deque(maxlen=self.window)
        samples.append(lag_s)

    def forget(self, rank: int) -> None:
        """Drop `rank`'s samples (it left; a new member with its rank starts clean)."""
        self._samples.pop(rank, None)

    def samples(self, rank: int) -> int:
        """How many samples (at most `window`) the mean of `rank` covers."""
        samples = self._samples.get(rank)
        return 0 if samples is None else len(samples)

    def mean_lag(self, rank: int) -> float | None:
        """The mean lag of `rank` in seconds, None before its first sample."""
        samples = self._samples.get(rank)
        if not samples:
            return None
        # Summed afresh (at most `window` floats) instead of a running sum,
        # which would drift with every add/subtract pair.
        return math.fsum(samples) / len(samples)

    def _means(self) -> list[tuple[int, float]]:
        return [(rank, math.fsum(s) / len(s)) for rank, s in self._samples.items() if s]

    def slowest(self, k: int) -> list[tuple[int, float]]:
        """The `k` ranks with the largest mean lag, as (rank, mean_lag_s), slowest first.

        Ties go to the lower rank, so the answer does not depend on the order
        in which ranks were first seen.
        """
        if k < 0:
            raise ValueError(f"k must be >= 0, got {k}")
        return sorted(self._means(), key=lambda item: (-item[1], item[0]))[:k]

    def persistently_behind(self, threshold_s: float, min_samples: int) -> list[int]:
        """Ranks whose mean lag exceeds `threshold_s` over at least `min_samples` samples.

        `min_samples` keeps one slow bucket (a GC pause, a first step that
        compiles) from naming a rank. Returned in rank order.

        Raises:
            ValueError: `min_samples` < 1 or past the window (never reachable).
        """
        if not 1 <= min_samples <= self.window:
            raise ValueError(
                f"min_samples must be in 1..{self.window} (the window), got {min_samples}"
            )
        return sorted(
            rank
            for rank, mean in self._means()
            if len(self._samples[rank]) >= min_samples and mean > threshold_s
        )


class ReportSchedule:
    """Which completed steps' StepReports go out to the lowest participant.

    The report feeds that rank's periodic step log, which names the slowest
    rank. Sent after every step it was one more gRPC message per step, through
    the coordinator's most expensive path (a write costs about as much as an
    average for a small model), mostly to say what the last one said.
    So a report goes out when it says something new (the first step, another
    slowest rank, another lowest participant), and otherwise every `every`
    steps, to refresh the lag it carries; the log uses the latest one.

    Args:
        every: the most steps between two reports that say the same (>= 1).
    """

    def __init__(self, every: int = REPORT_EVERY_STEPS) -> None:
        if every < 1:
            raise ValueError(f"every must be >= 1, got {every}")
        self.every = every
        #: (lowest participant, slowest rank) and step of the last report sent.
        self._last: tuple[int, int] | None = None
        self._last_step = 0

    def report(
        self, step: int, participants: tuple[int, ...], metrics: StepObserver | None
    ) -> list[Action]:
        """The StepReport of completed `step` for its lowest participant, if one is due."""
        if not participants:
            return []
        slowest = metrics.slowest(1) if metrics is not None else []
        rank, lag_s = slowest[0] if slowest and slowest[0][1] > 0 else (-1, 0.0)
        said = (min(participants), rank)
        if said == self._last and 0 <= step - self._last_step < self.every:
            return []
        self._last, self._last_step = said, step
        report = pb.StepReport(step=step, slowest_rank=rank, slowest_lag_s=lag_s)
        return [Send((said[0],), pb.CoordinatorMessage(step_report=report))]
