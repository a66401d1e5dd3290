"""The int8 wire (a float32 scale per chunk): the rule, the worker's cut, the coordinator's sum.

The rule (`gradsync_proto.int8_wire`): scale = max|x| / 127, q = round half to
even of x / scale clipped to +-127, value = q * scale, all in float32. The
worker quantizes on the transport's own chunk grid and every chunk's header
carries its scale; its error feedback keeps exactly what the coordinator will
not sum. The coordinator dequantizes every chunk with its scale and sums in
float32 in rank order (checked against numpy), answers in float32 only, and
refuses what no honest rank sends.
"""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch
from gradsync import hooks
from gradsync.diloco import DiLoCo
from gradsync.hooks import GradBucket
from gradsync.path.bucket_uploads import BucketUpload, range_messages, split_upload
from gradsync.path.buffers import BucketBuffer
from gradsync.quantized_wire import ChunkGrid, Int8Quantization, Int8Wire
from gradsync_proto import chunking, int8_wire
from gradsync_proto.codec import ChunkHeader, decode_gradient, header_of
from gradsync_proto.codes import Code
from gradsync_proto.v1 import gradsync_pb2 as pb
from gradsync_server.dataplane.actions import Send
from gradsync_server.dataplane.budget import ByteBudget
from gradsync_server.dataplane.nonfinite import NonFiniteRejection
from gradsync_server.dataplane.open_step import OpenStep
from gradsync_server.dataplane.plane import MembershipView, PlaneMember
from gradsync_server.errors import RejectedMessage

pytestmark = pytest.mark.unit

CHUNK = 64
F32, F64, INT8 = pb.DTYPE_FLOAT32, pb.DTYPE_FLOAT64, pb.DTYPE_INT8


# ------------------------------------------------------------------ the rule
def test_a_chunk_round_trips_within_half_a_step_and_its_peak_is_127() -> None:
    values = np.random.default_rng(0).standard_normal(1000).astype(np.float32)
    q, scale = int8_wire.quantize_chunk(values)
    assert q.dtype == np.int8 and scale == np.float32(np.abs(values).max()) / np.float32(127)
    assert np.abs(q).max() == 127 and q.min() >= -127
    back = int8_wire.dequantize(q.tobytes(), scale)
    assert back.dtype == np.float32
    assert np.abs(back - values).max() <= scale / 2 * (1 + 1e-6)


def test_rounding_is_half_to_even_after_the_float32_division() -> None:
    # The peak 127 makes the scale exactly 1: x / scale = x, and .5 goes to the even side.
    values = np.array([127, 2.5, 3.5, -2.5, -3.5, 0.5, 1.5, -0.5], dtype=np.float32)
    q, scale = int8_wire.quantize_chunk(values)
    assert scale == 1.0
    assert q.tolist() == [127, 2, 4, -2, -4, 0, 2, 0]


def test_an_all_zero_chunk_has_scale_0_and_a_nan_one_dequantizes_to_nan() -> None:
    q, scale = int8_wire.quantize_chunk(np.zeros(5, dtype=np.float32))
    assert scale == 0.0 and not q.any()
    assert not int8_wire.dequantize(q, scale).any()
    tiny = np.full(3, 1e-44, dtype=np.float32)  # max / 127 underflows: nothing to scale by
    q, scale = int8_wire.quantize_chunk(tiny)
    assert scale == 0.0 and not q.any()
    for bad in (math.nan, math.inf):
        values = np.array([1.0, bad, -2.0], dtype=np.float32)
        q, scale = int8_wire.quantize_chunk(values)
        assert not math.isfinite(scale) and not q.any()
        assert np.isnan(int8_wire.dequantize(q, scale)).all()


def test_every_chunk_has_its_own_scale() -> None:
    values = np.concatenate([np.full(4, 100.0), np.full(4, 0.01), np.zeros(2)]).astype(np.float32)
    q, scales = int8_wire.quantize(values, [(0, 4), (4, 4), (8, 2)])
    assert scales == {0: pytest.approx(100 / 127), 4: pytest.approx(0.01 / 127), 8: 0.0}
    assert q.tolist() == [127] * 8 + [0, 0]  # a large chunk costs the small one nothing
    np.testing.assert_allclose(int8_wire.dequantize_bucket(q, scales), values, rtol=1e-6)
    with pytest.raises(ValueError, match="covers 8 of the bucket's 10"):
        int8_wire.quantize(values, [(0, 4), (4, 4)])


# ------------------------------------------------------------- the worker
def bucket(values: torch.Tensor, index: int = 0) -> GradBucket:
    return GradBucket(index, 1, values, ["w"], 2)


@pytest.mark.parametrize("shard_count", [1, 3])
def test_the_hook_quantizes_on_the_transports_grid_and_each_chunk_carries_its_scale(
    shard_count: int,
) -> None:
    elements = 203  # 1 shard: 4 chunks of 64 int8 bytes; 3 shards: 68 + 68 + 67, 2 chunks each
    grid = ChunkGrid(CHUNK, shard_count)
    hook = Int8Quantization(lambda: grid, error_feedback=False)
    hook.seeding = False
    upload = torch.randn(elements, generator=torch.Generator().manual_seed(1))
    upload[70] = 50.0  # one large element: only its chunk's scale should notice
    wire = hook.before_upload(None, bucket(upload))
    assert isinstance(wire, Int8Wire) and wire.values.dtype == torch.int8
    buffer = BucketBuffer([wire.values.view(torch.uint8).numpy()], wire.scales)
    assert buffer.wire_bytes == elements + 4 * len(wire.scales)
    sent: dict[int, tuple[ChunkHeader, bytes]] = {}
    for part in split_upload(BucketUpload(1, 0, buffer, INT8, reply_dtype=F32), shard_count):
        assert part is not None
        for raw in range_messages(part, CHUNK, 0, lambda *_: None):
            decoded = decode_gradient(raw)
            assert decoded is not None
            sent[decoded[0].offset] = (decoded[0], bytes(decoded[1]))
    assert sorted(sent) == sorted(wire.scales) == [offset for offset, _ in grid.spans(elements)]
    values = upload.numpy()
    for offset, (header, payload) in sent.items():
        assert header.dtype == INT8 and header.reply_dtype == F32
        expected_q, expected_scale = int8_wire.quantize_chunk(
            values[offset : offset + len(payload)]
        )
        assert header.scale == expected_scale == wire.scales[offset]
        assert payload == expected_q.tobytes()
    large = max(wire.scales.values())
    assert large == pytest.approx(50 / 127) and sorted(wire.scales.values())[-2] < large / 5


def test_error_feedback_keeps_exactly_what_the_coordinator_does_not_sum() -> None:
    grid = ChunkGrid(CHUNK, 2)
    hook = Int8Quantization(lambda: grid, error_feedback=True)
    first = bucket(torch.randn(150, generator=torch.Generator().manual_seed(2)), index=3)
    assert hook.before_upload(None, first) is first.buffer  # the seed travels in float32
    hook.seeding = False
    wire = hook.before_upload(None, first)
    assert isinstance(wire, Int8Wire) and hook.residuals is not None
    # What the coordinator sums, chunk by chunk with each chunk's scale:
    summed = np.concatenate(
        [
            int8_wire.dequantize(wire.values.numpy()[o : o + n], wire.scales[o])
            for o, n in grid.spans(150)
        ]
    )
    residual = hook.residuals[3]
    torch.testing.assert_close(residual, first.buffer - torch.from_numpy(summed), rtol=0, atol=0)
    assert 0 < float(residual.abs().max()) <= max(wire.scales.values()) / 2 * (1 + 1e-6)
    # The next upload of that bucket is quantized with the residual added.
    second = bucket(torch.randn(150, generator=torch.Generator().manual_seed(3)), index=3)
    again = hook.before_upload(None, second)
    assert isinstance(again, Int8Wire)
    q, _ = int8_wire.quantize((second.buffer + residual).numpy(), grid.spans(150))
    assert again.values.numpy().tolist() == q.tolist()


def test_a_chunk_cut_on_another_grid_than_its_scales_is_refused() -> None:
    buffer = BucketBuffer([np.zeros(100, dtype=np.uint8)], {0: 1.0, 64: 1.0})
    assert buffer.scale_at(64) == 1.0 and BucketBuffer([np.zeros(4, np.uint8)]).scale_at(0) == 0
    with pytest.raises(ValueError, match="another chunk grid"):
        buffer.scale_at(32)


def test_the_wrapper_refuses_int8_and_says_whose_wire_it_is() -> None:
    with pytest.raises(ValueError, match=r"is not supported: use torch\.bfloat16.*DiLoCo"):
        hooks.hook_for_wire_dtype(torch.int8)


def test_diloco_refuses_int8_in_a_local_group_before_connecting() -> None:
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="hierarchical=True is not possible with wire_dtype"):
        DiLoCo(model, optimizer, wire_dtype=torch.int8, hierarchical=True, coordinator="x:1")
    with pytest.raises(ValueError, match=r"torch\.int8"):
        DiLoCo(model, optimizer, wire_dtype=torch.uint8, coordinator="x:1")


# -------------------------------------------------------- the coordinator
def open_steps(
    ranks: int, elements: int, shard_count: int, native: int = F32, nonfinite: str = "report"
) -> list[OpenStep]:
    membership = MembershipView("job", 0, {r: PlaneMember(r, f"inc-{r}") for r in range(ranks)})
    signature = pb.ModelSignature(buckets=[pb.BucketSpec(dtype=native, num_elements=elements)])
    steps = []
    for index in range(shard_count):
        step = OpenStep(
            membership,
            CHUNK,
            ByteBudget(1 << 30),
            lambda: 0.0,
            None,
            index,
            shard_count,
            nonfinite=nonfinite,
        )
        step.configure(signature, 0)
        steps.append(step)
    return steps


def header(offset: int, scale: float, reply: int = F32, wire: int = INT8) -> ChunkHeader:
    return ChunkHeader(
        step=0, bucket_index=0, offset=offset, dtype=wire, reply_dtype=reply, scale=scale
    )


def replies(actions: list[object]) -> list[tuple[ChunkHeader, bytes]]:
    out = []
    for action in actions:
        if isinstance(action, Send) and isinstance(action.message, bytes):
            decoded = decode_gradient(action.message)
            if decoded is None:  # an answer naming a screened rank: left to protobuf
                chunk = pb.CoordinatorMessage.FromString(action.message).gradient
                assert chunk.screened_ranks, chunk
                decoded = (header_of(chunk), memoryview(chunk.payload))
            out.append((decoded[0], bytes(decoded[1])))
    return out


@pytest.mark.parametrize("shard_count", [1, 3])
@pytest.mark.parametrize("seed", range(3))
def test_int8_chunks_are_dequantized_and_summed_in_fp32_in_rank_order(
    shard_count: int, seed: int
) -> None:
    rng = random.Random(seed)
    ranks, elements = 3, rng.choice([37, 100, 203])
    grid = ChunkGrid(CHUNK, shard_count).spans(elements)
    uploads = [
        np.random.default_rng(seed * 10 + r).standard_normal(elements).astype(np.float32) * (r + 1)
        for r in range(ranks)
    ]
    wires = [int8_wire.quantize(u, grid) for u in uploads]
    # The reference, in numpy: each chunk's q * scale, summed in rank order, divided.
    total = np.zeros(elements, dtype=np.float32)
    for q, scales in wires:
        for offset, length in grid:
            piece = q[offset : offset + length].astype(np.float32) * np.float32(scales[offset])
            total[offset : offset + length] += piece
    expected = (total / np.float32(ranks)).astype("<f4").tobytes()

    steps = open_steps(ranks, elements, shard_count)
    arrivals = []
    for step in steps:
        lo, hi = step.byte_range(0, INT8)
        for offset, length in chunking.range_chunk_spans(lo, hi, CHUNK):
            arrivals += [(step, r, offset, length) for r in range(ranks)]
    rng.shuffle(arrivals)
    got: dict[int, bytes] = {}
    for step, rank, offset, length in arrivals:
        q, scales = wires[rank]
        payload = memoryview(q[offset : offset + length].tobytes())
        for reply, data in replies(step.accept(rank, header(offset, scales[offset]), payload)):
            assert reply.dtype == F32 and reply.contributors == ranks and reply.scale == 0
            assert len(data) <= CHUNK, "a reply must fit the message limit (one chunk + slack)"
            got[reply.offset] = data
    assert all(step.step == 1 for step in steps), "every shard's step completes"
    assert b"".join(got[o] for o in sorted(got)) == expected


def refusal(step: OpenStep, rank: int, chunk: ChunkHeader, payload: bytes) -> RejectedMessage:
    with pytest.raises(RejectedMessage) as refused:
        step.accept(rank, chunk, memoryview(payload))
    return refused.value


@pytest.mark.parametrize("reply", [0, INT8, pb.DTYPE_BFLOAT16])
def test_an_int8_chunk_must_ask_for_its_answer_in_float32(reply: int) -> None:
    (step,) = open_steps(2, 16, 1)
    refused = refusal(step, 1, header(0, 0.5, reply=reply), bytes(16))
    assert refused.code == Code.INVALID_ARGUMENT
    for part in ("rank 1", "bucket 0", "step 0", "int8", "float32", "reply dtype FLOAT32"):
        assert part in refused.message, (part, refused.message)


@pytest.mark.parametrize("native", [F64, pb.DTYPE_FLOAT16])
def test_int8_is_only_for_a_float32_bucket(native: int) -> None:
    (step,) = open_steps(1, 16, 1, native)
    refused = refusal(step, 0, header(0, 0.5), bytes(16))
    assert refused.code == Code.INVALID_ARGUMENT
    assert "as int8" in refused.message and "rank 0" in refused.message


def test_a_payload_that_is_not_one_byte_per_element_is_refused() -> None:
    (step,) = open_steps(1, 16, 1)
    refused = refusal(step, 0, header(0, 0.5), bytes(64))  # 16 float32 claimed as int8
    assert refused.code == Code.INVALID_ARGUMENT
    assert "64 bytes" in refused.message and "expected 16" in refused.message
    refused = refusal(step, 0, header(0, 0.5), bytes(15))
    assert "15 bytes" in refused.message and "expected 16" in refused.message


def test_a_negative_scale_or_a_scale_on_a_float32_chunk_is_refused() -> None:
    (step,) = open_steps(1, 16, 1)
    refused = refusal(step, 0, header(0, -0.5), bytes(16))
    assert refused.code == Code.INVALID_ARGUMENT and "negative scale" in refused.message
    refused = refusal(step, 0, header(0, 0.5, reply=F32, wire=F32), bytes(64))
    assert refused.code == Code.INVALID_ARGUMENT
    assert "as float32 with a scale" in refused.message and "rank 0" in refused.message


def test_a_nan_scale_is_a_non_finite_contribution_under_the_policy() -> None:
    (step,) = open_steps(2, 16, 1, nonfinite="report")
    step.accept(0, header(0, math.nan), memoryview(bytes(16)))
    ((_, data),) = replies(step.accept(1, header(0, 0.25), memoryview(bytes([4] * 16))))
    assert step.nonfinite.count == 1 and "rank 0" in step.nonfinite.last
    assert "16 of 16 elements" in step.nonfinite.last
    assert np.isnan(np.frombuffer(data, "<f4")).all()
    (strict,) = open_steps(2, 16, 1, nonfinite="abort")
    with pytest.raises(NonFiniteRejection) as aborted:
        strict.accept(1, header(0, math.inf), memoryview(bytes([1] * 16)))
    assert aborted.value.rank == 1 and aborted.value.code == Code.ABORTED
    # A finite scale so large that q * scale overflows is caught the same way.
    (huge,) = open_steps(1, 16, 1, nonfinite="abort")
    with pytest.raises(NonFiniteRejection):
        huge.accept(0, header(0, 3.0e38), memoryview(bytes([127] * 16)))


def test_an_outer_bucket_answers_an_int8_step_as_it_answers_its_float32_values() -> None:
    """DiLoCo's path: the answer's element offsets come from int8 bytes (one per element)."""
    elements, outer = 150, pb.OuterOptimizer(lr=0.7, momentum=0.9, nesterov=True)
    grid = ChunkGrid(CHUNK, 2).spans(elements)
    seed = np.random.default_rng(5).standard_normal(elements).astype(np.float32)
    pseudo = np.random.default_rng(6).standard_normal(elements).astype(np.float32)
    q, scales = int8_wire.quantize(pseudo, grid)
    dequantized = int8_wire.dequantize_bucket(q, scales)
    answers = []
    for int8 in (True, False):
        membership = MembershipView("job", 0, {0: PlaneMember(0, "inc-0")})
        spec = pb.BucketSpec(dtype=F32, num_elements=elements, outer=True)
        signature = pb.ModelSignature(buckets=[spec], outer=outer)
        got: dict[int, bytes] = {}
        for index in range(2):
            step = OpenStep(membership, CHUNK, ByteBudget(1 << 30), lambda: 0.0, None, index, 2)
            step.configure(signature, 0)
            for offset, length in chunking.range_chunk_spans(*step.byte_range(0, F32), CHUNK):
                raw = seed.tobytes()[offset : offset + length]  # the seed, in float32
                step.accept(0, header(offset, 0.0, wire=F32), memoryview(raw))
            wire = INT8 if int8 else F32
            for offset, length in chunking.range_chunk_spans(*step.byte_range(0, wire), CHUNK):
                if int8:
                    chunk = header(offset, scales[offset])
                    payload = q.tobytes()[offset : offset + length]
                else:
                    chunk = ChunkHeader(step=1, offset=offset, dtype=F32)
                    payload = dequantized.tobytes()[offset : offset + length]
                chunk.step = 1
                for reply, data in replies(step.accept(0, chunk, memoryview(payload))):
                    got[reply.offset] = data
        answers.append(b"".join(got[o] for o in sorted(got)))
    assert answers[0] == answers[1] and len(answers[0]) == 4 * elements
