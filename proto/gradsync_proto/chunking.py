"""Chunking maths shared by the client and the coordinator.

Tensors travel as raw little-endian bytes cut into fixed-size chunks: chunk k
of a buffer covers bytes [k * chunk_bytes, min((k + 1) * chunk_bytes, size)).
Both ends derive chunk boundaries from this one rule, so the coordinator can
check every offset and length and reduce chunk by chunk as they complete.

A sharded coordinator splits every bucket into one contiguous element range
per shard (`shard_ranges`) and each range is chunked on its own grid
(`range_chunk_spans`): chunk k of range [lo, hi) covers
[lo + k * chunk_bytes, min(lo + (k + 1) * chunk_bytes, hi)). With one shard
this is exactly the unsharded rule. Ranges are cut by elements, never inside
one, so every element is averaged whole by one shard and the result is the
same bytes for any shard count.
"""

from __future__ import annotations

from collections.abc import Iterator

from gradsync_proto.defaults import CHUNK_BYTES as DEFAULT_CHUNK_BYTES, HEADER_SLACK_BYTES

__all__ = [
    "DEFAULT_CHUNK_BYTES",
    "HEADER_SLACK_BYTES",
    "chunk_spans",
    "expected_chunk_length",
    "num_chunks",
    "range_chunk_spans",
    "shard_byte_range",
    "shard_ranges",
]


def chunk_spans(total_bytes: int, chunk_bytes: int) -> Iterator[tuple[int, int]]:
    """Yield (offset, length) of every chunk of a `total_bytes` buffer."""
    for offset in range(0, total_bytes, chunk_bytes):
        yield offset, min(chunk_bytes, total_bytes - offset)


def num_chunks(total_bytes: int, chunk_bytes: int) -> int:
    """How many chunks a `total_bytes` buffer is cut into."""
    return -(-total_bytes // chunk_bytes)


def expected_chunk_length(total_bytes: int, chunk_bytes: int, offset: int) -> int:
    """Length the chunk starting at `offset` must have (offset must be aligned)."""
    return min(chunk_bytes, total_bytes - offset)


def shard_ranges(num_elements: int, shard_count: int) -> list[tuple[int, int]]:
    """Element ranges [start, stop) of a bucket, one per shard, in shard order.

    The ranges differ in length by at most one element and the longer ones
    come first, so shard 0 (the leader) holds part of every non-empty bucket
    and sees every bucket of every step. A shard whose range is empty for a
    bucket (only when the bucket has fewer elements than there are shards)
    receives nothing for it.
    """
    if shard_count < 1:
        raise ValueError(f"a coordinator has at least one shard, got {shard_count}")
    base, extra = divmod(num_elements, shard_count)
    ranges = []
    start = 0
    for index in range(shard_count):
        stop = start + base + (1 if index < extra else 0)
        ranges.append((start, stop))
        start = stop
    return ranges


def shard_byte_range(
    num_elements: int, itemsize: int, shard_count: int, shard_index: int
) -> tuple[int, int]:
    """Byte range [lo, hi) of shard `shard_index` in a bucket of `itemsize`-byte elements."""
    start, stop = shard_ranges(num_elements, shard_count)[shard_index]
    return start * itemsize, stop * itemsize


def range_chunk_spans(lo: int, hi: int, chunk_bytes: int) -> Iterator[tuple[int, int]]:
    """Yield (offset, length) of every chunk of the byte range [lo, hi) of a buffer."""
    for offset in range(lo, hi, chunk_bytes):
        yield offset, min(chunk_bytes, hi - offset)
