"""DiLoCo's compact answer (`gradsync_server.dataplane.outer_answer`), as pure logic.

The coordinator keeps the public copy (the global parameters as the ranks hold
them) beside its exact ones and answers each chunk with the change exact -
public, quantized. Checked here: the change's round trip (int8 within half a
step, bfloat16 within half an ulp); a "rank" that adds every answer to its copy
holds bitwise the coordinator's public copy after every round, within scale / 2
of the exact parameters (the error carried, never accumulated), while the exact
parameters are exactly those of an exact-answer run; an aborted step changes
nothing; every chunk must ask for the job's answer dtype (float32 at the seed);
the open step answers an int8 chunk with one int8 chunk carrying its scale; the
signature carries the answer dtype (a mismatch names both); the worker checks
and keeps each answer chunk's scale and dequantizes the bucket; DiLoCo refuses
settings that cannot work.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from gradsync.diloco import DiLoCo
from gradsync.diloco_settings import compact_answer_dtype
from gradsync.path.step_results import StepResults
from gradsync.quantized_wire import ChunkGrid, Int8Answer
from gradsync_proto import chunking, int8_wire
from gradsync_proto.codec import ChunkHeader, decode_gradient
from gradsync_proto.codes import Code
from gradsync_proto.v1 import gradsync_pb2 as pb
from gradsync_server.control import signature as signatures
from gradsync_server.dataplane.actions import Send
from gradsync_server.dataplane.budget import ByteBudget
from gradsync_server.dataplane.open_step import OpenStep
from gradsync_server.dataplane.outer import OuterState
from gradsync_server.dataplane.outer_answer import quantize
from gradsync_server.dataplane.plane import MembershipView, PlaneMember
from gradsync_server.errors import RejectedMessage

pytestmark = pytest.mark.unit

F32, INT8, BF16 = pb.DTYPE_FLOAT32, pb.DTYPE_INT8, pb.DTYPE_BFLOAT16
ELEMENTS, CHUNK = 40, 64


def floats(values: np.ndarray) -> memoryview:
    return values.astype("<f4").data.cast("B")


def outer(answer: int = 0) -> pb.OuterOptimizer:
    return pb.OuterOptimizer(lr=0.7, momentum=0.9, nesterov=True, answer_dtype=answer)  # type: ignore[arg-type]


def bucket_specs() -> list[pb.BucketSpec]:
    return [pb.BucketSpec(parameter_indices=[0], dtype=F32, num_elements=ELEMENTS, outer=True)]


# ------------------------------------------------------------------ the change's round trip
def test_an_int8_change_round_trips_within_half_a_step_and_bf16_within_half_an_ulp() -> None:
    change = np.random.default_rng(0).standard_normal(500).astype(np.float32) * 0.03
    payload, scale, added = quantize(change, INT8)
    q = np.frombuffer(payload, dtype=np.int8)
    assert len(payload) == change.size and scale == np.float32(np.abs(change).max()) / 127
    np.testing.assert_array_equal(added, q.astype(np.float32) * np.float32(scale))
    assert np.abs(added - change).max() <= scale / 2 * (1 + 1e-6)
    payload, scale, added = quantize(change, BF16)
    assert len(payload) == 2 * change.size and scale == 0.0
    widened = (np.frombuffer(payload, dtype="<u2").astype(np.uint32) << 16).view(np.float32)
    np.testing.assert_array_equal(added, widened)
    assert (np.abs(added - change) <= np.abs(change) * 2.0**-8).all()


# ------------------------------------------------------------------ the coordinator's state
def run_rounds(
    state: OuterState, lo: int, hi: int, pseudo: list[np.ndarray], seed: np.ndarray
) -> tuple[list[np.ndarray], list[list[float]]]:
    """Seed, then one outer step per pseudo-gradient, two chunks each; what a rank holds.

    Returns the rank's copy after every round and the scales of every round's chunks.
    """
    middle = lo + (hi - lo) // 2
    spans = ((lo, middle), (middle, hi))
    for start, stop in spans:
        state.answer(0, start, INT8, floats(seed[start:stop]))  # int8 offsets: one per element
    state.commit()
    held = seed[lo:hi].copy()
    copies, scales = [], []
    for gradient in pseudo:
        round_scales = []
        for start, stop in spans:
            answer = state.answer(0, start, INT8, floats(gradient[start:stop]))
            scale = state.answer_scale(0, start)
            if state.public.active:
                q = np.frombuffer(answer, dtype=np.int8).astype(np.float32)
                held[start - lo : stop - lo] = held[start - lo : stop - lo] + q * np.float32(scale)
            else:
                held[start - lo : stop - lo] = np.frombuffer(answer, "<f4")
            round_scales.append(scale)
        state.commit()
        copies.append(held.copy())
        scales.append(round_scales)
    return copies, scales


@pytest.mark.parametrize(("shard_count", "shard_index"), [(1, 0), (3, 1)])
def test_a_rank_adding_the_int8_answers_holds_the_public_copy_within_half_a_step(
    shard_count: int, shard_index: int
) -> None:
    lo, hi = chunking.shard_ranges(ELEMENTS, shard_count)[shard_index]
    rng = np.random.default_rng(1)
    seed = rng.standard_normal(ELEMENTS).astype(np.float32)
    pseudo = [rng.standard_normal(ELEMENTS).astype(np.float32) * 0.1 for _ in range(6)]
    compact = OuterState(outer(INT8), bucket_specs(), shard_count, shard_index)
    exact = OuterState(outer(), bucket_specs(), shard_count, shard_index)
    copies, scales = run_rounds(compact, lo, hi, pseudo, seed)
    exact_copies, _ = run_rounds(exact, lo, hi, pseudo, seed)
    middle = (hi - lo) // 2
    for held, round_scales, exact_params in zip(copies, scales, exact_copies, strict=True):
        assert all(s > 0 for s in round_scales)
        # (Here only the last round's copy is compared to the state; every round is
        # compared through the answers the rank added.)
        per_element = np.repeat(np.float32(round_scales), [middle, hi - lo - middle])
        assert (np.abs(held - exact_params) <= per_element / 2 * (1 + 1e-5) + 1e-7).all()
    # The rank's copy is bitwise the coordinator's public copy ...
    np.testing.assert_array_equal(copies[-1], compact.public.values[0])
    # ... and the outer optimizer ran exactly, unaware of the answers' rounding.
    np.testing.assert_array_equal(compact._parameters[0], exact._parameters[0])
    np.testing.assert_array_equal(exact_copies[-1], exact._parameters[0])
    assert not np.array_equal(copies[-1], exact_copies[-1])  # something was rounded
    assert compact.held_bytes() == 3 * 4 * (hi - lo) and exact.held_bytes() == 2 * 4 * (hi - lo)
    assert compact.rounds == exact.rounds == len(pseudo)


def test_the_seed_is_answered_exactly_and_an_aborted_step_moves_no_public_value() -> None:
    state = OuterState(outer(INT8), bucket_specs(), 1, 0)
    seed = np.linspace(-1, 1, ELEMENTS, dtype=np.float32)
    answer = state.answer(0, 0, INT8, floats(seed))
    np.testing.assert_array_equal(np.frombuffer(answer, "<f4"), seed)
    assert state.answer_scale(0, 0) == 0.0
    state.commit()
    np.testing.assert_array_equal(state.public.values[0], seed)  # public = exact after the seed
    ones = np.ones(ELEMENTS, dtype=np.float32)
    first = bytes(state.answer(0, 0, INT8, floats(ones)))
    scale = state.answer_scale(0, 0)
    state.discard()  # the step was aborted
    assert state.answer_scale(0, 0) == 0.0
    np.testing.assert_array_equal(state.public.values[0], seed)
    assert bytes(state.answer(0, 0, INT8, floats(ones))) == first
    assert state.answer_scale(0, 0) == scale


def chunk(step: int, reply: int, wire: int = INT8, scale: float = 0.5) -> ChunkHeader:
    return ChunkHeader(step=step, bucket_index=0, dtype=wire, reply_dtype=reply, scale=scale)


def refused(state: OuterState, rank: int, header: ChunkHeader, wire: int) -> str:
    with pytest.raises(RejectedMessage) as caught:
        state.check_reply(rank, header, wire)
    assert caught.value.code == Code.INVALID_ARGUMENT
    return caught.value.message


def test_every_chunk_must_ask_float32_at_the_seed_and_the_job_s_answer_dtype_after() -> None:
    state = OuterState(outer(INT8), bucket_specs(), 1, 0)
    assert state.check_reply(0, chunk(0, F32, F32, 0.0), F32) == F32
    message = refused(state, 1, chunk(0, INT8), INT8)
    for part in ("rank 1", "bucket 0", "step 0", "in int8", "the seed in float32"):
        assert part in message, (part, message)
    state.answer(0, 0, F32, floats(np.zeros(ELEMENTS, dtype=np.float32)))
    state.commit()
    assert state.check_reply(0, chunk(1, INT8), INT8) == INT8
    assert state.check_reply(0, chunk(1, 0), INT8) == INT8  # unset: the payload's dtype
    message = refused(state, 1, chunk(1, F32), INT8)
    for part in ("rank 1", "step 1", "in float32", "after the seed in int8"):
        assert part in message, (part, message)
    # An int8 answer to a float32 upload has no grid to travel on: refused.
    message = refused(state, 0, chunk(1, INT8, F32, 0.0), F32)
    assert "sent it as float32" in message and "needs a int8 wire" in message, message
    # An exact-answer job refuses an int8 answer, as before.
    plain = OuterState(outer(), bucket_specs(), 1, 0)
    plain.answer(0, 0, F32, floats(np.zeros(ELEMENTS, dtype=np.float32)))
    plain.commit()
    assert "in float32" in refused(plain, 0, chunk(1, INT8), INT8)


def test_the_open_step_answers_each_int8_chunk_with_one_int8_chunk_and_its_scale() -> None:
    elements, shard_count = 150, 2
    membership = MembershipView("job", 0, {0: PlaneMember(0, "inc-0"), 1: PlaneMember(1, "i1")})
    signature = pb.ModelSignature(
        buckets=[pb.BucketSpec(dtype=F32, num_elements=elements, outer=True)], outer=outer(INT8)
    )
    rng = np.random.default_rng(7)
    seed = rng.standard_normal(elements).astype(np.float32)
    uploads = [rng.standard_normal(elements).astype(np.float32) * 0.1 for _ in range(2)]
    grid = ChunkGrid(CHUNK, shard_count).spans(elements)
    wires = [int8_wire.quantize(u, grid) for u in uploads]
    held = seed.copy()
    for index in range(shard_count):
        step = OpenStep(
            membership, CHUNK, ByteBudget(1 << 30), lambda: 0.0, None, index, shard_count
        )
        step.configure(signature, 0)
        for offset, length in chunking.range_chunk_spans(*step.byte_range(0, F32), CHUNK):
            for rank in range(2):
                header = ChunkHeader(step=0, bucket_index=0, offset=offset, dtype=F32)
                step.accept(rank, header, memoryview(seed.tobytes()[offset : offset + length]))
        answered = 0
        for offset, length in chunking.range_chunk_spans(*step.byte_range(0, INT8), CHUNK):
            for rank, (q, scales) in enumerate(wires):
                header = ChunkHeader(
                    step=1, bucket_index=0, offset=offset, dtype=INT8, reply_dtype=INT8
                )
                header.scale = scales[offset]
                actions = step.accept(
                    rank, header, memoryview(q.tobytes()[offset : offset + length])
                )
                for action in actions:
                    if not (isinstance(action, Send) and isinstance(action.message, bytes)):
                        continue
                    decoded = decode_gradient(action.message)
                    assert decoded is not None
                    reply, payload = decoded
                    assert reply.dtype == INT8 and reply.offset == offset
                    assert len(payload) == length and reply.scale > 0
                    change = np.frombuffer(bytes(payload), np.int8).astype(np.float32)
                    held[offset : offset + length] += change * np.float32(reply.scale)
                    answered += 1
        assert answered == len(list(chunking.range_chunk_spans(*step.byte_range(0, INT8), CHUNK)))
        assert step.step == 2
        lo, hi = step.byte_range(0, INT8)
        np.testing.assert_array_equal(held[lo:hi], step.outer.public.values[0])


# ------------------------------------------------------------------ the signature
def test_the_answer_dtype_is_part_of_the_signature_and_validated() -> None:
    def signature(answer: int) -> pb.ModelSignature:
        return pb.ModelSignature(
            parameters=[pb.TensorSpec(name="w", shape=[ELEMENTS], dtype=F32)],
            buckets=bucket_specs(),
            outer=outer(answer),
        )

    difference = signatures.first_difference(0, signature(INT8), 1, signature(0))
    assert difference is not None
    assert "rank 1" in difference and "answer_dtype float32" in difference
    assert "rank 0" in difference and "answer_dtype int8" in difference
    assert signatures.first_difference(0, signature(INT8), 1, signature(INT8)) is None
    with pytest.raises(RejectedMessage) as caught:
        signatures.validate(0, signature(pb.DTYPE_FLOAT16))
    assert "answer dtype float16 is not supported" in caught.value.message


# ------------------------------------------------------------------ the worker's side
def answer_chunk(offset: int, scale: float, dtype: int = INT8) -> ChunkHeader:
    return ChunkHeader(step=3, bucket_index=0, offset=offset, dtype=dtype, scale=scale)


def test_the_worker_keeps_each_answer_chunk_s_scale_and_refuses_bad_ones() -> None:
    elements = 100

    def results() -> tuple[StepResults, Int8Answer]:
        steps = StepResults(rank=1, on_averaged=None)
        steps.chunk_bytes, steps.bucket_bytes = CHUNK, [elements]
        answer = Int8Answer(elements)
        steps.expect(3, 0, answer.buffer, INT8)
        return steps, answer

    steps, answer = results()
    q = np.arange(elements, dtype=np.int8) - 50
    for offset, length in chunking.range_chunk_spans(0, elements, CHUNK):
        scale = 0.25 if offset == 0 else 0.0  # an all-zero change has scale 0
        payload = memoryview(q.tobytes()[offset : offset + length])
        assert steps.on_gradient(answer_chunk(offset, scale), payload) is None
    assert steps.is_ready(3) and answer.buffer.scales == {0: 0.25, 64: 0.0}
    flat = torch.full((elements,), 9.0)
    answer.dequantize_into(flat)
    expected = np.concatenate([q[:64].astype(np.float32) * np.float32(0.25), np.zeros(36)])
    np.testing.assert_array_equal(flat.numpy(), expected.astype(np.float32))
    for scale, dtype, words in (
        (math.nan, INT8, "scale nan"),
        (-1.0, INT8, "scale -1.0"),
        (math.inf, INT8, "scale inf"),
        (0.5, F32, "is float32, but it was asked for as int8"),
    ):
        steps, _ = results()
        problem = steps.on_gradient(answer_chunk(0, scale, dtype), memoryview(bytes(64)))
        assert problem is not None and words in problem, problem
        assert "bucket 0 of step 3 at offset 0" in problem
    # A chunk of the wrong length is refused too (the grid is the upload's).
    steps, _ = results()
    problem = steps.on_gradient(answer_chunk(0, 0.5), memoryview(bytes(63)))
    assert problem is not None and "63 bytes, expected 64" in problem
    # Any other answer carries no scale.
    steps = StepResults(rank=1, on_averaged=None)
    steps.bucket_bytes = [16]
    float_answer = Int8Answer(16)  # any buffer of 16 bytes
    steps.expect(3, 0, float_answer.buffer, F32)
    problem = steps.on_gradient(answer_chunk(0, 0.5, F32), memoryview(bytes(16)))
    assert problem is not None and "only an int8 answer has one" in problem


@pytest.mark.parametrize(
    ("wire", "answer", "words"),
    [
        (None, torch.int8, "needs wire_dtype=torch.int8"),
        (torch.bfloat16, torch.int8, "needs wire_dtype=torch.int8"),
        (torch.int8, torch.bfloat16, "needs wire_dtype=torch.bfloat16"),
        (torch.float16, torch.float16, "is not supported"),
    ],
)
def test_diloco_refuses_an_answer_dtype_its_wire_cannot_carry(
    wire: torch.dtype | None, answer: torch.dtype, words: str
) -> None:
    model = torch.nn.Linear(3, 2)
    with pytest.raises(ValueError, match=words):
        DiLoCo(
            model, torch.optim.SGD(model.parameters(), lr=0.1), wire_dtype=wire, answer_dtype=answer
        )


@pytest.mark.parametrize(
    ("wire", "min_contributors", "resolved"),
    [
        (torch.int8, None, torch.int8),  # the int8 wire is answered in int8
        (torch.int8, 1, None),  # partial rounds answer a late rank exactly
        (torch.bfloat16, None, None),  # a bfloat16 job may form local groups
        (None, None, None),
    ],
)
def test_the_default_answer_is_int8_on_the_int8_wire_only(
    wire: torch.dtype | None, min_contributors: int | None, resolved: torch.dtype | None
) -> None:
    assert compact_answer_dtype(wire, "auto", min_contributors) is resolved
    # An explicit None keeps the exact float32 answer on the int8 wire.
    assert compact_answer_dtype(wire, None, min_contributors) is None
    with pytest.raises(ValueError, match="'int8' is not supported"):
        compact_answer_dtype(wire, "int8")


def test_a_compact_answer_is_refused_with_partial_rounds_at_both_ends() -> None:
    # A late rank is answered with the global parameters, not the public copy.
    compact = outer(INT8)
    compact.min_contributors = 1
    signature = pb.ModelSignature(
        parameters=[pb.TensorSpec(name="w", shape=[ELEMENTS], dtype=F32)],
        buckets=bucket_specs(),
        outer=compact,
    )
    with pytest.raises(RejectedMessage) as caught:
        signatures.validate(0, signature)
    assert "min_contributors 1" in caught.value.message and "int8" in caught.value.message
    model = torch.nn.Linear(3, 2)
    with pytest.raises(ValueError, match="not possible with answer_dtype"):
        DiLoCo(
            model,
            torch.optim.SGD(model.parameters(), lr=0.1),
            wire_dtype=torch.int8,
            answer_dtype=torch.int8,
            min_contributors=1,
            world_size=2,
        )
