"""The contribution screen's pure rules: judging, robust merges, clip, quarantine, ordering."""

from __future__ import annotations

import logging
import math
import random

import numpy as np
import pytest
from gradsync_proto import chunking
from gradsync_proto.codec import ChunkHeader, decode_gradient, encode_gradient, header_of
from gradsync_proto.v1 import gradsync_pb2 as pb
from gradsync_server import defaults
from gradsync_server.control.signature import first_difference
from gradsync_server.dataplane.actions import Send
from gradsync_server.dataplane.aggregation import BucketReduction
from gradsync_server.dataplane.budget import ByteBudget
from gradsync_server.dataplane.contribution_screen import ContributionScreen
from gradsync_server.dataplane.open_step import OpenStep
from gradsync_server.dataplane.plane import MembershipView, PlaneMember
from gradsync_server.dataplane.screening import (
    POLICIES,
    ChunkVerdict,
    Measure,
    Quarantine,
    ScreenPolicy,
    ScreenThresholds,
    check_screen,
    judge,
    measure,
    measure_chunk,
    merge,
    screen_problem,
    stricter,
    trim_count,
)

pytestmark = pytest.mark.unit

THRESHOLDS = ScreenThresholds()
NONE = ChunkVerdict((), frozenset(), 0.0)


def _honest(seed: int, count: int = 4, size: int = 1000) -> list[tuple[int, np.ndarray]]:
    """`count` correlated contributions: a shared direction plus noise per rank."""
    rng = np.random.default_rng(seed)
    base = rng.standard_normal(size).astype(np.float32)
    return [
        (rank, (base + 0.5 * rng.standard_normal(size)).astype(np.float32)) for rank in range(count)
    ]


def test_policies_are_the_defaults_and_ordered_by_strictness() -> None:
    assert POLICIES == defaults.SCREEN_POLICIES
    assert check_screen("") is ScreenPolicy.REPORT
    with pytest.raises(ValueError, match="screen policy must be one of report, clip"):
        check_screen("mean")
    assert stricter(ScreenPolicy.REPORT, ScreenPolicy.EXCLUDE) is ScreenPolicy.EXCLUDE
    assert stricter(ScreenPolicy.MEDIAN, ScreenPolicy.EXCLUDE) is ScreenPolicy.MEDIAN
    assert stricter(ScreenPolicy.CLIP, ScreenPolicy.REPORT) is ScreenPolicy.CLIP


def test_screen_problem_names_what_a_holding_policy_cannot_screen() -> None:
    weighted = pb.OuterOptimizer(lr=1, weighted=True, screen="exclude")
    assert "weighted=True" in (screen_problem(weighted, False) or "")
    assert screen_problem(pb.OuterOptimizer(lr=1), True) is None  # "report"
    median = pb.OuterOptimizer(lr=1, screen="median")
    assert "local groups" in (screen_problem(median, True) or "")


def test_measure_and_cosine() -> None:
    values = np.array([3, 4], dtype=np.float32)
    measured = measure(values, np.array([1, 0], dtype=np.float32))
    assert measured.norm == 5.0 and measured.cosine == pytest.approx(0.6)
    assert math.isnan(measure(values, None).cosine)
    nan = measure(np.array([np.nan, 1], dtype=np.float32), None)
    assert nan.nonfinite == 1 and nan.norm == math.inf


def _measures(rows: list[tuple[int, np.ndarray]]) -> list:
    return measure_chunk(rows, THRESHOLDS.norm_ratio)


def test_measure_chunk_compares_each_rank_with_the_sum_of_the_others() -> None:
    rows = _honest(9)
    rows[3] = (3, rows[3][1] * 100)  # past the norm ratio: left out of everyone's reference
    measured = dict(_measures(rows))
    for rank in range(3):
        others = sum(v for r, v in rows[:3] if r != rank)
        want = measure(rows[rank][1], others.astype(np.float32))
        assert measured[rank].cosine == pytest.approx(want.cosine, rel=1e-4)
    kept = sum(v for _, v in rows[:3]).astype(np.float32)
    assert measured[3].cosine == pytest.approx(measure(rows[3][1], kept).cosine, rel=1e-4)


@pytest.mark.parametrize("attack", ["scaled", "flipped"])
def test_judge_flags_scaled_and_flipped_but_no_honest_rank(attack: str) -> None:
    rows = _honest(1)
    honest = judge(ScreenPolicy.EXCLUDE, THRESHOLDS, _measures(rows))
    assert honest.findings == () and honest.excluded == frozenset()
    rank, values = rows[2]
    rows[2] = (rank, values * 100 if attack == "scaled" else -values)
    verdict = judge(ScreenPolicy.EXCLUDE, THRESHOLDS, _measures(rows))
    assert [f.rank for f in verdict.findings] == [2]
    assert verdict.findings[0].reasons == (("norm",) if attack == "scaled" else ("cosine",))
    assert verdict.excluded == {2}
    total, divisor = merge(ScreenPolicy.EXCLUDE, THRESHOLDS, rows, verdict)
    assert divisor == 3
    expected = rows[0][1].copy()
    expected += rows[1][1]
    expected += rows[3][1]
    assert total.tobytes() == expected.tobytes()


def test_judge_flags_no_direction_where_the_ranks_agree_on_none() -> None:
    rng = np.random.default_rng(2)
    rows = [(r, rng.standard_normal(1000).astype(np.float32)) for r in range(4)]
    rows[1] = (1, -rows[1][1])
    assert judge(ScreenPolicy.EXCLUDE, THRESHOLDS, _measures(rows)).findings == ()


def test_random_noise_is_flagged_by_its_cosine() -> None:
    rows = _honest(10)
    rng = np.random.default_rng(3)
    rms = float(np.sqrt(np.mean(rows[0][1] ** 2)))
    rows[0] = (0, (rng.standard_normal(1000) * rms).astype(np.float32))
    verdict = judge(ScreenPolicy.EXCLUDE, THRESHOLDS, _measures(rows))
    assert [(f.rank, f.reasons) for f in verdict.findings] == [(0, ("cosine",))]


def test_exclude_keeps_everyone_when_everyone_is_flagged() -> None:
    rows = _honest(3, count=3)
    measures = [
        (rank, Measure(m.square_sum, -abs(m.dot), m.reference_square_sum, 0))
        for rank, m in _measures(rows)
    ]
    thresholds = ScreenThresholds(consensus=-1.0)
    verdict = judge(ScreenPolicy.EXCLUDE, thresholds, measures)
    assert len(verdict.findings) == 3 and verdict.excluded == frozenset()
    assert {f.action for f in verdict.findings} == {"reported"}


def test_report_names_but_excludes_nothing() -> None:
    rows = _honest(4)
    rows[0] = (0, rows[0][1] * 100)
    verdict = judge(ScreenPolicy.REPORT, THRESHOLDS, _measures(rows))
    assert [(f.rank, f.action) for f in verdict.findings] == [(0, "reported")]
    assert verdict.excluded == frozenset()


def test_clip_scales_only_what_exceeds_the_multiple_of_the_median() -> None:
    rows = _honest(5)
    rows[1] = (1, rows[1][1] * 100)
    verdict = judge(ScreenPolicy.CLIP, THRESHOLDS, _measures(rows))
    total, divisor = merge(ScreenPolicy.CLIP, THRESHOLDS, rows, verdict)
    assert divisor == 4
    clipped = total - rows[0][1] - rows[2][1] - rows[3][1]
    norm = float(np.linalg.norm(clipped))
    assert norm == pytest.approx(THRESHOLDS.clip_ratio * verdict.median_norm, rel=1e-4)


def test_trimmed_mean_and_median_are_coordinate_wise() -> None:
    rows = [
        (r, np.array(v, dtype=np.float32))
        for r, v in enumerate([[1, 9], [2, 8], [3, 7], [100, -50]])
    ]
    total, divisor = merge(ScreenPolicy.TRIMMED_MEAN, THRESHOLDS, rows, NONE)
    assert divisor == 2 and (total / divisor).tolist() == [2.5, 7.5]
    total, divisor = merge(ScreenPolicy.MEDIAN, THRESHOLDS, rows, NONE)
    assert (total / divisor).tolist() == [2.5, 7.5]
    total, divisor = merge(ScreenPolicy.MEDIAN, THRESHOLDS, rows[:3], NONE)
    assert divisor == 1 and total.tolist() == [2, 8]
    assert [trim_count(w) for w in (2, 3, 4, 7, 8, 16)] == [0, 1, 1, 1, 2, 4]


@pytest.mark.parametrize("policy", [p for p in ScreenPolicy if p is not ScreenPolicy.REPORT])
def test_screened_reduction_is_bitwise_independent_of_arrival_order(policy: ScreenPolicy) -> None:
    """Every arrival order gives the same bytes; a robust merge also any chunk size."""
    rows = _honest(6, count=5, size=4096)
    rows[3] = (3, rows[3][1] * 100)

    def reduce(order: list[int], chunk_bytes: int) -> bytes:
        reduction = BucketReduction(range(5), pb.DTYPE_FLOAT32, 4 * 4096, chunk_bytes)

        def screened(offset: int, held: list[tuple[int, np.ndarray]]):
            verdict = judge(policy, THRESHOLDS, _measures(held))
            total, divisor = merge(policy, THRESHOLDS, held, verdict)
            return total, divisor, len(held) - len(verdict.excluded)

        reduction.screened_merge = screened
        out: dict[int, bytes] = {}
        for rank in order:
            for offset in range(0, 4 * 4096, chunk_bytes):
                values = rows[rank][1][offset // 4 : (offset + chunk_bytes) // 4]
                averaged = reduction.add(rank, offset, values.tobytes())
                if averaged is not None:
                    out[offset] = bytes(averaged)
        assert reduction.complete
        return b"".join(out[o] for o in sorted(out))

    reference = reduce([0, 1, 2, 3, 4], 16384)
    shuffler = random.Random(7)
    for _ in range(5):
        order = [0, 1, 2, 3, 4]
        shuffler.shuffle(order)
        assert reduce(order, 16384) == reference
    if policy in (ScreenPolicy.TRIMMED_MEAN, ScreenPolicy.MEDIAN):
        assert reduce([4, 2, 0, 3, 1], 4096) == reference


def test_quarantine_after_consecutive_exclusions() -> None:
    quarantine = Quarantine(after=3, rounds=4)
    assert quarantine.close_round(1, frozenset({2})) == frozenset()
    assert quarantine.close_round(2, frozenset()) == frozenset()  # the streak resets
    for number in (3, 4):
        assert quarantine.close_round(number, frozenset({2})) == frozenset()
    assert quarantine.close_round(5, frozenset({2})) == {2}
    assert quarantine.quarantined(6) == {2} and quarantine.quarantined(9) == {2}
    assert quarantine.quarantined(10) == frozenset()
    for number in range(6, 10):  # excluded while in quarantine: not a new streak
        assert quarantine.close_round(number, frozenset({2})) == frozenset()
    assert quarantine.close_round(10, frozenset()) == frozenset()
    assert quarantine.quarantined(10) == frozenset()


def test_contribution_screen_names_the_rank_once_per_round(
    caplog: pytest.LogCaptureFixture,
) -> None:
    observed: list[tuple[int, float, float, bool, bool]] = []

    class Recorder:
        def observe_contribution(
            self, rank: int, norm: float, cosine: float, flagged: bool, excluded: bool
        ) -> None:
            observed.append((rank, norm, cosine, flagged, excluded))

    screen = ContributionScreen("job", ScreenPolicy.EXCLUDE, THRESHOLDS, Recorder())
    rows = _honest(8)
    rows[1] = (1, rows[1][1] * 100)
    for offset in (0, 2000):
        held = [(rank, values[offset // 4 :]) for rank, values in rows]
        verdict = screen.verdict(7, (0, offset), held)
        ranks, note = screen.header_fields(verdict)
        assert ranks == (1,) and "rank 1: norm" in note and "excluded" in note
    with caplog.at_level(logging.WARNING, logger="gradsync_server.screen"):
        lines = screen.close_round(7)
    assert len(lines) == 1 and lines[0].startswith("rank 1 in job 'job' round (step) 7: norm")
    assert (
        "in 2 of 2 chunks (bucket 0): excluded" in lines[0]
        and "norm ratio > 8, cosine < 0.05" in lines[0]
    )
    assert screen.count == 1 and screen.last == lines[0]
    assert any("rank 1" in record.getMessage() for record in caplog.records)
    assert [(r, f, e) for r, _, _, f, e in observed] == [
        (0, False, False),
        (1, True, True),
        (2, False, False),
        (3, False, False),
    ]
    assert len(screen.history[1]) == 1


def test_a_screened_answer_travels_through_protobuf_and_back() -> None:
    header = ChunkHeader(step=3, bucket_index=1, screened_ranks=(2,), screen_note="rank 2: norm")
    raw = encode_gradient(header, b"\0" * 8)
    assert decode_gradient(raw) is None  # rare: left to protobuf
    chunk = pb.CoordinatorMessage.FromString(raw).gradient
    decoded = header_of(chunk)
    assert decoded.screened_ranks == (2,) and decoded.screen_note == "rank 2: norm"
    plain = decode_gradient(encode_gradient(ChunkHeader(step=3), b"\0" * 8))
    assert plain is not None and plain[0].screened_ranks == () and plain[0].screen_note == ""


def test_ranks_asking_for_different_screens_are_told_both() -> None:
    def signature(screen: str) -> pb.ModelSignature:
        return pb.ModelSignature(outer=pb.OuterOptimizer(lr=0.7, screen=screen))

    difference = first_difference(0, signature("exclude"), 2, signature(""))
    assert difference is not None
    assert "screen 'report'" in difference and "screen 'exclude'" in difference
    assert first_difference(0, signature("median"), 1, signature("median")) is None


def _open_step_round(
    screen: str, shard_count: int, order: list[int], uploads: list[np.ndarray]
) -> tuple[np.ndarray, dict[int, tuple[int, ...]], dict[int, int], ContributionScreen | None]:
    """Seed, then one outer round of `uploads` through real `OpenStep`s (one per shard),
    ranks arriving in `order`; returns the new global parameters, the screened ranks and
    the contributors each answered chunk names, and shard 0's screen."""
    elements, chunk = 256, 256
    members = {r: PlaneMember(r, f"inc-{r}") for r in range(4)}
    membership = MembershipView("job", 0, members)
    signature = pb.ModelSignature(
        buckets=[pb.BucketSpec(dtype=pb.DTYPE_FLOAT32, num_elements=elements, outer=True)],
        outer=pb.OuterOptimizer(lr=1.0, screen=screen),
    )
    seed = np.zeros(elements, dtype=np.float32)
    answered = np.full(elements, np.nan, dtype=np.float32)
    screened: dict[int, tuple[int, ...]] = {}
    contributors: dict[int, int] = {}
    first_screen = None
    for index in range(shard_count):
        step = OpenStep(
            membership, chunk, ByteBudget(1 << 30), lambda: 0.0, None, index, shard_count
        )
        step.configure(signature, 0)
        spans = list(chunking.range_chunk_spans(*step.byte_range(0, pb.DTYPE_FLOAT32), chunk))
        for number, payloads in ((0, [seed] * 4), (1, uploads)):
            for rank in order:
                for offset, length in spans:
                    header = ChunkHeader(
                        step=number, bucket_index=0, offset=offset, dtype=pb.DTYPE_FLOAT32
                    )
                    raw = payloads[rank].tobytes()[offset : offset + length]
                    for action in step.accept(rank, header, memoryview(raw)):
                        if number == 0 or not isinstance(action, Send):
                            continue
                        assert isinstance(action.message, bytes)
                        decoded = decode_gradient(action.message)
                        reply = (
                            header_of(pb.CoordinatorMessage.FromString(action.message).gradient)
                            if decoded is None
                            else decoded[0]
                        )
                        payload = pb.CoordinatorMessage.FromString(action.message).gradient.payload
                        start = reply.offset // 4
                        values = np.frombuffer(payload, dtype=np.float32)
                        answered[start : start + len(values)] = values
                        screened[reply.offset] = reply.screened_ranks
                        contributors[reply.offset] = reply.contributors
        assert step.step == 2
        if index == 0:
            first_screen = step.screen
    return answered, screened, contributors, first_screen


def test_the_open_step_excludes_the_culprit_and_names_it_in_every_answer() -> None:
    uploads = [values[:256] for _, values in _honest(11, size=256)]
    uploads[2] = uploads[2] * np.float32(100)
    answered, screened, contributors, screen = _open_step_round("exclude", 1, [0, 1, 2, 3], uploads)
    kept = uploads[0].copy()
    kept += uploads[1]
    kept += uploads[3]
    np.testing.assert_array_equal(answered, -(kept / np.float32(3)))  # lr 1 from 0, no momentum
    assert set(screened.values()) == {(2,)} and set(contributors.values()) == {3}
    assert screen is not None and screen.count == 1 and screen.last.startswith("rank 2 in job")


@pytest.mark.parametrize("screen", ["trimmed_mean", "median"])
def test_the_open_step_merges_robustly_alike_in_any_order_and_shard_count(screen: str) -> None:
    uploads = [values[:256] for _, values in _honest(12, size=256)]
    uploads[1] = -uploads[1] * np.float32(50)
    reference, _, _, _ = _open_step_round(screen, 1, [0, 1, 2, 3], uploads)
    for shards, order in ((1, [3, 1, 0, 2]), (2, [2, 3, 1, 0]), (3, [1, 0, 3, 2])):
        again, _, _, _ = _open_step_round(screen, shards, order, uploads)
        assert again.tobytes() == reference.tobytes(), (shards, order)
    assert not np.isnan(reference).any()
