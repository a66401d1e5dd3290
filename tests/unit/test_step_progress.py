"""Who a step waits for when only local leaders upload (`StepProgress.record_posted`)."""

from __future__ import annotations

from gradsync_server.dataplane.progress import StepProgress


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_posted_member_is_delivered_and_its_silent_peer_is_late() -> None:
    clock = _Clock()
    progress = StepProgress([2, 1], clock)
    assert progress.record_posted(0, 0) == 0.0  # rank 0 (the leader) posted bucket 0
    clock.now = 1.5
    assert progress.late_ranks([0, 1]) == {1: [0]}
    assert progress.record_posted(1, 0) == 1.5  # its lag behind the first
    assert progress.late_ranks([0, 1]) == {}


def test_the_leaders_chunks_add_nothing_for_a_rank_already_posted() -> None:
    progress = StepProgress([2], _Clock())
    progress.record_posted(1, 0)
    assert progress.record(1, 0) is None and progress.record(1, 0) is None
    # A rank that posted nothing still completes through the leader's covering chunks.
    assert progress.record(2, 0) is None and progress.record(2, 0) == 0.0
    assert progress.record_posted(2, 0) is None  # already complete: no second lag
    assert progress.late_ranks([1, 2]) == {}
