"""A sparse 2-bit chunk becomes float32 the moment it is accepted (pure).

DiLoCo's sparse wire (`gradsync_proto.sparse_wire`, `ENCODING_TOPK2`) sends an
INT8 chunk of a float32 bucket as its top-k elements: a payload whose size
says nothing about the chunk's place in the bucket. Its element count n is a
claim, read first (`claimed_length`) and checked against the chunk grid as
an int8 chunk's payload length would be (`chunk_checks.BucketLayout.check`);
only then is the payload decoded, every rule checked (selected count <= n,
indices strictly increasing and below n, the exact length, zero padding, a
step >= 0 and finite whenever anything is sent), and the chunk widened to n
float32 values q * step: a dense contribution from then on, summed in
float32 in rank order like any other, so the sum does not depend on which
rank's chunk came first. A NaN step (a rank's chunk held NaN or Inf) gives
NaN everywhere, for the `--nonfinite` policy to report or abort on.
"""

from __future__ import annotations

from gradsync_proto import sparse_wire
from gradsync_proto.codec import ChunkHeader
from gradsync_proto.codes import Code
from gradsync_proto.v1 import gradsync_pb2 as pb

from gradsync_server.errors import RejectedMessage

__all__ = ["claimed_length", "sparse_contribution"]


def _where(rank: int, chunk: ChunkHeader) -> str:
    return (
        f"rank {rank} sent bucket {chunk.bucket_index} of step {chunk.step} at offset "
        f"{chunk.offset} as a sparse chunk"
    )


def claimed_length(rank: int, chunk: ChunkHeader, payload: memoryview) -> int:
    """The element count (= int8 bytes) the sparse chunk claims, for the grid check.

    Raises:
        RejectedMessage: INVALID_ARGUMENT for a chunk that is not INT8, carries a header
            scale, or whose payload has no readable header, naming rank, step, bucket.
    """
    if chunk.dtype != pb.DTYPE_INT8:
        raise _refused(chunk, f"{_where(rank, chunk)} of dtype {chunk.dtype}; only INT8 is")
    if chunk.scale != 0:  # NaN included: the step travels in the payload
        raise _refused(
            chunk, f"{_where(rank, chunk)} with a header scale ({chunk.scale!r}); it must be 0"
        )
    try:
        return sparse_wire.claimed_length(payload)
    except sparse_wire.SparseWireError as error:
        raise _refused(chunk, f"{_where(rank, chunk)}: {error}") from None


def sparse_contribution(
    rank: int, chunk: ChunkHeader, payload: memoryview, elements: int
) -> tuple[memoryview, int]:
    """The sparse chunk's `elements` float32 values (a fresh array) and DTYPE_FLOAT32.

    Raises:
        RejectedMessage: INVALID_ARGUMENT naming rank, step, bucket, offset and what
            the payload says against what the rule allows.
    """
    try:
        decoded = sparse_wire.decode(payload, elements)
    except sparse_wire.SparseWireError as error:
        raise _refused(chunk, f"{_where(rank, chunk)}: {error}") from None
    return decoded.values().data.cast("B"), pb.DTYPE_FLOAT32


def _refused(chunk: ChunkHeader, message: str) -> RejectedMessage:
    return RejectedMessage(
        Code.INVALID_ARGUMENT, message, step=chunk.step, bucket_index=chunk.bucket_index
    )
