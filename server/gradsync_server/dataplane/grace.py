"""The adaptive grace window of DiLoCo rounds (`round_deadline_s="auto"`): pure logic.

With a fixed `round_deadline_s` a round may close that many seconds after its
first contribution (with at least `min_contributors`). With the automatic one
the deadline follows the recent spread of the ranks' arrivals:

- A rank's *arrival* in a round is the seconds from the round's first
  contribution to its own complete contribution. A rank the round closed
  without counts with the round's age when it closed (it would have arrived
  later than that: the sample is a lower bound, which widens the window while
  ranks keep missing it). The first arrival (0 by definition) is left out.
- Each closed round gives one estimate, median + `K` * MAD of its arrivals
  (MAD: the median absolute deviation from that median).
- The window is the median of the last `HISTORY` estimates, at least
  `FLOOR_S` and at most `CEILING_S`. A median of three follows a change of the
  arrivals after two rounds, and ignores one odd round.
- Until a round closed with every rank (no estimate yet), there is no window:
  the round waits for every rank, as without partial rounds.

The window only says when a round *may* close: it still needs at least
`min_contributors` complete contributions and no upload half way through
(`gradsync_server.dataplane.rounds.RoundPolicy.may_close`).
"""

from __future__ import annotations

import logging
import statistics
from collections import deque
from collections.abc import Iterable
from typing import Protocol

__all__ = [
    "CEILING_S",
    "FLOOR_S",
    "HISTORY",
    "GraceWindow",
    "K",
    "WindowObserver",
    "round_closed",
    "round_estimate",
]

log = logging.getLogger("gradsync.server")

#: How many MADs beyond the median arrival an estimate reaches.
K = 3.0
#: Rounds whose estimates the window is the median of.
HISTORY = 3
#: The narrowest window, in seconds (the coordinator checks deadlines every ~0.25 s).
FLOOR_S = 0.5
#: The widest window, in seconds.
CEILING_S = 600.0


def round_estimate(arrivals: Iterable[float]) -> float | None:
    """median + K * MAD of one round's arrivals, the first (0) left out; None if none is left."""
    ordered = sorted(arrivals)[1:]
    if not ordered:
        return None
    middle = statistics.median(ordered)
    spread = statistics.median(abs(a - middle) for a in ordered)
    return middle + K * spread


class GraceWindow:
    """The automatic deadline of one job's rounds, from the arrivals of its recent rounds."""

    def __init__(self) -> None:
        self._estimates: deque[float] = deque(maxlen=HISTORY)
        #: Seconds into the open round at which each rank's contribution was complete.
        self._arrived: dict[int, float] = {}

    def deadline_s(self) -> float | None:
        """Seconds from a round's first contribution after which it may close (None: wait
        for every rank: no round closed with everyone yet)."""
        if not self._estimates:
            return None
        return min(CEILING_S, max(FLOOR_S, statistics.median(self._estimates)))

    def arrived(self, rank: int, age_s: float) -> None:
        """`rank`'s contribution to the open round is complete, `age_s` into the round."""
        self._arrived.setdefault(rank, age_s)

    def closed(self, expected: Iterable[int], age_s: float, count: bool = True) -> tuple[int, ...]:
        """The open round closed `age_s` after its first contribution; the ranks of
        `expected` that missed it (its estimate counts them at `age_s`). Starts the next.

        Args:
            count: False for a round that says nothing about the ranks' pace (the seed
                round, whose arrivals are the ranks' start-up): no estimate, no miss.
        """
        arrived, self._arrived = self._arrived, {}
        if not count:
            return ()
        ranks = set(expected) | set(arrived)
        missed = tuple(sorted(r for r in ranks if r not in arrived))
        if missed and not self._estimates:
            return ()  # no window yet: the round waited for every live rank
        estimate = round_estimate([arrived.get(r, age_s) for r in ranks])
        if estimate is not None:
            self._estimates.append(estimate)
        return missed


class WindowObserver(Protocol):
    """Who measures the window (`gradsync_server.metrics.CoordinatorMetrics`)."""

    def observe_round_window(self, window_s: float | None, missed: tuple[int, ...]) -> None:
        """A round closed: the window for the next one, and the ranks that missed it."""


def round_closed(
    window: GraceWindow,
    job_id: str,
    step: int,
    expected: Iterable[int],
    age_s: float,
    count: bool,
    observer: WindowObserver | None,
) -> tuple[int, ...]:
    """Round `step` of `job_id` closed: feed `window`, tell `observer`, log who missed it
    and a changed window. Returns the ranks that missed it."""
    before = window.deadline_s()
    missed = window.closed(expected, age_s, count)
    after = window.deadline_s()
    if observer is not None and count:
        observer.observe_round_window(after, missed)
    if missed:
        log.warning(
            "job %r round %d closed after %.3f s without rank(s) %s (grace window %s): "
            "their contributions are late",
            job_id,
            step,
            age_s,
            list(missed),
            _seconds(before),
        )
    if after is not None and (before is None or abs(after - before) > 0.1 * before):
        log.info(
            "job %r grace window %s from round %d (was %s)",
            job_id,
            _seconds(after),
            step + 1,
            _seconds(before),
        )
    return missed


def _seconds(value: float | None) -> str:
    return "none" if value is None else f"{value:.3f} s"
