"""The contribution screen of per-step (DDP) jobs, through real `OpenStep`s (no network).

A float32 bucket and a float64 one, three ranks, rank 2 sending x100 its honest
gradient: under "report" it is named from the sums of squares taken while folding
and the average is the plain one, bit for bit; under "exclude" the average is
the honest ranks' (divisor 2) in any arrival order; the job's screen is part of
its signature, floored by the coordinator's `--screen`.
"""

from __future__ import annotations

import itertools

import gradsync
import numpy as np
import pytest
import torch
from gradsync_proto.codec import ChunkHeader, decode_gradient, header_of
from gradsync_proto.v1 import gradsync_pb2 as pb
from gradsync_server.control.membership import Membership
from gradsync_server.control.signature import first_difference, validate
from gradsync_server.dataplane.actions import Send
from gradsync_server.dataplane.budget import ByteBudget
from gradsync_server.dataplane.contribution_screen import ContributionScreen
from gradsync_server.dataplane.open_step import OpenStep
from gradsync_server.dataplane.plane import MembershipView, PlaneMember
from gradsync_server.dataplane.screening import ScreenPolicy, ScreenThresholds, step_screen_problem
from gradsync_server.errors import RejectedMessage

pytestmark = pytest.mark.unit

CHUNK = 256
#: (dtype, elements): a float32 bucket of two chunks and a float64 bucket of one.
BUCKETS = ((pb.DTYPE_FLOAT32, 128), (pb.DTYPE_FLOAT64, 8))
CULPRIT = 2


def _gradients(seed: int) -> list[list[np.ndarray]]:
    """Per rank, per bucket: a shared direction plus noise; rank 2's scaled x100."""
    rng = np.random.default_rng(seed)
    out = []
    for rank in range(3):
        buckets = []
        for dtype, elements in BUCKETS:
            numpy_dtype = np.float32 if dtype == pb.DTYPE_FLOAT32 else np.float64
            base = np.random.default_rng(seed + 1).standard_normal(elements)
            values = (base + 0.3 * rng.standard_normal(elements)).astype(numpy_dtype)
            buckets.append(values * numpy_dtype(100) if rank == CULPRIT else values)
        out.append(buckets)
    return out


def _step(
    screen: str, order: list[int], gradients: list[list[np.ndarray]]
) -> tuple[dict[tuple[int, int], bytes], dict[tuple[int, int], pb.GradientChunk], OpenStep]:
    """One step of every rank's buckets through a real `OpenStep`, arriving in `order`."""
    members = {r: PlaneMember(r, f"inc-{r}") for r in range(3)}
    step = OpenStep(
        MembershipView("job", 0, members), CHUNK, ByteBudget(1 << 30), lambda: 0.0, None
    )
    signature = pb.ModelSignature(
        buckets=[pb.BucketSpec(dtype=d, num_elements=n) for d, n in BUCKETS], screen=screen
    )
    step.configure(signature, 0)
    answers: dict[tuple[int, int], bytes] = {}
    headers: dict[tuple[int, int], pb.GradientChunk] = {}
    for rank in order:
        for bucket, (dtype, _) in enumerate(BUCKETS):
            raw = gradients[rank][bucket].tobytes()
            for offset in range(0, len(raw), CHUNK):
                header = ChunkHeader(step=0, bucket_index=bucket, offset=offset, dtype=dtype)
                for action in step.accept(rank, header, memoryview(raw[offset : offset + CHUNK])):
                    if not isinstance(action, Send) or not isinstance(action.message, bytes):
                        continue
                    chunk = pb.CoordinatorMessage.FromString(action.message).gradient
                    key = (chunk.bucket_index, chunk.offset)
                    answers[key] = chunk.payload
                    headers[key] = chunk
                    decoded = decode_gradient(action.message)
                    if decoded is not None:  # the fast path carries no screen fields
                        assert not header_of(chunk).screened_ranks
    assert step.step == 1 and step.steps_completed == 1
    return answers, headers, step


def _mean(rows: list[np.ndarray]) -> np.ndarray:
    total = rows[0].copy()
    for row in rows[1:]:
        total += row
    return total / total.dtype.type(len(rows))


def _expected(gradients: list[list[np.ndarray]], ranks: list[int]) -> dict[tuple[int, int], bytes]:
    out = {}
    for bucket in range(len(BUCKETS)):
        raw = _mean([gradients[r][bucket] for r in ranks]).tobytes()
        for offset in range(0, len(raw), CHUNK):
            out[(bucket, offset)] = raw[offset : offset + CHUNK]
    return out


def test_report_names_the_rank_from_its_folded_norm_and_merges_it() -> None:
    gradients = _gradients(3)
    answers, headers, step = _step("", [0, 1, 2], gradients)  # "" is "report"
    assert answers == _expected(gradients, [0, 1, 2])  # the usual sum / 3, bit for bit
    assert {tuple(h.screened_ranks) for h in headers.values()} == {(CULPRIT,)}
    assert all(
        "rank 2: norm" in h.screen_note and "reported" in h.screen_note for h in headers.values()
    )
    assert "cosine" not in next(iter(headers.values())).screen_note.split("(screen")[0]
    screen = step.screen
    assert screen is not None and screen.count == 1
    assert screen.last.startswith("rank 2 in job 'job' round (step) 0: norm")
    assert "in 3 of 3 chunks (bucket 0, 1): reported" in screen.last, screen.last
    assert "cosine not measured" in screen.last


def test_an_honest_step_names_nobody() -> None:
    gradients = _gradients(4)
    gradients[CULPRIT] = [values / values.dtype.type(100) for values in gradients[CULPRIT]]
    for screen in ("report", "exclude"):
        answers, headers, step = _step(screen, [2, 0, 1], gradients)
        assert answers == _expected(gradients, [0, 1, 2])
        assert not any(h.screened_ranks for h in headers.values())
        assert step.screen is not None and step.screen.count == 0


def test_exclude_averages_the_honest_ranks_in_any_arrival_order() -> None:
    gradients = _gradients(5)
    expected = _expected(gradients, [0, 1])  # float32 and float64 alike, divisor 2
    for order in itertools.permutations(range(3)):
        answers, headers, step = _step("exclude", list(order), gradients)
        assert answers == expected, order
        assert {h.contributors for h in headers.values()} == {2}
        assert {tuple(h.screened_ranks) for h in headers.values()} == {(CULPRIT,)}
        assert step.screen is not None and ": excluded (" in step.screen.last


def test_the_screen_is_part_of_the_signature_and_the_floor_applies() -> None:
    def signature(screen: str) -> pb.ModelSignature:
        spec = pb.TensorSpec(name="w", shape=[4], dtype=pb.DTYPE_FLOAT32)
        bucket = pb.BucketSpec(parameter_indices=[0], dtype=pb.DTYPE_FLOAT32, num_elements=4)
        return pb.ModelSignature(parameters=[spec], buckets=[bucket], screen=screen)

    difference = first_difference(0, signature("exclude"), 1, signature(""))
    assert difference is not None
    assert "rank 1 asks for screen 'report', rank 0 for 'exclude'" in difference
    assert first_difference(0, signature("report"), 1, signature("")) is None
    with pytest.raises(RejectedMessage, match="screen must be one of"):
        validate(0, signature("loud"))
    membership = Membership("job", 2, lambda: 0.0, "trimmed_mean")
    membership.signature = signature("exclude")
    assert membership.resolved_screen() == "trimmed_mean"  # the floor is stricter
    membership.signature = signature("median")
    assert membership.resolved_screen() == "median"
    assert step_screen_problem("report", True) is None
    problem = step_screen_problem("exclude", True)
    assert problem is not None and "hierarchical=False" in problem
    assert step_screen_problem("exclude", False) is None


def test_a_fresh_screen_flags_a_culprit_still_attacking_and_quarantines_it_again() -> None:
    """A restarted coordinator's screen starts afresh (docs/trust.md): it needs no history."""
    screen = ContributionScreen("job", ScreenPolicy.EXCLUDE, ScreenThresholds())
    for number in range(3):
        rows = [
            (rank, values[0].astype(np.float32)) for rank, values in enumerate(_gradients(number))
        ]
        verdict = screen.verdict(number, (0, 0), rows)
        assert verdict.excluded == {CULPRIT}, number
        lines = screen.close_round(number)
        assert lines[0].startswith(f"rank {CULPRIT} in job 'job' round (step) {number}: norm")
    assert "quarantined after 3 excluded rounds" in lines[-1]
    assert screen.quarantine.quarantined(3) == {CULPRIT}


@pytest.mark.parametrize(
    ("screen", "hierarchical", "match"),
    [("loud", False, "screen must be one of"), ("exclude", True, "needs hierarchical=False")],
)
def test_the_wrapper_refuses_a_screen_it_cannot_run_before_joining(
    screen: str, hierarchical: bool, match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        gradsync.DistributedDataParallel(
            torch.nn.Linear(2, 2),
            coordinator="127.0.0.1:1",
            rank=0,
            world_size=2,
            hierarchical=hierarchical,
            screen=screen,
        )
