"""A 16-bit wire answered in float32 (`reply_dtype`): the bytes, their grid, and who may ask.

The float32 reply is the coordinator's fp32 accumulator divided, not rounded
back to 16 bits, and it is twice the wire bytes: it must come back cut on the
reply's own chunk grid (what a worker expects for a float32 bucket of the same
elements), with 1 shard and with several, in any arrival order.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from gradsync.path.bucket_uploads import expected_chunks
from gradsync_proto import chunking
from gradsync_proto.codec import ChunkHeader, decode_gradient
from gradsync_proto.codes import Code
from gradsync_proto.v1 import gradsync_pb2 as pb
from gradsync_server.dataplane.actions import Send
from gradsync_server.dataplane.budget import ByteBudget
from gradsync_server.dataplane.open_step import OpenStep
from gradsync_server.dataplane.plane import MembershipView, PlaneMember
from gradsync_server.errors import RejectedMessage

pytestmark = pytest.mark.unit

CHUNK = 64
F32, F64, BF16, F16 = pb.DTYPE_FLOAT32, pb.DTYPE_FLOAT64, pb.DTYPE_BFLOAT16, pb.DTYPE_FLOAT16
TORCH = {BF16: torch.bfloat16, F16: torch.float16}


def clock() -> float:
    return 0.0


def open_steps(ranks: int, elements: int, shard_count: int, native: int = F32) -> list[OpenStep]:
    membership = MembershipView("job", 0, {r: PlaneMember(r, f"inc-{r}") for r in range(ranks)})
    signature = pb.ModelSignature(buckets=[pb.BucketSpec(dtype=native, num_elements=elements)])
    steps = []
    for index in range(shard_count):
        step = OpenStep(membership, CHUNK, ByteBudget(1 << 30), clock, None, index, shard_count)
        step.configure(signature, 0)
        steps.append(step)
    return steps


def header(offset: int, wire: int, reply: int) -> ChunkHeader:
    return ChunkHeader(step=0, bucket_index=0, offset=offset, dtype=wire, reply_dtype=reply)


def replies(actions: list[object]) -> list[tuple[ChunkHeader, bytes]]:
    out = []
    for action in actions:
        if isinstance(action, Send) and isinstance(action.message, bytes):
            decoded = decode_gradient(action.message)
            assert decoded is not None
            out.append((decoded[0], bytes(decoded[1])))
    return out


@pytest.mark.parametrize("shard_count", [1, 3])
@pytest.mark.parametrize("wire", [BF16, F16])
@pytest.mark.parametrize("seed", range(3))
def test_a_float32_reply_is_the_divided_fp32_sum_cut_on_the_reply_grid(
    shard_count: int, wire: int, seed: int
) -> None:
    rng = random.Random(seed)
    ranks, elements = 3, rng.choice([37, 100, 203])
    gradients = [
        torch.randn(elements, generator=torch.Generator().manual_seed(seed * 10 + r))
        for r in range(ranks)
    ]
    wires = [g.to(TORCH[wire]) for g in gradients]
    payloads = [w.view(torch.uint8).numpy().tobytes() for w in wires]
    # The reference: 16-bit inputs widened, summed in fp32 in rank order, divided, not rounded.
    total = wires[0].float().numpy().copy()
    for w in wires[1:]:
        total += w.float().numpy()
    expected = (total / np.float32(ranks)).astype("<f4").tobytes()

    steps = open_steps(ranks, elements, shard_count)
    arrivals = []
    for step in steps:
        lo, hi = step.byte_range(0, wire)
        for offset, length in chunking.range_chunk_spans(lo, hi, CHUNK):
            arrivals += [(step, r, offset, length) for r in range(ranks)]
    rng.shuffle(arrivals)
    got: dict[int, bytes] = {}
    for step, rank, offset, length in arrivals:
        payload = memoryview(payloads[rank][offset : offset + length])
        for reply, data in replies(step.accept(rank, header(offset, wire, F32), payload)):
            assert reply.dtype == F32 and reply.contributors == ranks
            assert len(data) <= CHUNK, "a reply must fit the message limit (one chunk + slack)"
            assert reply.offset not in got, f"reply at {reply.offset} sent twice"
            got[reply.offset] = data
    assert all(step.step == 1 for step in steps), "every shard's step completes"
    grid = expected_chunks(elements * 4, F32, shard_count, CHUNK)
    assert {o: len(d) for o, d in got.items()} == grid
    assembled = b"".join(got[o] for o in sorted(got))
    assert assembled == expected


def test_an_unset_reply_dtype_answers_in_the_wire_dtype() -> None:
    (step,) = open_steps(2, 16, 1)
    step.accept(0, header(0, BF16, 0), memoryview(bytes(32)))
    (reply,) = replies(step.accept(1, header(0, BF16, BF16), memoryview(bytes(32))))
    assert reply[0].dtype == BF16 and len(reply[1]) == 32


def test_ranks_asking_for_different_reply_dtypes_are_refused() -> None:
    (step,) = open_steps(2, 16, 1)
    step.accept(0, header(0, BF16, F32), memoryview(bytes(32)))
    with pytest.raises(RejectedMessage) as refused:
        step.accept(1, header(0, BF16, 0), memoryview(bytes(32)))
    message = refused.value.message
    assert refused.value.code == Code.INVALID_ARGUMENT
    for part in ("rank 1", "bucket 0", "step 0", "bfloat16", "float32", "rank 0"):
        assert part in message, (part, message)


@pytest.mark.parametrize(
    ("native", "wire", "reply"),
    [(F64, BF16, F32), (F32, F32, BF16), (F32, BF16, F16), (F32, F32, F64)],
)
def test_a_reply_dtype_other_than_the_wire_or_fp32_for_a_16_bit_fp32_bucket_is_refused(
    native: int, wire: int, reply: int
) -> None:
    (step,) = open_steps(1, 16, 1, native)
    size = 16 * (2 if wire in (BF16, F16) else 4)
    with pytest.raises(RejectedMessage, match="asked for the average as"):
        step.accept(0, header(0, wire, reply), memoryview(bytes(size)))
