"""DiLoCo's straggler logic as pure code: closing rounds, late contributions, weights.

`RoundPolicy.may_close` (when a round closes without some ranks), `Stragglers`
(who owes a late round, what a round merges, the staleness bound, one contribution
per rank), weighted `BucketReduction`s against a reference and over every arrival
order, the checks of weights and settings, and the client's own checks of its
keyword arguments.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from gradsync.diloco_settings import check_samples, straggler_settings
from gradsync_proto.codec import ChunkHeader
from gradsync_proto.v1 import gradsync_pb2 as pb
from gradsync_server.dataplane.aggregation import BucketReduction, Magnitude
from gradsync_server.dataplane.late import Stragglers
from gradsync_server.dataplane.rounds import (
    MAX_WEIGHT,
    RoundPolicy,
    check_weight,
    job_problem,
    policy_problem,
)
from gradsync_server.errors import RejectedMessage

MEMBERS = {0: None, 1: None, 2: None}


def test_a_round_closes_at_its_deadline_with_k_and_excuses_only_ranks_that_sent_nothing() -> None:
    policy = RoundPolicy(min_contributors=2, deadline_s=1.0)
    ranks = (0, 1, 2)
    assert policy.may_close(None, ranks, (), ()) == ()  # nothing arrived yet
    assert policy.may_close(0.5, ranks, (0, 1), (0, 1)) == ()  # before the deadline
    assert policy.may_close(1.0, ranks, (0, 1), (0, 1)) == (2,)
    assert policy.may_close(1.0, ranks, (0,), (0,)) == ()  # fewer than k
    assert policy.may_close(9.0, ranks, (0, 1), (0, 1, 2)) == ()  # rank 2 is uploading
    assert policy.may_close(9.0, (0, 1, 2, 3), (0, 1), (0, 1)) == (2, 3)
    assert RoundPolicy().may_close(9.0, ranks, (0,), (0,)) == ()  # no partial rounds


def test_a_late_rank_owes_its_oldest_round_and_is_forgotten_once_it_delivered() -> None:
    stragglers = Stragglers(RoundPolicy(min_contributors=1))
    stragglers.excuse(2, 5)
    stragglers.excuse(2, 6)  # still owes round 5: it uploads that one first
    assert stragglers.owes(2, 5) and not stragglers.owes(2, 6) and not stragglers.owes(1, 5)
    assert stragglers.excused == {2}
    late = stragglers.late_upload(2, 5)
    assert late is stragglers.late_upload(2, 5)
    stragglers.finish_upload(2)
    assert not stragglers.owes(2, 5) and stragglers.dropped == 1
    assert stragglers.held_bytes() == 0  # dropped: nothing is kept
    stragglers.end_round()
    assert stragglers.excused == set()


def complete_late(stragglers: Stragglers, rank: int, step: int, payload: bytes) -> None:
    late = stragglers.late_upload(rank, step)
    late.weight = 1.0
    late.chunks_needed[0] = 1
    late.seen[0] = {0}
    late.kept[(0, 0)] = (pb.DTYPE_FLOAT32, payload, Magnitude.TAME)
    stragglers.finish_upload(rank)


@pytest.mark.parametrize(("round_number", "merged"), [(6, True), (7, True), (8, False)])
def test_a_complete_late_contribution_is_merged_within_the_staleness_bound_else_dropped(
    round_number: int, merged: bool
) -> None:
    stragglers = Stragglers(RoundPolicy(min_contributors=1, merge_late=True, max_staleness=2))
    stragglers.excuse(1, 5)
    complete_late(stragglers, 1, 5, bytes(8))
    assert stragglers.held_bytes() == 8  # kept until a round starts
    stragglers.begin(round_number, MEMBERS, bucket_count=1)
    assert [late.rank for late in stragglers.merging] == ([1] if merged else [])
    assert stragglers.dropped == (0 if merged else 1)
    assert stragglers.held_bytes() == 0


def test_an_incomplete_or_departed_late_contribution_is_not_merged() -> None:
    stragglers = Stragglers(RoundPolicy(min_contributors=1, merge_late=True, max_staleness=1))
    stragglers.excuse(1, 5)
    stragglers.late_upload(1, 5).chunks_needed[0] = 2  # one chunk of two arrived
    stragglers.excuse(2, 5)
    complete_late(stragglers, 2, 5, bytes(4))
    stragglers.begin(6, {0: None, 1: None}, bucket_count=1)  # rank 2 left the job
    assert stragglers.merging == []
    assert stragglers.held_bytes() == 0  # rank 2's is freed; rank 1's holds no bytes yet
    assert stragglers.owes(1, 5)


def weighted_reference(contributions: list[np.ndarray], weights: list[float]) -> np.ndarray:
    total = np.float32(weights[0]) * contributions[0]
    for values, weight in zip(contributions[1:], weights[1:], strict=True):
        total = total + np.float32(weight) * values
    return (total.astype(np.float64) / sum(weights)).astype(np.float32)  # divided in float64


def test_a_weighted_reduction_is_sum_w_g_over_sum_w_bitwise_for_every_arrival_order() -> None:
    rng = np.random.default_rng(7)
    contributions = [rng.standard_normal(1000).astype(np.float32) for _ in range(4)]
    weights = [3.0, 17.0, 1.0, 250.0]
    expected = weighted_reference(contributions, weights)
    for order in itertools.permutations(range(4)):
        reduction = BucketReduction(range(4), pb.DTYPE_FLOAT32, 4000, 4000)
        result = None
        for rank in order:
            payload = contributions[rank].tobytes()
            result = reduction.add(rank, 0, payload, sample_weight=weights[rank]) or result
        assert result is not None
        np.testing.assert_array_equal(np.frombuffer(result, "<f4"), expected)
    plain = np.sum(contributions, axis=0, dtype=np.float32) / np.float32(4)
    assert float(np.abs(expected - plain).max()) > 1e-3


def test_a_weighted_reduction_that_overflows_float32_takes_the_float64_mean() -> None:
    big = np.full(4, 3e38, dtype=np.float32)
    reduction = BucketReduction([0, 1], pb.DTYPE_FLOAT32, 16, 16)
    reduction.add(0, 0, big.tobytes(), sample_weight=1.0)
    result = reduction.add(1, 0, big.tobytes(), sample_weight=1.0)
    assert result is not None
    np.testing.assert_allclose(np.frombuffer(result, "<f4"), big, rtol=1e-6)


def header(weight: float, offset: int = 0) -> ChunkHeader:
    return ChunkHeader(step=4, bucket_index=1, offset=offset, weight=weight)


@pytest.mark.parametrize("weight", [float("nan"), float("inf"), -1.0, 0.0, MAX_WEIGHT * 2])
def test_bad_weights_are_refused_naming_rank_round_bucket_and_value(weight: float) -> None:
    with pytest.raises(RejectedMessage) as caught:
        check_weight(3, header(weight), True, None, "")
    message = caught.value.message
    assert "rank 3" in message and "round (step) 4" in message and "bucket 1" in message
    assert repr(weight) in message


def test_a_weight_must_stay_the_same_over_a_ranks_round_and_be_absent_unweighted() -> None:
    assert check_weight(3, header(2.5), True, None, "") == 2.5
    assert check_weight(3, header(2.5, 4096), True, 2.5, "bucket 0 at offset 0") == 2.5
    with pytest.raises(RejectedMessage, match=r"weight 3\.0, but its bucket 0 at offset 0 claimed"):
        check_weight(3, header(3.0, 4096), True, 2.5, "bucket 0 at offset 0")
    with pytest.raises(RejectedMessage, match="not weighted"):
        check_weight(3, header(1.0), False, None, "")
    assert check_weight(3, header(0.0), False, None, "") == 1.0


@pytest.mark.parametrize(
    ("settings", "needle"),
    [
        ({"round_deadline_s": float("nan"), "min_contributors": 1}, "finite and >= 0"),
        ({"round_deadline_s": 1.0}, "needs min_contributors"),
        ({"merge_late": True, "max_staleness": 1}, "needs partial rounds"),
        ({"min_contributors": 1, "merge_late": True}, "max_staleness >= 1"),
        ({"min_contributors": 1, "max_staleness": 3}, "dropped"),
    ],
)
def test_unusable_settings_are_named(settings: dict[str, object], needle: str) -> None:
    problem = policy_problem(pb.OuterOptimizer(lr=1.0, **settings))  # type: ignore[arg-type]
    assert problem is not None and needle in problem


def test_partial_rounds_need_k_at_most_the_world_one_shard_and_no_local_groups() -> None:
    outer = pb.OuterOptimizer(lr=1.0, min_contributors=3)
    assert job_problem(outer, 3, 1, False) is None
    assert "more than the job's 2 ranks" in (job_problem(outer, 2, 1, False) or "")
    assert "unsharded" in (job_problem(outer, 3, 2, False) or "")
    assert "hierarchical=False" in (job_problem(outer, 3, 1, True) or "")
    assert job_problem(pb.OuterOptimizer(lr=1.0, weighted=True), 3, 2, True) is None


def test_the_client_turns_its_arguments_into_the_coordinators_fields() -> None:
    assert straggler_settings(None, None, "drop", None, False, 4) == {}
    assert straggler_settings(None, 2.5, "drop", None, False, 4) == {
        "min_contributors": 1,
        "round_deadline_s": 2.5,
    }
    assert straggler_settings(3, None, "merge", None, True, 4) == {
        "min_contributors": 3,
        "round_deadline_s": 0.0,
        "merge_late": True,
        "max_staleness": 1,
        "weighted": True,
    }


@pytest.mark.parametrize(
    ("arguments", "needle"),
    [
        ((0, None, "drop", None, False, 4), "min_contributors must be in [1, world_size=4]"),
        ((5, None, "drop", None, False, 4), "got 5"),
        ((True, None, "drop", None, False, 4), "an integer"),
        ((2, -1.0, "drop", None, False, 4), "round_deadline_s must be finite"),
        ((2, None, "keep", None, False, 4), "late must be one of"),
        ((None, None, "merge", None, False, 4), 'late="merge" needs partial rounds'),
        ((2, None, "merge", 0, False, 4), "max_staleness must be an integer >= 1"),
        ((2, None, "drop", 2, False, 4), 'needs late="merge"'),
        ((None, None, "drop", None, 1, 4), "weighted must be True or False"),
    ],
)
def test_the_client_refuses_bad_arguments_naming_them(
    arguments: tuple[object, ...], needle: str
) -> None:
    with pytest.raises(ValueError) as caught:
        straggler_settings(*arguments)  # type: ignore[arg-type]
    assert needle in str(caught.value)


def test_samples_count_one_by_default_and_must_be_finite_and_not_negative() -> None:
    assert check_samples(None, 0) == 1.0
    assert check_samples(32, 0) == 32.0
    for bad in (-1.0, float("nan"), float("inf"), True, "8"):
        with pytest.raises(ValueError, match="samples"):
            check_samples(bad, 7)  # type: ignore[arg-type]
