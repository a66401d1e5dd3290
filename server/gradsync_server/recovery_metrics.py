"""What failures cost, as Prometheus series: time to detect, time to recover, steps recomputed.

The coordinator is the one place that sees a failure and the first step after
it, so it measures both ends:

- `gradsync_failure_detect_seconds`: from a lost rank's last sign of life (any
  message, heartbeats included) to the coordinator acting on the loss. A
  killed process closes its socket, so this is about a heartbeat interval; a
  frozen one or a cut link is found by the heartbeat timeout.
- `gradsync_failure_recover_seconds{kind}`: from the failure being acted on to
  the job's next completed step. `kind="rank"`: a rank was lost (elastic jobs
  go on without it; others end, and the clock stops at the next job's first
  step on this coordinator). `kind="coordinator"`: this coordinator restarted
  a job (it started, or a standby took the lease over) and the clock runs from
  then; the workers' own time to notice and reconnect is inside it.
- `gradsync_restarts_total{outcome}`: restarted jobs, `continued` from the
  ranks' own state or `checkpoint` (rolled back), and
  `gradsync_steps_recomputed_total`, the steps the ranks had applied beyond
  where a job went on (0 when it continued), summed over ranks.

Kept apart from `gradsync_server.metrics` (the per-chunk and per-step series)
because these are rare events with clocks of their own.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from gradsync_proto.v1 import gradsync_pb2 as pb
from prometheus_client import CollectorRegistry, Counter, Histogram

#: Seconds: a heartbeat interval to a few minutes of reconnecting.
RECOVERY_BUCKETS_S = (0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 3.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0)


class RecoveryMetrics:
    """The failure series of one coordinator.

    Args:
        registry: where they are registered (the coordinator's own).
        clock: monotonic seconds (tests pass a fake one).
    """

    def __init__(
        self, registry: CollectorRegistry, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._clock = clock
        self._detect = Histogram(
            "gradsync_failure_detect_seconds",
            "From a lost rank's last sign of life to the coordinator acting on its loss.",
            buckets=RECOVERY_BUCKETS_S,
            registry=registry,
        )
        self._recover = Histogram(
            "gradsync_failure_recover_seconds",
            "From a failure acted on (kind: a rank lost, or a job restarted by this "
            "coordinator) to the next completed step.",
            ["kind"],
            buckets=RECOVERY_BUCKETS_S,
            registry=registry,
        )
        self._restarts = Counter(
            "gradsync_restarts",
            "Jobs this coordinator restarted, by outcome: continued from the ranks' own "
            "state, or rolled back to the checkpoint.",
            ["outcome"],
            registry=registry,
        )
        self._recomputed = Counter(
            "gradsync_steps_recomputed",
            "Steps the ranks had applied beyond where a restarted job went on, summed over ranks.",
            registry=registry,
        )
        for outcome in ("continued", "checkpoint"):
            self._restarts.labels(outcome)
        for kind in ("rank", "coordinator"):
            self._recover.labels(kind)
        #: When this coordinator became the active one (its start, or a takeover).
        self._active_since = clock()
        #: Failures waiting for the next completed step: kind -> when acted on.
        self._pending: dict[str, float] = {}
        #: The same figures as plain values, for `gradsync status` (`summary`).
        self._summary = pb.Recovery()

    def became_active(self, fence: int) -> None:
        """A standby took the lease over: a restart's clock starts now, not at process start."""
        self._active_since = self._clock()
        self._summary.fence = fence
        self._summary.takeovers += 1

    def rank_lost(self, silent_s: float) -> None:
        """A rank was lost, `silent_s` after its last sign of life."""
        silent_s = max(0.0, silent_s)
        self._detect.observe(silent_s)
        self._pending.setdefault("rank", self._clock())
        self._summary.ranks_lost += 1
        self._summary.last_detect_s = silent_s

    def restarted(self, continued: bool, steps_recomputed: int) -> None:
        """This coordinator restarted a job: from the ranks' own state, or a checkpoint."""
        self._restarts.labels("continued" if continued else "checkpoint").inc()
        self._recomputed.inc(steps_recomputed)
        self._pending.setdefault("coordinator", self._active_since)
        summary = self._summary
        if continued:
            summary.restarts_continued += 1
        else:
            summary.restarts_checkpoint += 1
        summary.steps_recomputed += steps_recomputed

    def step_done(self) -> None:
        """A step completed: every failure waiting for one has recovered."""
        if not self._pending:
            return
        now = self._clock()
        for kind, since in self._pending.items():
            self._recover.labels(kind).observe(now - since)
            if kind == "rank":
                self._summary.last_rank_recover_s = now - since
            else:
                self._summary.last_restart_recover_s = now - since
        self._pending.clear()

    def lease_lost(self) -> None:
        """This coordinator no longer holds the lease."""
        self._summary.fence = 0

    def summary(self) -> pb.Recovery:
        """The figures so far, for StatusReply.recovery."""
        summary = pb.Recovery()
        summary.CopyFrom(self._summary)
        return summary
