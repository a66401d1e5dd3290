"""Time to detect, time to recover and restarts (gradsync_server.recovery_metrics), fake clock."""

from __future__ import annotations

from gradsync_server.recovery_metrics import RecoveryMetrics
from prometheus_client import CollectorRegistry


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _value(registry: CollectorRegistry, name: str, **labels: str) -> float:
    value = registry.get_sample_value(name, labels)
    assert value is not None, (name, labels)
    return value


def test_a_lost_rank_is_detected_and_recovers_at_the_next_step() -> None:
    registry, clock = CollectorRegistry(), _Clock()
    recovery = RecoveryMetrics(registry, clock)
    recovery.step_done()  # nothing pending: nothing observed
    assert _value(registry, "gradsync_failure_recover_seconds_count", kind="rank") == 0
    recovery.rank_lost(2.2)
    clock.now += 0.5
    recovery.rank_lost(0.1)  # a second loss before any step: the clock runs from the first
    clock.now += 1.0
    recovery.step_done()
    recovery.step_done()  # recovered once, not per step
    assert _value(registry, "gradsync_failure_detect_seconds_count") == 2
    assert abs(_value(registry, "gradsync_failure_detect_seconds_sum") - 2.3) < 1e-9
    assert _value(registry, "gradsync_failure_recover_seconds_count", kind="rank") == 1
    assert _value(registry, "gradsync_failure_recover_seconds_sum", kind="rank") == 1.5


def test_a_restart_recovers_from_the_takeover_not_from_process_start() -> None:
    registry, clock = CollectorRegistry(), _Clock()
    recovery = RecoveryMetrics(registry, clock)
    clock.now += 60.0  # a standby waits a minute
    recovery.became_active(fence=2)
    clock.now += 1.5
    recovery.restarted(continued=True, steps_recomputed=0)
    clock.now += 0.5
    recovery.step_done()
    assert _value(registry, "gradsync_restarts_total", outcome="continued") == 1
    assert _value(registry, "gradsync_restarts_total", outcome="checkpoint") == 0
    assert _value(registry, "gradsync_failure_recover_seconds_sum", kind="coordinator") == 2.0
    recovery.restarted(continued=False, steps_recomputed=6)
    assert _value(registry, "gradsync_restarts_total", outcome="checkpoint") == 1
    assert _value(registry, "gradsync_steps_recomputed_total") == 6
    summary = recovery.summary()  # what `gradsync status` shows
    assert (summary.fence, summary.takeovers) == (2, 1)
    assert (summary.restarts_continued, summary.restarts_checkpoint) == (1, 1)
    assert summary.steps_recomputed == 6 and summary.last_restart_recover_s == 2.0
    recovery.lease_lost()
    assert recovery.summary().fence == 0
