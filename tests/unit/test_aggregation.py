"""Aggregation: randomized interleavings against a float64 reference, bitwise reproducible."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from gradsync_proto import chunking
from gradsync_proto.v1 import gradsync_pb2 as pb
from gradsync_server.dataplane.aggregation import BucketReduction, DuplicateContributionError

CHUNK = 4096


def contributions(world_size: int, elements: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    # Wide dynamic range makes float32 sums order-sensitive: a real test of determinism.
    return [
        (rng.standard_normal(elements) * 10.0 ** rng.integers(-4, 4, elements)).astype(np.float32)
        for _ in range(world_size)
    ]


def reduce_in_order(arrays: list[bytes], dtype: int, order: list[tuple[int, int]]) -> bytes:
    """Feed (rank, offset) pairs in `order`; return the assembled average."""
    total = len(arrays[0])
    reduction = BucketReduction(range(len(arrays)), dtype, total, CHUNK)
    result = bytearray(total)
    for rank, offset in order:
        length = chunking.expected_chunk_length(total, CHUNK, offset)
        averaged = reduction.add(rank, offset, arrays[rank][offset : offset + length])
        if averaged is not None:
            result[offset : offset + len(averaged)] = averaged
    assert reduction.complete
    assert reduction.buffered_bytes == 0
    return bytes(result)


def all_pieces(world_size: int, total: int) -> list[tuple[int, int]]:
    return [(r, off) for r in range(world_size) for off, _ in chunking.chunk_spans(total, CHUNK)]


@pytest.mark.parametrize("world_size", range(2, 9))
def test_random_interleavings_match_float64_reference_bitwise(world_size: int) -> None:
    elements = 5 * CHUNK // 4 + 123  # several chunks, the last one partial
    grads = contributions(world_size, elements, seed=world_size)
    raw = [g.tobytes() for g in grads]
    reference = np.mean(np.stack(grads).astype(np.float64), axis=0)
    pieces = all_pieces(world_size, len(raw[0]))
    results = set()
    rng = random.Random(world_size)
    for _ in range(20):
        rng.shuffle(pieces)
        results.add(reduce_in_order(raw, pb.DTYPE_FLOAT32, list(pieces)))
    assert len(results) == 1, "the average depends on arrival order"
    averaged = np.frombuffer(results.pop(), dtype=np.float32)
    scale = np.abs(np.stack(grads)).max(axis=0).astype(np.float64)
    # fp32 accumulation: error bounded by a few ulps of the largest term.
    assert np.all(np.abs(averaged - reference) <= 4 * world_size * np.finfo(np.float32).eps * scale)


def test_float32_sum_would_differ_by_order_without_rank_ordering() -> None:
    # Guards the test above: for these inputs naive arrival-order sums differ,
    # so equality across orderings is evidence of rank-ordered summation.
    grads = contributions(6, 4096, seed=3)
    forward = np.zeros(4096, np.float32)
    for g in grads:
        forward += g
    backward = np.zeros(4096, np.float32)
    for g in reversed(grads):
        backward += g
    assert not np.array_equal(forward, backward)


@pytest.mark.parametrize(
    ("dtype", "torch_dtype"),
    [
        (pb.DTYPE_FLOAT16, torch.float16),
        (pb.DTYPE_BFLOAT16, torch.bfloat16),
        (pb.DTYPE_FLOAT64, torch.float64),
    ],
)
def test_other_dtypes_accumulate_wide_and_round_like_torch(
    dtype: int, torch_dtype: torch.dtype
) -> None:
    world_size = 4
    values = [
        torch.randn(3000, generator=torch.Generator().manual_seed(r)).to(torch_dtype)
        for r in range(world_size)
    ]
    raw = [v.view(torch.uint8).numpy().tobytes() for v in values]
    pieces = all_pieces(world_size, len(raw[0]))
    random.Random(7).shuffle(pieces)
    averaged = torch.frombuffer(bytearray(reduce_in_order(raw, dtype, pieces)), dtype=torch_dtype)
    accumulate = torch.float64 if torch_dtype == torch.float64 else torch.float32
    total = values[0].to(accumulate)
    for v in values[1:]:
        total = total + v.to(accumulate)
    expected = (total / world_size).to(torch_dtype)
    assert torch.equal(averaged, expected)


def test_duplicate_contribution_is_refused() -> None:
    reduction = BucketReduction([0, 1], pb.DTYPE_FLOAT32, CHUNK, CHUNK)
    reduction.add(1, 0, bytes(CHUNK))
    with pytest.raises(DuplicateContributionError):
        reduction.add(1, 0, bytes(CHUNK))


def test_buffered_bytes_track_parked_out_of_order_chunks() -> None:
    reduction = BucketReduction([0, 1, 2], pb.DTYPE_FLOAT32, CHUNK, CHUNK)
    assert reduction.add(2, 0, bytes(CHUNK)) is None
    assert reduction.add(1, 0, bytes(CHUNK)) is None
    assert reduction.buffered_bytes == 2 * CHUNK  # both parked until rank 0 arrives
    assert reduction.add(0, 0, bytes(CHUNK)) is not None
    assert reduction.buffered_bytes == 0


def test_subset_of_ranks_divides_by_contributors() -> None:
    reduction = BucketReduction([3, 1], pb.DTYPE_FLOAT32, 8, CHUNK)
    reduction.add(3, 0, np.array([3.0, 6.0], np.float32).tobytes())
    averaged = reduction.add(1, 0, np.array([1.0, 2.0], np.float32).tobytes())
    assert averaged is not None
    assert reduction.contributors == 2
    np.testing.assert_array_equal(np.frombuffer(averaged, np.float32), [2.0, 4.0])
