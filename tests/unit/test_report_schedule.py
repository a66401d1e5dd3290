"""`ReportSchedule`: a StepReport goes out when it says something new, else every N steps."""

from __future__ import annotations

import pytest
from gradsync_proto.v1 import gradsync_pb2 as pb
from gradsync_server.dataplane.actions import Send
from gradsync_server.dataplane.observer import ReportSchedule


class Slowest:
    """Just enough of a StepObserver: who is slowest, by how much."""

    def __init__(self) -> None:
        self.ranking: list[tuple[int, float]] = []

    def slowest(self, k: int) -> list[tuple[int, float]]:
        return self.ranking[:k]


def sent(actions: list[object]) -> tuple[tuple[int, ...], pb.StepReport] | None:
    if not actions:
        return None
    (action,) = actions
    assert isinstance(action, Send) and isinstance(action.message, pb.CoordinatorMessage)
    return tuple(action.ranks), action.message.step_report


def test_the_first_report_goes_out_and_a_repeat_waits_for_every_steps() -> None:
    schedule, observer = ReportSchedule(every=4), Slowest()
    observer.ranking = [(2, 0.01)]
    first = sent(schedule.report(0, (0, 1, 2), observer))  # type: ignore[arg-type]
    assert first is not None and first[0] == (0,)
    assert (first[1].step, first[1].slowest_rank) == (0, 2)
    assert [sent(schedule.report(s, (0, 1, 2), observer)) for s in (1, 2, 3)] == [None] * 3  # type: ignore[arg-type]
    again = sent(schedule.report(4, (0, 1, 2), observer))  # type: ignore[arg-type]
    assert again is not None and again[1].step == 4


def test_a_new_slowest_rank_or_a_new_lowest_rank_is_reported_at_once() -> None:
    schedule, observer = ReportSchedule(every=100), Slowest()
    observer.ranking = [(2, 0.01)]
    assert sent(schedule.report(0, (0, 1, 2), observer)) is not None  # type: ignore[arg-type]
    observer.ranking = [(1, 0.02)]
    moved = sent(schedule.report(1, (0, 1, 2), observer))  # type: ignore[arg-type]
    assert moved is not None and moved[1].slowest_rank == 1
    lost_rank_0 = sent(schedule.report(2, (1, 2), observer))  # type: ignore[arg-type]
    assert lost_rank_0 is not None and lost_rank_0[0] == (1,)
    observer.ranking = []  # nobody lags any more
    caught_up = sent(schedule.report(3, (1, 2), None))
    assert caught_up is not None and caught_up[1].slowest_rank == -1
    assert sent(schedule.report(4, (1, 2), None)) is None


def test_a_restarted_step_count_reports_again() -> None:
    # A job resumed from an earlier checkpoint counts steps from there: not "too soon".
    schedule, observer = ReportSchedule(every=8), Slowest()
    assert sent(schedule.report(50, (0, 1), observer)) is not None  # type: ignore[arg-type]
    assert sent(schedule.report(40, (0, 1), observer)) is not None  # type: ignore[arg-type]


def test_no_participants_no_report_and_every_must_be_positive() -> None:
    assert ReportSchedule().report(0, (), None) == []
    with pytest.raises(ValueError, match="every"):
        ReportSchedule(every=0)
