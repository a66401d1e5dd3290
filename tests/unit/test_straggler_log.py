"""The coordinator names a rank that stays behind once, then reminds every few minutes.

Why: a long run with one slower host logged the same "persistently behind" line every
10 s for hours (and a harness that piped the coordinator's stderr without reading it
hung once the pipe filled).
"""

from __future__ import annotations

import logging
from types import SimpleNamespace
from typing import Any

import pytest
from gradsync_server.metrics import CoordinatorMetrics
from gradsync_server.rpc.watchdog import Watchdog


def test_a_rank_behind_is_named_at_once_then_every_few_minutes_and_again_after_recovery(
    caplog: pytest.LogCaptureFixture,
) -> None:
    now = [0.0]
    metrics = CoordinatorMetrics()
    coordinator: Any = SimpleNamespace(clock=lambda: now[0], metrics=metrics)
    watchdog = Watchdog(coordinator)
    tracker = metrics.lag_tracker
    for _ in range(20):
        tracker.record(0, 0.0)
        tracker.record(1, 0.2)

    def named_at(seconds: list[float]) -> list[float]:
        times = []
        for t in seconds:
            now[0] = t
            caplog.clear()
            with caplog.at_level(logging.WARNING, logger="gradsync.server"):
                watchdog._report_stragglers()
            if any("rank 1 is persistently behind" in r.getMessage() for r in caplog.records):
                times.append(t)
        return times

    # (the watchdog looks at most every 10 s)
    assert named_at([0.0, 10.0, 20.0, 150.0, 290.0, 300.0, 310.0]) == [0.0, 300.0]
    for _ in range(60):  # rank 1 catches up: no longer behind, forgotten
        tracker.record(1, 0.0)
    assert named_at([320.0]) == []
    for _ in range(60):  # and falls behind again: named at once
        tracker.record(1, 0.2)
    assert named_at([330.0]) == [330.0]
