"""The adaptive grace window of DiLoCo rounds (`round_deadline_s="auto"`) as pure code.

`round_estimate` (median + K * MAD of a round's arrivals), `GraceWindow` (the median
of the last rounds' estimates, its floor, no window before a complete round, ranks
that missed it counted at the round's close), how `RoundPolicy.may_close` uses it
(never below the quorum), the coordinator's and the client's checks of the setting,
and the metrics and log line of a round that closed without someone.
"""

from __future__ import annotations

import logging

import pytest
from gradsync.diloco_settings import straggler_settings
from gradsync_proto.v1 import gradsync_pb2 as pb
from gradsync_server.dataplane.grace import (
    CEILING_S,
    FLOOR_S,
    HISTORY,
    GraceWindow,
    K,
    round_closed,
    round_estimate,
)
from gradsync_server.dataplane.late import Stragglers
from gradsync_server.dataplane.rounds import RoundPolicy, policy_problem
from gradsync_server.metrics import CoordinatorMetrics

RANKS = (0, 1, 2, 3)


def close(
    window: GraceWindow, arrivals: dict[int, float], age_s: float, ranks: tuple[int, ...] = RANKS
) -> tuple[int, ...]:
    for rank, at in arrivals.items():
        window.arrived(rank, at)
    return window.closed(ranks, age_s)


def slow_round(window: GraceWindow, arrivals: dict[int, float]) -> tuple[int, ...]:
    """A round that closes at the window if someone is later than it, else with the last."""
    deadline = window.deadline_s()
    assert deadline is not None
    on_time = {r: t for r, t in arrivals.items() if t <= deadline}
    age = deadline if len(on_time) < len(arrivals) else max(arrivals.values())
    return close(window, on_time, age, tuple(arrivals))


def test_a_rounds_estimate_is_median_plus_k_mads_of_its_arrivals_after_the_first() -> None:
    # The first arrival (0) is left out: 1, 2, 4 -> median 2, deviations 1, 0, 2 -> MAD 1.
    assert round_estimate([0.0, 4.0, 1.0, 2.0]) == 2.0 + K * 1.0
    assert round_estimate([0.0, 3.0]) == 3.0
    assert round_estimate([0.0]) is None  # one rank: nothing to learn


def test_no_window_until_a_round_closed_with_every_rank_then_at_least_the_floor() -> None:
    window = GraceWindow()
    assert window.deadline_s() is None
    # A round missing a rank before any window: no miss counted, no estimate.
    assert close(window, {0: 0.0, 1: 0.01, 2: 0.02}, 0.05) == ()
    assert window.deadline_s() is None
    assert close(window, {0: 0.0, 1: 0.01, 2: 0.02, 3: 0.03}, 0.03) == ()
    assert window.deadline_s() == FLOOR_S  # 0.02 + 3 * 0.01 is below the floor
    for _ in range(HISTORY):
        close(window, {0: 0.0, 1: 1.0, 2: 2.0, 3: 3.0}, 3.0)
    assert window.deadline_s() == 2.0 + K * 1.0
    window = GraceWindow()
    for _ in range(HISTORY):
        close(window, {0: 0.0, 1: 1e4, 2: 2e4, 3: 3e4}, 3e4)
    assert window.deadline_s() == CEILING_S


def test_the_window_widens_for_a_rank_slowed_3x_and_settles_within_2_rounds_after() -> None:
    """W = 3: rank 2 takes 3x as long for six rounds, then recovers. A round that closed
    without it counts it at the close, which pushes the estimates out until it makes the
    window; 2 rounds after it recovered the window is back where it was."""
    window = GraceWindow()
    normal = {0: 0.0, 1: 0.6, 2: 0.9}
    close(window, normal, 0.9, (0, 1, 2))
    for _ in range(3):
        assert slow_round(window, normal) == ()
    settled = window.deadline_s()
    assert settled == pytest.approx(0.75 + K * 0.15)
    windows, missed = [], []
    for _ in range(6):
        missed.append(slow_round(window, {**normal, 2: 2.7}))
        windows.append(window.deadline_s())
    assert missed[0] == (2,)  # a sudden change is missed first
    assert max(w for w in windows if w is not None) >= 2.7  # then waited for
    assert missed[-1] == ()
    after = []
    for _ in range(3):  # recovered
        assert slow_round(window, normal) == ()
        after.append(window.deadline_s())
    assert after[1] == settled  # two rounds after the recovery
    assert after[2] == settled


def test_in_a_larger_group_one_slow_rank_is_an_outlier_the_window_does_not_wait_for() -> None:
    window = GraceWindow()
    normal = {0: 0.0, 1: 0.2, 2: 0.3, 3: 0.4, 4: 0.5, 5: 0.6}
    close(window, normal, 0.6, tuple(normal))
    for _ in range(10):
        assert slow_round(window, {**normal, 5: 1.8}) == (5,)
    # The others' spread, with rank 5 counted at the close (0.7 s): 0.4 + 3 * 0.1.
    assert window.deadline_s() == pytest.approx(0.4 + K * 0.1)


def test_one_odd_round_does_not_move_the_window() -> None:
    window = GraceWindow()
    for _ in range(3):
        close(window, {0: 0.0, 1: 0.5, 2: 1.0, 3: 1.5}, 1.5)
    before = window.deadline_s()
    close(window, {0: 0.0, 1: 5.0, 2: 9.0, 3: 20.0}, 20.0)
    assert window.deadline_s() == before


def test_may_close_follows_the_window_and_never_closes_below_the_quorum() -> None:
    policy = RoundPolicy(min_contributors=2, auto=True)
    ranks = (0, 1, 2)
    assert policy.may_close(99.0, ranks, (0, 1), (0, 1), None) == ()  # no window yet
    assert policy.may_close(0.4, ranks, (0, 1), (0, 1), 0.5) == ()
    assert policy.may_close(0.5, ranks, (0, 1), (0, 1), 0.5) == (2,)
    assert policy.may_close(99.0, ranks, (0,), (0,), 0.5) == ()  # below the quorum
    assert policy.may_close(99.0, ranks, (0, 1), (0, 1, 2), 0.5) == ()  # 2 is uploading
    # A fixed deadline ignores the window.
    assert RoundPolicy(2, 1.0).may_close(0.6, ranks, (0, 1), (0, 1), 0.5) == ()


def test_the_policy_reads_the_field_and_stragglers_hold_a_window_only_when_auto() -> None:
    outer = pb.OuterOptimizer(lr=0.7, min_contributors=2, round_deadline_auto=True)
    assert RoundPolicy.of(outer).auto
    assert Stragglers(RoundPolicy.of(outer)).window is not None
    assert Stragglers(RoundPolicy(2, 1.0)).window is None


@pytest.mark.parametrize(
    ("fields", "needle"),
    [
        ({"round_deadline_auto": True}, "round_deadline_auto needs min_contributors"),
        (
            {"round_deadline_auto": True, "min_contributors": 2, "round_deadline_s": 3.0},
            "both set",
        ),
    ],
)
def test_the_coordinator_refuses_an_auto_deadline_it_cannot_run(
    fields: dict[str, object], needle: str
) -> None:
    problem = policy_problem(pb.OuterOptimizer(lr=0.7, **fields))  # type: ignore[arg-type]
    assert problem is not None and needle in problem
    assert (
        policy_problem(pb.OuterOptimizer(lr=0.7, min_contributors=2, round_deadline_auto=True))
        is None
    )


def test_the_client_sends_auto_and_refuses_other_words() -> None:
    fields = straggler_settings(2, "auto", "drop", None, False, 3)
    assert fields == {"min_contributors": 2, "round_deadline_s": 0.0, "round_deadline_auto": True}
    assert straggler_settings(None, "auto", "drop", None, False, 3)["min_contributors"] == 1
    with pytest.raises(ValueError, match="round_deadline_s must be a number of seconds or"):
        straggler_settings(2, "adaptive", "drop", None, False, 3)
    assert "round_deadline_auto" not in straggler_settings(2, 3.0, "drop", None, False, 3)


def test_a_missed_round_is_counted_per_rank_logged_by_name_and_the_window_exported(
    caplog: pytest.LogCaptureFixture,
) -> None:
    metrics = CoordinatorMetrics()
    window = GraceWindow()
    for rank, at in {0: 0.0, 1: 0.1, 2: 0.2}.items():
        window.arrived(rank, at)
    with caplog.at_level(logging.INFO, logger="gradsync.server"):
        # The seed round counts nothing.
        assert round_closed(window, "j", 0, (0, 1, 2), 0.2, False, metrics) == ()
        assert metrics.registry.get_sample_value("gradsync_round_window_seconds") == 0.0
        for rank, at in {0: 0.0, 1: 0.1, 2: 0.2}.items():
            window.arrived(rank, at)
        round_closed(window, "j", 1, (0, 1, 2), 0.2, True, metrics)
        assert metrics.registry.get_sample_value("gradsync_round_window_seconds") == FLOOR_S
        for rank, at in {0: 0.0, 1: 0.1}.items():
            window.arrived(rank, at)
        assert round_closed(window, "j", 2, (0, 1, 2), 0.6, True, metrics) == (2,)
    missed = metrics.registry.get_sample_value("gradsync_round_missed_total", {"rank": "2"})
    assert missed == 1.0
    assert metrics.registry.get_sample_value("gradsync_round_missed_total", {"rank": "1"}) is None
    lines = [r.getMessage() for r in caplog.records]
    assert any("round 2 closed after 0.600 s without rank(s) [2]" in line for line in lines)
    assert any("grace window 0.500 s from round 2 (was none)" in line for line in lines)
