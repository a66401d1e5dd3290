"""Is this gradient chunk where the chunking rule says it must be? (pure logic).

Gradient uploads are cut by the one rule of `gradsync_proto.chunking`, so the
coordinator checks each chunk's offset and length against it before it folds
a byte in, and says what it expected. A coordinator shard checks its byte
range's grid instead (`check_range_chunk`). Blobs (checkpoints, state,
collectives) are checked by `gradsync_proto.blobs.BlobAssembly`.
"""

from __future__ import annotations

from gradsync_proto import chunking
from gradsync_proto.codes import Code


def check_chunk(
    what: str, offset: int, length: int, total: int, container: str, chunk_bytes: int, rank: int
) -> tuple[Code, str] | None:
    """Why a chunk of `length` bytes at `offset` of a `total`-byte blob is malformed, or None."""
    if length > chunk_bytes:
        return (
            Code.RESOURCE_EXHAUSTED,
            f"rank {rank} sent {length} bytes in one chunk of {what}; "
            f"the chunk limit is {chunk_bytes} bytes",
        )
    if offset % chunk_bytes or offset >= total:
        return (
            Code.INVALID_ARGUMENT,
            f"rank {rank} sent {what} at offset {offset}; offsets must be multiples of "
            f"{chunk_bytes} below {total} ({container} has {total} bytes)",
        )
    expected = chunking.expected_chunk_length(total, chunk_bytes, offset)
    if length != expected:
        return (
            Code.INVALID_ARGUMENT,
            f"rank {rank} sent {length} bytes for {what} at offset {offset}, "
            f"expected {expected} ({container} has {total} bytes)",
        )
    return None


def check_range_chunk(
    what: str,
    offset: int,
    length: int,
    byte_range: tuple[int, int],
    container: str,
    chunk_bytes: int,
    rank: int,
    shard: str,
) -> tuple[Code, str] | None:
    """Why a chunk is not one of `range_chunk_spans(lo, hi, chunk_bytes)`, or None.

    The sharded twin of `check_chunk`: offsets stay absolute in the bucket, but
    the grid starts at the shard's `lo`, so a chunk meant for another shard (or
    cut on the unsharded grid) is refused with both ranges named.
    """
    lo, hi = byte_range
    if length > chunk_bytes:
        return (
            Code.RESOURCE_EXHAUSTED,
            f"rank {rank} sent {length} bytes in one chunk of {what} to {shard}; "
            f"the chunk limit is {chunk_bytes} bytes",
        )
    if not lo <= offset < hi or (offset - lo) % chunk_bytes:
        return (
            Code.INVALID_ARGUMENT,
            f"rank {rank} sent {what} at offset {offset} to {shard}, which holds bytes "
            f"[{lo}, {hi}) of {container}; offsets must be {lo} + multiples of {chunk_bytes} "
            f"below {hi}",
        )
    expected = min(chunk_bytes, hi - offset)
    if length != expected:
        return (
            Code.INVALID_ARGUMENT,
            f"rank {rank} sent {length} bytes for {what} at offset {offset} to {shard}, "
            f"expected {expected} ({shard} holds bytes [{lo}, {hi}) of {container})",
        )
    return None
