"""A restarted coordinator's choice between the ranks' own state and the checkpoint."""

from __future__ import annotations

import pytest
from gradsync_proto.v1 import gradsync_pb2 as pb
from gradsync_server.control import restart
from gradsync_server.errors import RejectedMessage

A, B = b"a" * 32, b"b" * 32


def at(step: int, digest: bytes = A) -> pb.Position:
    return pb.Position(step=step, digest=digest)


def test_no_position_keeps_the_old_start() -> None:
    assert restart.decide("j", {0: None, 1: None}, 4) is None


def test_ranks_that_agree_continue_and_nothing_is_recomputed() -> None:
    decision = restart.decide("j", {0: at(7), 1: at(7)}, 4)
    assert isinstance(decision, restart.Continue)
    assert (decision.step, decision.keep, decision.behind) == (7, (0, 1), ())
    assert "nothing rolled back" in decision.line
    assert restart.steps_recomputed(decision, 7) == 0


def test_ranks_behind_and_fresh_ranks_take_the_lowest_ahead_rank_state() -> None:
    decision = restart.decide("j", {0: at(6, B), 1: at(7), 2: None, 3: at(7)}, None)
    assert isinstance(decision, restart.Continue)
    assert (decision.step, decision.donor, decision.behind) == (7, 1, (0, 2))
    assert "rank(s) [0, 2] behind took rank 1's state" in decision.line


def test_ranks_ahead_that_disagree_fall_back_to_the_checkpoint() -> None:
    decision = restart.decide("j", {0: at(7), 1: at(7, B)}, 4)
    assert isinstance(decision, restart.Fallback)
    assert "disagree" in decision.line and "checkpoint of step 4" in decision.line
    assert "[0] hold 616161" in decision.line and "[1] hold 626262" in decision.line
    assert restart.steps_recomputed(decision, 4) == 6  # (7 - 4) on each rank


def test_a_checkpoint_newer_than_every_rank_wins() -> None:
    decision = restart.decide("j", {0: at(3), 1: at(3)}, 5)
    assert isinstance(decision, restart.Fallback) and "ahead of every rank" in decision.line


def test_a_digest_that_is_not_a_sha256_is_refused_naming_rank_and_both_sizes() -> None:
    with pytest.raises(RejectedMessage) as info:
        restart.check_position(3, pb.Position(step=9, digest=b"x" * 5))
    assert "rank 3" in info.value.message and "5-byte" in info.value.message
    assert "32-byte" in info.value.message
