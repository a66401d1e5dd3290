"""The coordinator's floating all-reduce, combined chunk by chunk from the chunks as they came."""

from __future__ import annotations

import random

import numpy as np
import pytest
from gradsync_proto.v1 import gradsync_pb2 as pb
from gradsync_server.control.collective_ops import reduce_inputs
from gradsync_server.dataplane.budget import ByteBudget
from gradsync_server.dataplane.collective_fold import HeldInput, encode_result, folded_results
from gradsync_server.errors import RejectedMessage

CHUNK = 64


@pytest.mark.parametrize(
    ("op", "dtype", "numpy_dtype"),
    [
        (pb.COLLECTIVE_OP_SUM, pb.DTYPE_FLOAT32, np.float32),
        (pb.COLLECTIVE_OP_AVG, pb.DTYPE_FLOAT16, np.float16),
        (pb.COLLECTIVE_OP_MAX, pb.DTYPE_FLOAT64, np.float64),
        (pb.COLLECTIVE_OP_PRODUCT, pb.DTYPE_FLOAT32, np.float32),
    ],
)
def test_chunks_in_any_order_give_the_reassembled_rank_order_result(
    op: int, dtype: int, numpy_dtype: type
) -> None:
    rng = np.random.default_rng(op)
    inputs = [(rng.standard_normal(50) * 100).astype(numpy_dtype).tobytes() for _ in range(3)]
    budget = ByteBudget(1 << 20).for_owner("job")
    held = [HeldInput(f"input of rank {r}", len(inputs[0]), CHUNK, budget) for r in range(3)]
    arrivals = [(r, o) for r in range(3) for o in range(0, len(inputs[0]), CHUNK)]
    random.Random(op).shuffle(arrivals)
    for rank, offset in arrivals:  # each payload its own object, as a parsed message's
        held[rank].add(offset, bytes(inputs[rank][offset : offset + CHUNK]), len(inputs[0]))
    assert all(item.complete for item in held) and budget.budget.used == 3 * len(inputs[0])
    folded = b"".join(bytes(p) for _, p in folded_results(op, dtype, [h.chunks for h in held]))
    assert folded == bytes(reduce_inputs(op, dtype, inputs))  # bit for bit
    # One float32 input (a host group covering every rank) is answered with its own chunks.
    ((_, alone),) = folded_results(pb.COLLECTIVE_OP_SUM, pb.DTYPE_FLOAT32, [{0: inputs[0][:8]}])
    assert alone == inputs[0][:8]
    for item in held:
        item.release()
    assert budget.budget.used == 0


def test_a_result_is_encoded_once_as_the_message_protobuf_would_make() -> None:
    fields = pb.CollectiveChunk(sequence=7, op=pb.COLLECTIVE_OP_SUM, total_bytes=300, offset=256)
    payload = bytes(range(44))
    message = pb.CoordinatorMessage.FromString(encode_result(fields, memoryview(payload)))
    assert message.collective.payload == payload and message.collective.sequence == 7
    assert message.collective.offset == 256 and message.collective.total_bytes == 300


def test_a_chunk_off_the_grid_or_over_the_budget_is_refused_before_it_is_kept() -> None:
    budget = ByteBudget(200).for_owner("job")  # (a job's share: half)
    item = HeldInput("collective 3 (all_reduce sum) of 192 bytes from rank 1", 192, CHUNK, budget)
    with pytest.raises(RejectedMessage, match="offset 8 is out of range or misaligned"):
        item.add(8, bytes(CHUNK), 192)
    item.add(0, bytes(CHUNK), 192)
    with pytest.raises(RejectedMessage, match="no room for 64 more bytes at offset 64"):
        item.add(64, bytes(CHUNK), 192)
    assert item.received == CHUNK and list(item.chunks) == [0]
