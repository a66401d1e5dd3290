"""Chunking maths shared by the client and the coordinator.

Tensors travel as raw little-endian bytes cut into fixed-size chunks: chunk k
of a buffer covers bytes [k * chunk_bytes, min((k + 1) * chunk_bytes, size)).
Both ends derive chunk boundaries from this one rule, so the coordinator can
check every offset and length and reduce chunk by chunk as they complete.
"""

from __future__ import annotations

from collections.abc import Iterator

from gradsync.protocol.defaults import CHUNK_BYTES as DEFAULT_CHUNK_BYTES
from gradsync.protocol.defaults import HEADER_SLACK_BYTES

__all__ = [
    "DEFAULT_CHUNK_BYTES",
    "HEADER_SLACK_BYTES",
    "chunk_spans",
    "expected_chunk_length",
    "num_chunks",
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
