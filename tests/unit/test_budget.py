"""ByteBudget and its reservations: callers state what they hold, the budget adds it up."""

from __future__ import annotations

import pytest
from gradsync_server.dataplane.budget import ByteBudget


def test_reservations_hold_absolute_amounts_per_owner() -> None:
    budget = ByteBudget(100)
    first = budget.reserve("job-a")
    second = budget.reserve("job-a")
    other = budget.reserve("job-b")
    first.hold(30)
    first.hold(40)  # an absolute figure: 40 held, not 70
    second.hold(10)
    other.hold(25)
    assert (budget.used, budget.held_by("job-a"), budget.held_by("job-b")) == (75, 50, 25)
    assert budget.fits(25) and not budget.fits(26)
    first.hold(0)
    assert (budget.used, first.held) == (35, 0)


def test_release_returns_exactly_what_was_held_once() -> None:
    budget = ByteBudget(100)
    reservation = budget.reserve("job")
    reservation.hold(60)
    reservation.release()
    reservation.release()  # idempotent: every path that frees a step may call it
    assert (budget.used, budget.held_by("job"), reservation.held) == (0, 0, 0)
    with pytest.raises(RuntimeError, match="used after release"):
        reservation.hold(1)


def test_bad_amounts_are_refused() -> None:
    with pytest.raises(ValueError, match="must be positive"):
        ByteBudget(0)
    with pytest.raises(ValueError, match="cannot hold -1 bytes"):
        ByteBudget(10).reserve("job").hold(-1)
