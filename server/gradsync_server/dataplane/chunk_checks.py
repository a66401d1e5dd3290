"""Does this gradient chunk belong to the open step, and fit its bucket? (pure checks).

`OpenStep.accept` runs a chunk through these before buffering a byte of it:
the sender's membership, epoch and step (`check_sender`), then its place in
the job's bucket layout (`BucketLayout.check`): the wire and reply dtypes (a
16-bit comm hook may send a float32/float64 bucket, but every rank must send
each bucket alike), the encoding, the offset and length against the one
chunking rule of `gradsync_proto.chunking` (for the whole bucket, or for this
shard's byte range of it: `check_range_chunk`), and the byte budget. Each
raises a `RejectedMessage` that names the values involved. A late DiLoCo
contribution (`gradsync_server.dataplane.late`) passes the same layout checks
as an on-time one. Blobs (checkpoints, state, collectives) are checked by
`gradsync_proto.blobs.BlobAssembly`.

An int8 payload (DiLoCo's pseudo-gradients of a float32 bucket) means
nothing without its chunk's `scale`, so it is dequantized here, once the
chunk's offset and length are known to be right and before it is classified,
budgeted or summed (`OpenStep._fold`): from then on it is a float32
contribution like any other. The non-finite check sees the values the sum
will see (a NaN or Inf scale gives NaN, and the `--nonfinite` policy reports
or aborts on it, naming the rank, as for a float32 NaN; a huge finite scale
that overflows is caught the same way), the byte budget holds what is really
held (four bytes per element), and the reduction needs no notion of scales.
Only an int8 payload may carry a scale: a scale on any other chunk is a
malformed message, as is a negative one (`gradsync_proto.int8_wire.scale_problem`).

DiLoCo's sparse wire (`gradsync_proto.sparse_wire`, `ENCODING_TOPK2`) sends an
INT8 chunk of a float32 bucket as its top-k elements: a payload whose size
says nothing about the chunk's place in the bucket. Its element count n is a
claim, read first (`claimed_length`) and checked against the chunk grid as
an int8 chunk's payload length would be; only then is the payload decoded,
every rule checked (selected count <= n, indices strictly increasing and
below n, the exact length, zero padding, a step >= 0 and finite whenever
anything is sent), and the chunk widened to n float32 values q * step: a
dense contribution from then on, summed in float32 in rank order like any
other, so the sum does not depend on which rank's chunk came first. A NaN
step (a rank's chunk held NaN or Inf) gives NaN everywhere, for the
`--nonfinite` policy to report or abort on.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from gradsync_proto import chunking, dtypes, int8_wire, sparse_wire
from gradsync_proto.codec import ChunkHeader
from gradsync_proto.codes import Code
from gradsync_proto.v1 import gradsync_pb2 as pb

from gradsync_server.dataplane.aggregation import BucketReduction
from gradsync_server.dataplane.budget import ByteBudget, OwnerBudget
from gradsync_server.dataplane.wire_replies import (
    COMPRESSED_WIRE,
    INT8_WIRE,
    reply_dtype_problem,
)
from gradsync_server.errors import RejectedMessage

__all__ = [
    "BucketLayout",
    "CheckedChunk",
    "check_chunk",
    "check_range_chunk",
    "check_sender",
    "offset_problem",
]

#: Native bucket dtypes a comm hook may send as float16/bfloat16.
COMPRESSIBLE = (pb.DTYPE_FLOAT32, pb.DTYPE_FLOAT64)


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
        self.bucket_dtypes: list[int] = []
        self.bucket_elements: list[int] = []

    def configure(self, signature: pb.ModelSignature) -> list[tuple[int, int]]:
        """Learn the job's buckets; return this shard's byte range of each (native dtype)."""
        self.bucket_dtypes = [b.dtype for b in signature.buckets]
        self.bucket_elements = [b.num_elements for b in signature.buckets]
        return [self.byte_range(b, dtype) for b, dtype in enumerate(self.bucket_dtypes)]

    @property
    def count(self) -> int:
        """How many buckets the job has."""
        return len(self.bucket_dtypes)

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
        wire_bytes = self.bucket_elements[bucket] * dtypes.itemsize(wire_dtype)
        sparse = chunk.encoding == pb.ENCODING_TOPK2  # its length is a claim: checked here
        # Raw, or sparse (DiLoCo's sparse 2-bit wire) as an int8 chunk of a float32 bucket.
        if chunk.encoding != pb.ENCODING_RAW and not (sparse and wire_dtype == INT8_WIRE):
            raise refused(
                chunk,
                f"rank {rank} sent bucket {bucket} of step {step} with encoding "
                f"{chunk.encoding} as {dtypes.dtype_name(wire_dtype)}, this coordinator accepts "
                "raw (0), or sparse (1) for an int8 chunk of a float32 bucket",
            )
        byte_range = self.byte_range(bucket, wire_dtype)
        length = claimed_length(rank, chunk, payload) if sparse else len(payload)
        problem = offset_problem(
            rank,
            chunk,
            length,
            wire_dtype,
            wire_bytes=wire_bytes,
            byte_range=byte_range,
            chunk_bytes=self.chunk_bytes,
            shard=(self.shard_count, self.shard_name),
            elements=self.bucket_elements[bucket],
        )
        if problem is not None:
            raise refused(chunk, problem[1], problem[0])
        if sparse:  # decoded to `length` float32 values
            summed, payload_dtype = sparse_contribution(rank, chunk, payload, length)
        else:
            summed, payload_dtype = contribution_of(rank, chunk, payload, wire_dtype)  # int8: fp32
        if not budget.fits(len(summed)):
            raise refused(
                chunk,
                f"rank {rank} sent {len(summed)} bytes for bucket {bucket} of step {step}, but "
                f"{budget.holding()}",
                Code.RESOURCE_EXHAUSTED,
            )
        return CheckedChunk(wire_dtype, reply_dtype, byte_range, wire_bytes, summed, payload_dtype)


def refused(
    chunk: ChunkHeader, message: str, code: Code = Code.INVALID_ARGUMENT
) -> RejectedMessage:
    """The refusal of `chunk` with `message` (INVALID_ARGUMENT unless `code` says), naming
    its step and bucket."""
    return RejectedMessage(code, message, step=chunk.step, bucket_index=chunk.bucket_index)


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
        raise refused(
            chunk,
            f"rank {rank} sent {kind} step {step} (bucket {bucket}), expected step {open_step}",
            Code.FAILED_PRECONDITION,
        )
    if bucket >= bucket_count:
        raise RejectedMessage(
            Code.INVALID_ARGUMENT,
            f"rank {rank} sent bucket {bucket} for step {step}, but the model has "
            f"{bucket_count} buckets (0..{bucket_count - 1})",
            step=step,
        )
    if rank in out_of_inputs:
        raise refused(
            chunk,
            f"rank {rank} sent bucket {bucket} of step {step} after running out of inputs "
            "(join()); it contributes nothing until every rank has joined",
            Code.FAILED_PRECONDITION,
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
        raise refused(
            chunk,
            f"rank {rank} sent bucket {bucket} of step {step} as "
            f"{dtypes.dtype_name(chunk.dtype)}, expected {allowed}",
        )
    if held is not None and chunk.dtype != held.dtype:
        raise refused(
            chunk,
            f"rank {rank} sent bucket {bucket} of step {step} as "
            f"{dtypes.dtype_name(chunk.dtype)}, but rank {first_rank} sent it as "
            f"{dtypes.dtype_name(held.dtype)} (every rank must use the same "
            "comm hook)",
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
    reply_dtype = chunk.reply_dtype or wire_dtype  # unset: the payload's
    problem = reply_dtype_problem(reply_dtype, wire_dtype, native)
    if problem is not None:
        raise refused(chunk, f"rank {rank} sent bucket {bucket} of step {step} and {problem}")
    # One reply serves every rank, so the first chunk's choice binds the others.
    if held is not None and reply_dtype != held.reply_dtype:
        raise refused(
            chunk,
            f"rank {rank} asked for the average of bucket {bucket} of step {step} as "
            f"{dtypes.dtype_name(reply_dtype)}, but rank {first_rank} asked for "
            f"{dtypes.dtype_name(held.reply_dtype)} (every rank must use the "
            "same wire_answer_dtype)",
        )
    return reply_dtype


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


def contribution_of(
    rank: int, chunk: ChunkHeader, payload: memoryview, wire_dtype: int
) -> tuple[memoryview, int]:
    """The chunk's payload as it is to be summed, and its dtype.

    Args:
        payload: the chunk's bytes, already checked against the chunk grid.
        wire_dtype: the dtype it was sent in (checked by `check_wire_dtype`).

    Returns:
        (payload, wire_dtype) as they are, or for int8 the float32 values
        (`int8_wire.dequantize`, a fresh array) and DTYPE_FLOAT32.

    Raises:
        RejectedMessage: INVALID_ARGUMENT for a scale on a chunk that is not int8,
            or a negative scale, naming rank, step, bucket and offset.
    """
    where = f"bucket {chunk.bucket_index} of step {chunk.step} at offset {chunk.offset}"
    if wire_dtype != pb.DTYPE_INT8:
        if chunk.scale != 0:  # NaN included
            raise refused(
                chunk,
                f"rank {rank} sent {where} as {dtypes.dtype_name(wire_dtype)} with a scale "
                f"({chunk.scale!r}); only an int8 payload carries one",
            )
        return payload, wire_dtype
    problem = int8_wire.scale_problem(chunk.scale)
    if problem is not None:
        raise refused(chunk, f"rank {rank} sent {where} as int8 with {problem}")
    values = int8_wire.dequantize(payload, chunk.scale)
    return values.data.cast("B"), pb.DTYPE_FLOAT32


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
        raise refused(chunk, f"{_where(rank, chunk)} of dtype {chunk.dtype}; only INT8 is")
    if chunk.scale != 0:  # NaN included: the step travels in the payload
        raise refused(
            chunk, f"{_where(rank, chunk)} with a header scale ({chunk.scale!r}); it must be 0"
        )
    try:
        return sparse_wire.claimed_length(payload)
    except sparse_wire.SparseWireError as error:
        raise refused(chunk, f"{_where(rank, chunk)}: {error}") from None


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
        raise refused(chunk, f"{_where(rank, chunk)}: {error}") from None
    return decoded.values().data.cast("B"), pb.DTYPE_FLOAT32
