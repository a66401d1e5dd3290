"""A local leader's bookkeeping (`gradsync.local.local_schedule`): when a bucket is reduced,
deferred, handed off, and whom it waits for. Pure logic; the sockets and processes around
it are in tests/multiprocess/test_local_group_processes.py."""

from __future__ import annotations

from gradsync.local.local_schedule import LeaderSchedule

F32 = 1


def test_a_bucket_is_reduced_once_every_live_member_posted_and_handed_off_once_summed() -> None:
    schedule = LeaderSchedule(3)
    assert schedule.post(0, 5, 0, F32) and schedule.post(2, 5, 0, F32)
    assert schedule.start(5, 0, excluded=set(), gone=set()) is None  # slot 1 has not posted
    assert schedule.unposted(5, 2) == [(0, [1]), (1, [0, 1, 2])]
    schedule.post(1, 5, 0, F32)
    pending = schedule.start(5, 0, excluded=set(), gone=set())
    assert pending is not None and pending.covered == (0, 1, 2) and pending.summed == {0}
    assert schedule.start(5, 0, excluded=set(), gone=set()) is None  # reducing already
    schedule.summed(5, 0, 1, [])
    assert schedule.finish(5, 0) is None  # slot 2's share is still out
    schedule.summed(5, 0, 2, [2])
    done = schedule.finish(5, 0)
    assert done is not None and done.nonfinite == {2}
    schedule.handed_off(5, 0)
    assert schedule.handed(5) == 1 and schedule.unposted(5, 2) == [(1, [0, 1, 2])]


def test_an_excluded_member_is_not_waited_for_and_keeps_what_it_posted() -> None:
    schedule = LeaderSchedule(3)
    for slot in (0, 1, 2):
        schedule.post(slot, 0, 0, F32)  # bucket 0: slot 2 posted before it froze
    schedule.post(0, 0, 1, F32)
    schedule.post(1, 0, 1, F32)
    assert schedule.start(0, 1, excluded=set(), gone=set()) is None
    bucket1 = schedule.start(0, 1, excluded={2}, gone={2})
    assert bucket1 is not None and bucket1.covered == (0, 1) and bucket1.summed == {0, 2}
    bucket0 = schedule.start(0, 0, excluded={2}, gone={2})
    assert bucket0 is not None and bucket0.covered == (0, 1, 2)


def test_a_member_that_left_owes_its_shares_to_the_leader() -> None:
    schedule = LeaderSchedule(2)
    schedule.post(0, 3, 0, F32)
    schedule.post(1, 3, 0, F32)
    schedule.start(3, 0, excluded=set(), gone=set())
    [(key, pending)] = schedule.owed_by(1)
    assert key == (3, 0) and pending.summed == {0, 1}
    assert schedule.owed_by(1) == []
    assert schedule.finish(3, 0) is pending


def test_no_reduce_while_a_member_still_copies_the_previous_averages() -> None:
    schedule = LeaderSchedule(2)
    schedule.published(0, readers=[1])
    schedule.post(0, 1, 0, F32)
    schedule.post(1, 1, 0, F32)
    assert schedule.start(1, 0, excluded=set(), gone=set()) is None  # deferred
    assert schedule.take_deferred() == []  # slot 1 has not said COPIED
    schedule.copied(1)
    assert schedule.take_deferred() == [(1, 0)]
    assert schedule.start(1, 0, excluded=set(), gone=set()) is not None


def test_posts_of_a_step_the_others_left_are_dropped_and_older_steps_forgotten() -> None:
    schedule = LeaderSchedule(2)
    schedule.post(0, 4, 0, F32)
    assert schedule.post(1, 5, 0, F32)  # step 4 was aborted: step 5 began
    assert schedule.keys() == [(5, 0)]
    assert not schedule.post(1, 4, 1, F32)
