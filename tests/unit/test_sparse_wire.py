"""The sparse 2-bit wire: the rule, its bytes, hostile payloads, the worker's hook, the hub's sum.

The rule (`gradsync_proto.sparse_wire`): per chunk the top ceil(density n)
elements by magnitude (ties to the lowest index), 2 bits each on the levels
{-3, -1, 1, 3} * step with step = max|selected| / 3, indices as gap varints or
a bitmap, whichever is shorter. Checked against `support.sparse_reference`,
written from the rule in torch; every malformed payload is refused with what
is wrong and both values; the worker's error feedback keeps exactly what the
coordinator does not sum; the coordinator sums sparse chunks in float32 in
rank order whatever the arrival order and refuses what no honest rank sends.
"""

from __future__ import annotations

import inspect
import math
import random
import struct

import numpy as np
import pytest
import torch
from gradsync.hooks import GradBucket
from gradsync.path.bucket_uploads import BucketUpload, range_messages, split_upload
from gradsync.path.buffers import BucketBuffer
from gradsync.path.step_results import StepResults
from gradsync.quantized_wire import ChunkGrid, Int8Wire
from gradsync.sparse_wire import (
    SparseQuantization,
    SparseWire,
    default_outer_momentum,
    sparse_settings,
)
from gradsync_proto import chunking, sparse_wire
from gradsync_proto.codec import ChunkHeader, decode_gradient
from gradsync_proto.codes import Code
from gradsync_proto.v1 import gradsync_pb2 as pb
from gradsync_server.dataplane.outer_answer import PublicCopy, answer_dtype_problem
from support.sparse_reference import sparse_chunk

from tests.unit.test_int8_wire import CHUNK, F32, INT8, open_steps, refusal, replies

pytestmark = pytest.mark.unit


def payload_of(
    values: list[float] | np.ndarray, density: float
) -> tuple[bytes, sparse_wire.SparseChunk]:
    return sparse_wire.encode(np.asarray(values, dtype=np.float32), density)


# ------------------------------------------------------------------ the rule
@pytest.mark.parametrize("n", [1, 2, 7, 64, 1000, 5000])
@pytest.mark.parametrize("density", [0.01, 0.02, 0.1, 0.25])
def test_a_chunk_round_trips_and_equals_the_rule_written_in_torch(n: int, density: float) -> None:
    values = np.random.default_rng(n).standard_normal(n).astype(np.float32)
    payload, chunk = sparse_wire.encode(values, density)
    decoded = sparse_wire.decode(payload, n)
    assert np.array_equal(decoded.q, chunk.q) and decoded.step == chunk.step
    assert decoded.count == chunk.count == min(n, math.ceil(density * n))
    expected = sparse_chunk(torch.from_numpy(values), density).numpy()
    assert np.array_equal(decoded.values(), expected)  # bitwise: the same float32 operations
    assert set(np.unique(decoded.q)) <= {-3, -1, 0, 1, 3}


def test_ties_go_to_the_lowest_index_and_levels_round_half_to_even() -> None:
    _, chunk = payload_of([1, 3, 1, 1, 3, 1], 0.5)  # k = 3: both 3s, then index 0's 1
    assert chunk.q.tolist() == [1, 3, 0, 0, 3, 0] and chunk.step == 1.0
    # x / step = 2: (2 + 3) / 2 = 2.5 rounds to 2, level 1; -2: 0.5 rounds to 0, level -3.
    _, chunk = payload_of([3, 2, -2, 0], 0.75)
    assert chunk.q.tolist() == [3, 1, -3, 0]


def test_the_shorter_index_form_is_chosen_and_the_sizes_are_as_documented() -> None:
    sparse, _ = payload_of(np.arange(1000, dtype=np.float32), 0.02)  # 20 adjacent: gaps
    assert sparse[0] == sparse_wire.FORM_GAPS
    assert len(sparse) == 1 + 2 + 1 + 4 + (2 + 19) + 5  # form, n, k, step, gaps, codes
    spread = np.zeros(64, dtype=np.float32)
    spread[::4] = 1.0  # 16 of 64, gaps of 3 = 16 bytes > an 8-byte bitmap
    dense, chunk = payload_of(spread, 0.25)
    assert dense[0] == sparse_wire.FORM_BITMAP and chunk.count == 16
    assert len(dense) == 1 + 1 + 1 + 4 + 8 + 4


def test_a_zero_chunk_sends_nothing_and_a_nan_one_decodes_to_nan() -> None:
    payload, chunk = payload_of([0, 0, 0], 0.25)
    assert chunk.count == 0 and chunk.step == 0 and not chunk.values().any()
    assert sparse_wire.decode(payload, 3).count == 0
    payload, chunk = payload_of([1, math.inf, 2], 0.25)
    decoded = sparse_wire.decode(payload, 3)
    assert decoded.count == 0 and math.isnan(decoded.step)
    assert np.isnan(decoded.values()).all()


@pytest.mark.parametrize("density", [0, -0.1, 0.26, math.nan, True, "0.1"])
def test_a_density_outside_the_range_is_refused(density: object) -> None:
    assert sparse_wire.density_problem(density) is not None
    with pytest.raises(ValueError, match="density"):
        SparseWire(density=density)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="answer_density"):
        SparseWire(0.02, answer_density=density)  # type: ignore[arg-type]


# ----------------------------------------------------------- hostile payloads
def header_bytes(form: int, n: int, k: int, step: float) -> bytes:
    return bytes([form, n, k]) + struct.pack("<f", step)


@pytest.mark.parametrize(
    ("payload", "n", "words"),
    [
        (b"", 4, ["form", "no byte"]),
        (bytes([7, 4, 0]) + bytes(4), 4, ["form 7"]),
        (header_bytes(0, 4, 0, 0.0), 5, ["claims 4", "says 5"]),
        (header_bytes(0, 4, 5, 1.0), 4, ["selects 5", "of its 4"]),
        (header_bytes(0, 4, 1, -1.0), 4, ["negative"]),
        (header_bytes(0, 4, 1, math.nan) + bytes([0, 0]), 4, ["1 elements", "nan"]),
        (header_bytes(0, 4, 1, 0.0) + bytes([0, 0]), 4, ["1 elements", "0.0"]),
        (header_bytes(0, 4, 2, 1.0) + bytes([1, 5, 0]), 4, ["index reaches 7", "4 elements"]),
        (header_bytes(0, 4, 2, 1.0) + bytes([1]), 4, ["1 index varints", "says 2"]),
        (header_bytes(0, 4, 1, 1.0) + bytes([0, 0, 0]), 4, ["10 bytes", "need 9"]),
        (header_bytes(0, 4, 1, 1.0) + bytes([0]), 4, ["payload has", "need"]),
        (header_bytes(0, 4, 1, 1.0) + bytes([0, 0x10]), 4, ["padding"]),
        (header_bytes(0, 100, 1, 1.0) + bytes([0x80] * 6 + [0, 0]), 100, ["past 5 bytes"]),
        (header_bytes(1, 4, 1, 1.0) + bytes([0x03, 0]), 4, ["bitmap sets 2 bits", "says 1"]),
        (header_bytes(1, 4, 1, 1.0) + bytes([0x20, 0]), 4, ["at or past", "4 elements"]),
        (header_bytes(1, 16, 1, 1.0), 16, ["inside the bitmap"]),
        (bytes([0, 0x80]), 4, ["ends inside the element count"]),
        (bytes([0, 4, 1, 0]), 4, ["ends inside the step"]),
    ],
)
def test_a_malformed_payload_is_refused_saying_what_and_both_values(
    payload: bytes, n: int, words: list[str]
) -> None:
    with pytest.raises(sparse_wire.SparseWireError) as refused:
        sparse_wire.decode(payload, n)
    for word in words:
        assert word in str(refused.value), (word, str(refused.value))


def test_random_bytes_never_decode_into_anything_out_of_range() -> None:
    rng = random.Random(5)
    good, _ = payload_of(np.random.default_rng(1).standard_normal(300), 0.05)
    for _ in range(3000):
        mutated = bytearray(good)
        for _ in range(rng.randint(1, 4)):
            mutated[rng.randrange(len(mutated))] = rng.randrange(256)
        try:
            decoded = sparse_wire.decode(bytes(mutated), 300)
        except sparse_wire.SparseWireError:
            continue
        assert decoded.q.size == 300 and set(np.unique(decoded.q)) <= {-3, -1, 0, 1, 3}


# ------------------------------------------------------------------ the worker
def test_sparse_settings_map_to_int8_wire_and_answer_and_refuse_another_answer() -> None:
    wire = SparseWire(0.03)
    assert sparse_settings(wire, None) == (wire, torch.int8, torch.int8)
    assert sparse_settings(torch.int8, None) == (None, torch.int8, None)
    assert wire.downlink_density == 0.03 and SparseWire(0.03, 0.01).downlink_density == 0.01
    with pytest.raises(ValueError, match="answer_dtype"):
        sparse_settings(wire, torch.bfloat16)


def test_diloco_leaves_outer_momentum_to_the_wire_unless_the_caller_sets_it() -> None:
    from gradsync import DiLoCo

    assert inspect.signature(DiLoCo).parameters["outer_momentum"].default is None
    assert default_outer_momentum(None, SparseWire(0.02)) == 0.0
    for dense in (None, torch.int8, torch.bfloat16):
        assert default_outer_momentum(None, dense) == 0.5
    assert default_outer_momentum(0.9, SparseWire(0.02)) == 0.9
    assert default_outer_momentum(0.0, torch.int8) == 0.0


def test_the_hook_cuts_on_the_grid_and_feeds_back_exactly_what_is_not_summed() -> None:
    grid = ChunkGrid(CHUNK, 2)
    hook = SparseQuantization(lambda: grid, error_feedback=True, density=0.1)
    hook.seeding = False
    flat = torch.from_numpy(np.random.default_rng(3).standard_normal(300).astype(np.float32))
    bucket = GradBucket(0, 1, flat, ["w"], 2)
    wire = hook.before_upload(None, bucket)
    assert isinstance(wire, Int8Wire) and wire.encoded is not None and wire.int8_answer
    spans = grid.spans(300)
    assert sorted(wire.encoded) == [offset for offset, _ in spans]
    summed = torch.zeros(300)
    for offset, length in spans:
        decoded = sparse_wire.decode(wire.encoded[offset], length)
        summed[offset : offset + length] = torch.from_numpy(decoded.values())
    assert hook.residuals is not None
    assert torch.equal(hook.residuals[0], flat - summed)  # everything not sent, rounding incl.
    second = hook.before_upload(None, bucket)  # the residual rides on the next upload
    assert isinstance(second, Int8Wire) and second.encoded is not None
    carried = flat + (flat - summed)
    for offset, length in spans:
        decoded = sparse_wire.decode(second.encoded[offset], length)
        want = sparse_chunk(carried[offset : offset + length], 0.1).numpy()
        assert np.array_equal(decoded.values(), want)


def test_a_sparse_bucket_goes_out_as_its_encoded_chunks_with_the_sparse_encoding() -> None:
    payloads = {0: b"\x00\x40\x00\x00\x00\x00\x00", 64: b"\x00\x24\x00\x00\x00\x00\x00"}
    buffer = BucketBuffer([np.zeros(100, dtype=np.uint8)], encoded=payloads)
    assert buffer.wire_bytes == 14
    upload = BucketUpload(2, 0, buffer, INT8, reply_dtype=INT8)
    (part,) = split_upload(upload, 1)
    assert part is not None
    events: list[str] = []
    sent = [
        decode_gradient(m) for m in range_messages(part, 64, 0, lambda e, s, b: events.append(e))
    ]
    assert [(h.offset, h.encoding, h.scale, bytes(p)) for h, p in (d for d in sent if d)] == [
        (0, pb.ENCODING_TOPK2, 0.0, payloads[0]),
        (64, pb.ENCODING_TOPK2, 0.0, payloads[64]),
    ]
    assert events == ["upload_start", "upload_end"]


def test_the_worker_decodes_a_sparse_answer_and_refuses_a_bad_one() -> None:
    results = StepResults(0, None)
    results.bucket_bytes = [100]
    results.chunk_bytes = 64
    target = BucketBuffer([np.zeros(100, dtype=np.uint8)])
    results.expect(1, 0, target, INT8)
    payload, chunk = payload_of(np.linspace(-1, 1, 64), 0.1)
    answer = ChunkHeader(step=1, offset=0, dtype=INT8, encoding=pb.ENCODING_TOPK2)
    assert results.on_gradient(answer, memoryview(payload)) is None
    assert target.scales[0] == chunk.step
    assert np.array_equal(target.segments[0][:64].view(np.int8), chunk.q)
    short, _ = payload_of(np.ones(30), 0.1)  # 30 elements where the grid says 36
    late = ChunkHeader(step=1, offset=64, dtype=INT8, encoding=pb.ENCODING_TOPK2)
    problem = results.on_gradient(late, memoryview(short))
    assert problem is not None and "claims 30" in problem and "says 36" in problem
    raw_results = StepResults(0, None)
    raw_results.bucket_bytes = [400]
    raw_results.expect(1, 0, BucketBuffer([np.zeros(400, dtype=np.uint8)]), F32)
    problem = raw_results.on_gradient(
        ChunkHeader(step=1, offset=0, dtype=F32, encoding=pb.ENCODING_TOPK2), memoryview(payload)
    )
    assert problem is not None and "sparse" in problem and "float32" in problem


# ------------------------------------------------------------- the coordinator
def sparse_header(offset: int, scale: float = 0.0) -> ChunkHeader:
    return ChunkHeader(
        step=0,
        bucket_index=0,
        offset=offset,
        dtype=INT8,
        reply_dtype=F32,
        scale=scale,
        encoding=pb.ENCODING_TOPK2,
    )


@pytest.mark.parametrize("shard_count", [1, 3])
@pytest.mark.parametrize("seed", range(3))
def test_sparse_chunks_are_summed_dense_in_fp32_in_rank_order_whatever_the_arrival(
    shard_count: int, seed: int
) -> None:
    rng = random.Random(seed)
    ranks, elements = 3, rng.choice([37, 100, 203])
    grid = ChunkGrid(CHUNK, shard_count).spans(elements)
    uploads = [
        np.random.default_rng(seed * 10 + r).standard_normal(elements).astype(np.float32) * (r + 1)
        for r in range(ranks)
    ]
    wires = [sparse_wire.encode_bucket(u, grid, 0.1) for u in uploads]
    total = np.zeros(elements, dtype=np.float32)
    for _, q, steps in wires:  # the reference: each chunk's q * step, in rank order
        for offset, length in grid:
            total[offset : offset + length] += q[offset : offset + length].astype(
                np.float32
            ) * np.float32(steps[offset])
    expected = (total / np.float32(ranks)).astype("<f4").tobytes()
    steps = open_steps(ranks, elements, shard_count)
    arrivals = []
    for step in steps:
        lo, hi = step.byte_range(0, INT8)
        for offset, _ in chunking.range_chunk_spans(lo, hi, CHUNK):
            arrivals += [(step, r, offset) for r in range(ranks)]
    rng.shuffle(arrivals)
    got: dict[int, bytes] = {}
    for step, rank, offset in arrivals:
        payload = memoryview(wires[rank][0][offset])
        for reply, data in replies(step.accept(rank, sparse_header(offset), payload)):
            assert reply.dtype == F32 and reply.contributors == ranks
            got[reply.offset] = data
    assert all(step.step == 1 for step in steps), "every shard's step completes"
    assert b"".join(got[o] for o in sorted(got)) == expected


def test_the_coordinator_refuses_hostile_sparse_chunks_naming_rank_step_and_bucket() -> None:
    (step,) = open_steps(2, 100, 1)
    good, _ = payload_of(np.ones(64), 0.1)
    cases = [
        (sparse_header(0), payload_of(np.ones(36), 0.1)[0], ["36 bytes", "expected 64"]),
        (sparse_header(0, scale=0.5), good, ["header scale", "0.5"]),
        (sparse_header(0), good[:-1], ["payload has", "need"]),
        (sparse_header(0), bytes([9]), ["form 9"]),
        (sparse_header(0), header_bytes(0, 64, 70, 1.0), ["selects 70", "of its 64"]),
    ]
    for chunk, payload, words in cases:
        refused = refusal(step, 1, chunk, payload)
        assert refused.code == Code.INVALID_ARGUMENT
        for word in ["rank 1", "bucket 0", "step 0", *words]:
            assert word in refused.message, (word, refused.message)
    float_chunk = ChunkHeader(step=0, offset=0, dtype=F32, encoding=pb.ENCODING_TOPK2)
    refused = refusal(step, 0, float_chunk, bytes(256))
    assert "encoding 1" in refused.message and "as float32" in refused.message


def test_a_nan_sparse_chunk_is_a_non_finite_contribution_under_the_policy() -> None:
    (step,) = open_steps(2, 64, 1, nonfinite="report")
    nan, _ = payload_of([math.nan] * 64, 0.1)
    good, _ = payload_of(np.ones(64), 0.1)
    step.accept(0, sparse_header(0), memoryview(nan))
    data = replies(step.accept(1, sparse_header(0), memoryview(good)))[-1][1]
    assert step.nonfinite.count == 1 and "rank 0" in step.nonfinite.last
    assert np.isnan(np.frombuffer(data, "<f4")).all()


def test_the_sparse_answer_moves_the_public_copy_by_exactly_what_the_ranks_add() -> None:
    public = PublicCopy(INT8, 0.05)
    start = np.random.default_rng(0).standard_normal(200).astype(np.float32)
    public.commit({0: start}, seeding=True)
    exact = start + np.random.default_rng(1).standard_normal(200).astype(np.float32) * 0.1
    payload = public.answer(0, 0, 0, exact)
    assert public.encoding_at(0, 0) == pb.ENCODING_TOPK2 and public.scale_at(0, 0) == 0.0
    decoded = sparse_wire.decode(bytes(payload), 200)
    assert decoded.count == 10 and len(payload) < 200 * 4 / 30
    public.commit({}, seeding=False)
    assert np.array_equal(public.values[0], start + decoded.values())
    # What the answer left out is the hub's residual: exact - public, sent later.
    residual = exact - public.values[0]
    assert np.count_nonzero(residual) > 150
    second = sparse_wire.decode(bytes(public.answer(0, 0, 0, exact)), 200)
    assert np.array_equal(second.values(), sparse_chunk(torch.from_numpy(residual), 0.05).numpy())


def test_the_answer_density_is_validated_with_the_signature() -> None:
    outer = pb.OuterOptimizer(lr=0.7, answer_dtype=INT8, answer_density=0.02)
    assert answer_dtype_problem(outer) is None
    outer.answer_density = 0.5
    assert "(0, 0.25]" in (answer_dtype_problem(outer) or "")
    outer = pb.OuterOptimizer(lr=0.7, answer_dtype=pb.DTYPE_BFLOAT16, answer_density=0.02)
    assert "needs the int8 answer dtype" in (answer_dtype_problem(outer) or "")
