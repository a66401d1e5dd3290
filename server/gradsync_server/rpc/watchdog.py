"""The coordinator's watchdog: declare silent workers dead, warn about stalled steps.

Architecture invariant 6 (no silent hang) cannot rest on messages alone: a
worker whose host froze sends nothing, and no message handler runs to notice.
This background task wakes a few times per heartbeat timeout, asks each job
which ranks have been silent too long (`Liveness`), and has the servicer end
them; it also names steps that wait too long and ranks whose buckets are
persistently late, and refreshes the membership gauges. While a job
assembles it also tells the waiting ranks, and the log, every ~10 s who is
still missing; a waiting rank that went silent is dropped from the
assembling job (it may join again) rather than failing it. It reads the
coordinator through the small `Watched` protocol, so it depends on no stream
machinery, and `check` is one synchronous pass that tests drive with a fake
clock. Checks of other parts of the coordinator (the shards' liveness) ride
along as `extra_checks`, so one task watches everything.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Callable, Sequence
from typing import Protocol

from gradsync_server.config import CoordinatorConfig
from gradsync_server.control.job import Job, JobState
from gradsync_server.dataplane.actions import Action
from gradsync_server.metrics import CoordinatorMetrics

log = logging.getLogger("gradsync.server")

#: How often the watchdog looks for ranks persistently behind.
_STRAGGLER_REPORT_PERIOD_S = 10.0
#: How often one rank that stays behind is named again: a long run with a slower host
#: gets a reminder, not a line every few seconds.
_STRAGGLER_REPEAT_S = 300.0
#: A rank is "behind" when its buckets (a process group's: its collective inputs) arrive
#: this much after the first rank's on average...
_STRAGGLER_THRESHOLD_S = 0.05
#: ...over at least this many buckets or collectives.
_STRAGGLER_MIN_SAMPLES = 10
#: The longest the watchdog sleeps between passes.
_MAX_PERIOD_S = 0.25


def log_rank_lost(job: Job, rank: int, what: str) -> None:
    """Log that `rank` of `job` was lost (`what` happened to it), and what that means."""
    if job.state is JobState.ASSEMBLING:
        log.warning(
            "job '%s': rank %d %s while waiting for the others; dropped from the assembling "
            "job (it may join again)",
            job.job_id,
            rank,
            what,
        )
    else:
        log.warning("job '%s': rank %d %s at step %d", job.job_id, rank, what, job.open_step)


class Watched(Protocol):
    """What the watchdog needs from the coordinator."""

    config: CoordinatorConfig
    metrics: CoordinatorMetrics
    jobs: dict[str, Job]
    clock: Callable[[], float]

    def connection_count(self) -> int:
        """Worker streams currently joined to a job."""

    def declare_dead(self, job: Job, rank: int, details: str) -> None:
        """End `rank`'s stream and drop it from `job` (`details` says why)."""

    def execute(self, job: Job, actions: list[Action]) -> None:
        """Carry out `actions` of `job`."""

    def expire_assembly(self, job: Job, details: str) -> None:
        """Refuse `job`, which assembled for too long, and free its slot."""


class Watchdog:
    """Periodic liveness and stall checks over every job of one coordinator.

    Args:
        coordinator: what is watched.
        extra_checks: further checks run at the end of every pass.
    """

    def __init__(
        self, coordinator: Watched, extra_checks: Sequence[Callable[[], None]] = ()
    ) -> None:
        self._coordinator = coordinator
        self._extra_checks = tuple(extra_checks)
        self._next_straggler_report = 0.0
        #: When each rank now behind was last named (a rank that catches up is dropped).
        self._named_behind: dict[int, float] = {}

    async def run(self) -> None:
        """Check forever, a few times per heartbeat timeout (cancel to stop).

        A pass that wakes more than a period late means this event loop
        itself stood still (a long copy, a starved process): whatever the
        ranks sent meanwhile waits unread, so that pass judges no rank silent
        (`check`'s `judge_silence`); the next one, a period later, has read it.
        Why: under load a 1 GB heal blob copied on the loop held it for more
        than a 2 s heartbeat timeout, and the donor was declared dead for it.
        """
        period = min(_MAX_PERIOD_S, self._coordinator.config.heartbeat_timeout_s / 4)
        loop = asyncio.get_running_loop()
        while True:
            woken_at = loop.time() + period
            await asyncio.sleep(period)
            late_s = loop.time() - woken_at
            if late_s > period:
                log.warning(
                    "the coordinator's event loop stood still for %.1fs; no rank is judged "
                    "silent for it",
                    late_s,
                )
            try:
                self.check(judge_silence=late_s <= period)
            except Exception:  # the watchdog must outlive any bug in one check
                log.exception("liveness check failed")

    def check(self, judge_silence: bool = True) -> None:
        """One pass: gauges, stragglers, silent ranks (unless not `judge_silence`), stalls."""
        coordinator = self._coordinator
        coordinator.metrics.set_membership(
            coordinator.connection_count(),
            max((job.membership_epoch for job in coordinator.jobs.values()), default=0),
            len(coordinator.jobs),
        )
        self._report_stragglers()
        timeout = coordinator.config.heartbeat_timeout_s
        for job in list(coordinator.jobs.values()):
            for rank in job.silent_ranks(timeout) if judge_silence else []:
                details = (
                    f"was declared dead after {timeout:g}s without a heartbeat (heartbeat timeout)"
                )
                log_rank_lost(job, rank, details)
                coordinator.declare_dead(job, rank, details)
            if self._assembly_expired(job):
                continue
            report = job.assembly_report()
            if report is not None:
                actions, line = report
                log.info("%s", line)
                coordinator.execute(job, actions)
            self._warn_if_stalled(job)
            closed = job.close_round_if_due()  # a DiLoCo round's deadline passed
            if closed:
                coordinator.execute(job, closed)
        for extra_check in self._extra_checks:
            extra_check()

    def _assembly_expired(self, job: Job) -> bool:
        """Refuse a job whose ranks have not all joined within --assembly-timeout-s.

        Without this, Joins that never complete a job (64 quick ones, each
        under a new job id, kept alive by heartbeats) would hold every job slot
        forever.
        """
        limit = self._coordinator.config.assembly_timeout_s
        if job.state is not JobState.ASSEMBLING or job.membership.complete():
            return False
        waited = job.assembly.waited_s()
        if waited <= limit:
            return False
        missing = job.assembly.missing(job.membership.ranks())
        details = (
            f"job '{job.job_id}' did not assemble within {limit:g}s (--assembly-timeout-s): "
            f"ranks {missing} of {job.world_size} never joined; refused"
        )
        log.warning("%s", details)
        self._coordinator.expire_assembly(job, details)
        return True

    def _warn_if_stalled(self, job: Job) -> None:
        progress = job.in_flight.progress
        if (
            progress is None
            or progress.stall_warned
            or progress.age() <= self._coordinator.config.stall_warning_s
        ):
            return
        progress.stall_warned = True
        late = job.late_ranks()
        waiting = "; ".join(f"rank {r} (buckets {b})" for r, b in sorted(late.items()))
        log.warning(
            "job '%s': step %d has been waiting %.1fs for %s",
            job.job_id,
            job.open_step,
            progress.age(),
            waiting or "every rank (no bucket is complete yet)",
        )

    def _report_stragglers(self) -> None:
        """Every few seconds, name ranks whose buckets or collective inputs keep arriving late."""
        now = self._coordinator.clock()
        if now < self._next_straggler_report:
            return
        self._next_straggler_report = now + _STRAGGLER_REPORT_PERIOD_S
        tracker = self._coordinator.metrics.lag_tracker
        behind = tracker.persistently_behind(
            threshold_s=_STRAGGLER_THRESHOLD_S, min_samples=_STRAGGLER_MIN_SAMPLES
        )
        for rank in set(self._named_behind) - set(behind):
            del self._named_behind[rank]
        for rank in behind:
            if now - self._named_behind.get(rank, -math.inf) < _STRAGGLER_REPEAT_S:
                continue
            self._named_behind[rank] = now
            slowest = ", ".join(f"rank {r} {lag * 1e3:.0f} ms" for r, lag in tracker.slowest(3))
            log.warning(
                "rank %d is persistently behind: its buckets or collective inputs arrive %.0f ms "
                "after the first rank's on average (slowest: %s)",
                rank,
                (tracker.mean_lag(rank) or 0.0) * 1e3,
                slowest,
            )
