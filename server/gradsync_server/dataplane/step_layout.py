"""The job's bucket layout at one coordinator process, and where a chunk must fit in it (pure).

Split from `open_step` so that the step's bookkeeping reads apart from the
shape every chunk is checked against: each bucket's bytes, dtype and
elements, the byte range of it this shard aggregates (`chunking`), and the
checks of a chunk's dtype, reply dtype, encoding, offset, length and the byte
budget (`step_checks`), whatever step it claims. A late DiLoCo contribution
(`gradsync_server.dataplane.late`) passes the same checks as an on-time one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from gradsync_proto import chunking, dtypes
from gradsync_proto.codec import ChunkHeader
from gradsync_proto.v1 import gradsync_pb2 as pb

from gradsync_server.control import signature as signatures
from gradsync_server.dataplane.aggregation import BucketReduction
from gradsync_server.dataplane.budget import ByteBudget, OwnerBudget
from gradsync_server.dataplane.int8_chunks import contribution_of
from gradsync_server.dataplane.step_checks import (
    check_budget,
    check_encoding,
    check_reply_dtype,
    check_wire_dtype,
    offset_problem,
)
from gradsync_server.errors import RejectedMessage

__all__ = ["BucketLayout", "CheckedChunk"]


@dataclass(frozen=True)
class CheckedChunk:
    """What the checks of one chunk found out about it."""

    wire_dtype: int
    reply_dtype: int
    #: The bytes [lo, hi) of the bucket this shard aggregates, in wire bytes.
    byte_range: tuple[int, int]
    #: The whole bucket's size in wire bytes.
    wire_bytes: int
    #: The payload as it is summed (an int8 chunk dequantized to float32), and its dtype.
    payload: memoryview | bytes
    payload_dtype: int


class BucketLayout:
    """Every bucket's shape, and this shard's range of it.

    Args:
        chunk_bytes: chunk size every rank must use.
        shard_index, shard_count: which range of every bucket this process aggregates.
        shard_name: how errors name this process's range.
    """

    def __init__(self, chunk_bytes: int, shard_index: int, shard_count: int, shard_name: str):
        self.chunk_bytes = chunk_bytes
        self.shard_index = shard_index
        self.shard_count = shard_count
        self.shard_name = shard_name
        self.bucket_bytes: list[int] = []
        self.bucket_dtypes: list[int] = []
        self.bucket_elements: list[int] = []

    def configure(self, signature: pb.ModelSignature) -> list[tuple[int, int]]:
        """Learn the job's buckets; return this shard's byte range of each (native dtype)."""
        self.bucket_bytes = [signatures.bucket_bytes(b) for b in signature.buckets]
        self.bucket_dtypes = [b.dtype for b in signature.buckets]
        self.bucket_elements = [b.num_elements for b in signature.buckets]
        return [self.byte_range(b, dtype) for b, dtype in enumerate(self.bucket_dtypes)]

    @property
    def count(self) -> int:
        """How many buckets the job has."""
        return len(self.bucket_bytes)

    def byte_range(self, bucket: int, wire_dtype: int) -> tuple[int, int]:
        """Bytes [lo, hi) of `bucket`, sent as `wire_dtype`, that this shard aggregates."""
        return chunking.shard_byte_range(
            self.bucket_elements[bucket],
            dtypes.itemsize(wire_dtype),
            self.shard_count,
            self.shard_index,
        )

    def check(
        self,
        rank: int,
        chunk: ChunkHeader,
        payload: memoryview,
        reduction: BucketReduction | None,
        first_rank: int,
        outer: Callable[[int, ChunkHeader, int], int] | None,
        budget: ByteBudget | OwnerBudget,
    ) -> CheckedChunk:
        """Check a chunk's place in its bucket (anything but its step and sender).

        Args:
            reduction: the bucket's reduction in the step, if it began (the dtypes
                its first chunk, from `first_rank`, set must be kept).
            outer: for a bucket that holds global parameters, what checks and returns
                its reply dtype (`OuterState.check_reply`: float32 at the seed, then
                the job's answer dtype); None for any other bucket.

        Raises:
            RejectedMessage: naming the rank, step, bucket and both values.
        """
        step, bucket = chunk.step, chunk.bucket_index
        native = self.bucket_dtypes[bucket]
        wire_dtype = check_wire_dtype(rank, chunk, native, reduction, first_rank)
        if outer is not None:  # DiLoCo: the job's answer dtype (the same for every rank)
            reply_dtype = outer(rank, chunk, wire_dtype)
        else:
            reply_dtype = check_reply_dtype(rank, chunk, native, reduction, first_rank, wire_dtype)
        wire_bytes = (
            self.bucket_bytes[bucket] // dtypes.itemsize(native) * dtypes.itemsize(wire_dtype)
        )
        check_encoding(rank, chunk)
        byte_range = self.byte_range(bucket, wire_dtype)
        problem = offset_problem(
            rank,
            chunk,
            len(payload),
            wire_dtype,
            wire_bytes=wire_bytes,
            byte_range=byte_range,
            chunk_bytes=self.chunk_bytes,
            shard=(self.shard_count, self.shard_name),
            elements=self.bucket_elements[bucket],
        )
        if problem is not None:
            raise RejectedMessage(problem[0], problem[1], step=step, bucket_index=bucket)
        summed, payload_dtype = contribution_of(rank, chunk, payload, wire_dtype)  # int8: fp32
        check_budget(rank, chunk, len(summed), budget)
        return CheckedChunk(wire_dtype, reply_dtype, byte_range, wire_bytes, summed, payload_dtype)
