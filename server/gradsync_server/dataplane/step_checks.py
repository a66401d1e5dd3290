"""Does this gradient chunk belong to the open step? (pure checks, each with its reason).

`OpenStep.accept` runs a chunk through these before buffering a byte of it:
the sender's membership, epoch and step, the bucket index, the wire and reply
dtypes (a 16-bit comm hook may send a float32/float64 bucket, but every rank
must send each bucket alike), the encoding and the byte budget. They live
apart from the open step so that its module holds the reduction bookkeeping
and these the rules, each raising a `RejectedMessage` that names the values
involved. The chunk's offset and length are checked against the chunking
rule (`chunk_checks`) for the whole bucket, or for this shard's byte range of it.
"""

from __future__ import annotations

from collections.abc import Mapping

from gradsync_proto import dtypes
from gradsync_proto.codec import ChunkHeader
from gradsync_proto.codes import Code
from gradsync_proto.v1 import gradsync_pb2 as pb

from gradsync_server.dataplane.aggregation import BucketReduction
from gradsync_server.dataplane.budget import ByteBudget, OwnerBudget
from gradsync_server.dataplane.chunk_checks import check_chunk, check_range_chunk
from gradsync_server.dataplane.wire_replies import (
    COMPRESSED_WIRE,
    INT8_WIRE,
    reply_dtype_of,
    reply_dtype_problem,
)
from gradsync_server.errors import RejectedMessage

#: Native bucket dtypes a comm hook may send as float16/bfloat16.
COMPRESSIBLE = (pb.DTYPE_FLOAT32, pb.DTYPE_FLOAT64)


def check_sender(
    rank: int,
    chunk: ChunkHeader,
    *,
    job_id: str,
    members: Mapping[int, object],
    epochs: tuple[int, int],
    open_step: int,
    bucket_count: int,
    out_of_inputs: set[int],
) -> None:
    """Is `rank` a member contributing to `open_step`, and is the bucket one of the model's?

    Args:
        epochs: the epoch the open step began in and the current one (a step
            begun before a membership change may finish in the old epoch).

    Raises:
        RejectedMessage: the chunk comes from the wrong epoch, step or rank, or
            names a bucket the model does not have.
    """
    step, bucket = chunk.step, chunk.bucket_index
    start_epoch, epoch = epochs
    if not start_epoch <= chunk.membership_epoch <= epoch:
        raise RejectedMessage(
            Code.FAILED_PRECONDITION,
            f"rank {rank} sent step {step} for membership epoch {chunk.membership_epoch}, "
            f"expected epoch {epoch}",
            step=step,
        )
    if rank not in members:
        raise RejectedMessage(
            Code.FAILED_PRECONDITION,
            f"rank {rank} sent step {step} but is not a member of job "
            f"'{job_id}' (epoch {epoch}); it must rejoin first",
            step=step,
        )
    if step != open_step:
        kind = "stale" if step < open_step else "future"
        raise RejectedMessage(
            Code.FAILED_PRECONDITION,
            f"rank {rank} sent {kind} step {step} (bucket {bucket}), expected step {open_step}",
            step=step,
            bucket_index=bucket,
        )
    if bucket >= bucket_count:
        raise RejectedMessage(
            Code.INVALID_ARGUMENT,
            f"rank {rank} sent bucket {bucket} for step {step}, but the model has "
            f"{bucket_count} buckets (0..{bucket_count - 1})",
            step=step,
        )
    if rank in out_of_inputs:
        raise RejectedMessage(
            Code.FAILED_PRECONDITION,
            f"rank {rank} sent bucket {bucket} of step {step} after running out of inputs "
            "(join()); it contributes nothing until every rank has joined",
            step=step,
            bucket_index=bucket,
        )


def check_wire_dtype(
    rank: int, chunk: ChunkHeader, native: int, held: BucketReduction | None, first_rank: int
) -> int:
    """The chunk's wire dtype, if allowed: the bucket's, 16-bit for a wider float, or
    int8 (with a scale per chunk) for a float32 bucket.

    Args:
        native: the bucket's dtype in the model signature.
        held: the bucket's reduction, if some rank already sent a chunk of it.
        first_rank: the rank whose chunk started `held` (named in the error).

    Raises:
        RejectedMessage: the dtype is not allowed, or differs from the other ranks'.
    """
    step, bucket = chunk.step, chunk.bucket_index
    compressed = chunk.dtype in COMPRESSED_WIRE and native in COMPRESSIBLE
    quantized = chunk.dtype == INT8_WIRE and native == pb.DTYPE_FLOAT32
    if chunk.dtype != native and not (compressed or quantized):
        allowed = dtypes.dtype_name(native)
        if native == pb.DTYPE_FLOAT32:
            allowed += " (or float16/bfloat16 from a comm hook, or int8 with a per-chunk scale)"
        elif native in COMPRESSIBLE:
            allowed += " (or float16/bfloat16 from a comm hook)"
        raise RejectedMessage(
            Code.INVALID_ARGUMENT,
            f"rank {rank} sent bucket {bucket} of step {step} as "
            f"{dtypes.dtype_name(chunk.dtype)}, expected {allowed}",
            step=step,
            bucket_index=bucket,
        )
    if held is not None and chunk.dtype != held.dtype:
        raise RejectedMessage(
            Code.INVALID_ARGUMENT,
            f"rank {rank} sent bucket {bucket} of step {step} as "
            f"{dtypes.dtype_name(chunk.dtype)}, but rank {first_rank} sent it as "
            f"{dtypes.dtype_name(held.dtype)} (every rank must use the same "
            "comm hook)",
            step=step,
            bucket_index=bucket,
        )
    return chunk.dtype


def check_reply_dtype(
    rank: int,
    chunk: ChunkHeader,
    native: int,
    held: BucketReduction | None,
    first_rank: int,
    wire_dtype: int,
) -> int:
    """The dtype the chunk asks its average back in, if allowed and the same as the others'.

    Raises:
        RejectedMessage: the reply dtype is not allowed, or differs from the other ranks'.
    """
    step, bucket = chunk.step, chunk.bucket_index
    reply_dtype = reply_dtype_of(chunk.reply_dtype, wire_dtype)
    problem = reply_dtype_problem(reply_dtype, wire_dtype, native)
    if problem is not None:
        raise RejectedMessage(
            Code.INVALID_ARGUMENT,
            f"rank {rank} sent bucket {bucket} of step {step} and {problem}",
            step=step,
            bucket_index=bucket,
        )
    # One reply serves every rank, so the first chunk's choice binds the others.
    if held is not None and reply_dtype != held.reply_dtype:
        raise RejectedMessage(
            Code.INVALID_ARGUMENT,
            f"rank {rank} asked for the average of bucket {bucket} of step {step} as "
            f"{dtypes.dtype_name(reply_dtype)}, but rank {first_rank} asked for "
            f"{dtypes.dtype_name(held.reply_dtype)} (every rank must use the "
            "same wire_answer_dtype)",
            step=step,
            bucket_index=bucket,
        )
    return reply_dtype


def check_encoding(rank: int, chunk: ChunkHeader) -> None:
    """Raises `RejectedMessage` unless the chunk is raw (the only encoding served)."""
    if chunk.encoding != pb.ENCODING_RAW:
        raise RejectedMessage(
            Code.INVALID_ARGUMENT,
            f"rank {rank} sent bucket {chunk.bucket_index} of step {chunk.step} with encoding "
            f"{chunk.encoding}, this coordinator only accepts raw (0)",
            step=chunk.step,
            bucket_index=chunk.bucket_index,
        )


def check_budget(
    rank: int, chunk: ChunkHeader, length: int, budget: ByteBudget | OwnerBudget
) -> None:
    """Raises `RejectedMessage` (RESOURCE_EXHAUSTED) if `length` more bytes do not fit."""
    if not budget.fits(length):
        raise RejectedMessage(
            Code.RESOURCE_EXHAUSTED,
            f"rank {rank} sent {length} bytes for bucket {chunk.bucket_index} of step "
            f"{chunk.step}, but {budget.holding()}",
            step=chunk.step,
            bucket_index=chunk.bucket_index,
        )


def offset_problem(
    rank: int,
    chunk: ChunkHeader,
    length: int,
    wire_dtype: int,
    *,
    wire_bytes: int,
    byte_range: tuple[int, int],
    chunk_bytes: int,
    shard: tuple[int, str],
    elements: int,
) -> tuple[Code, str] | None:
    """Why the chunk's offset or length is not one this shard expects, or None.

    Args:
        wire_bytes: the whole bucket's size as sent in `wire_dtype`.
        byte_range: the bytes [lo, hi) of the bucket this shard aggregates.
        shard: how many shards the buckets are cut into, and how errors name this one.
        elements: the bucket's element count (named when the range is empty).
    """
    shard_count, shard_name = shard
    lo, hi = (0, wire_bytes) if shard_count == 1 else byte_range
    offset = chunk.offset
    on_grid = lo <= offset < hi and (offset - lo) % chunk_bytes == 0
    if on_grid and length == min(chunk_bytes, hi - offset):
        return None  # every chunk but a bad one: no message is built (a per-chunk cost)
    what = f"bucket {chunk.bucket_index} of step {chunk.step}"
    container = f"bucket {chunk.bucket_index} as {dtypes.dtype_name(wire_dtype)}"
    if shard_count == 1:
        return check_chunk(what, chunk.offset, length, wire_bytes, container, chunk_bytes, rank)
    if byte_range[0] == byte_range[1]:
        return (
            Code.INVALID_ARGUMENT,
            f"rank {rank} sent {what} at offset {chunk.offset} to {shard_name}, which "
            f"holds no byte of it ({elements} elements cut into {shard_count} shards)",
        )
    return check_range_chunk(
        what,
        chunk.offset,
        length,
        byte_range,
        f"{container} ({wire_bytes} bytes)",
        chunk_bytes,
        rank,
        shard_name,
    )
