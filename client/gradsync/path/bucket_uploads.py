"""A bucket upload cut into one byte range per coordinator shard, and its wire chunks.

A sharded coordinator aggregates range i of every bucket at shard i
(`gradsync_proto.chunking.shard_ranges`), so a worker uploads each range
on its own stream, in parallel. The ranges are cut by elements of the wire
dtype (the buffer handed over is already in it: a 16-bit wire halves every
byte offset), and each range is chunked on its own grid, with absolute
offsets, so shard i sees exactly the chunks it expects and the averages can
be written back wherever they come from. With one shard the single range is
the whole bucket and the chunks are exactly the unsharded ones.

The upload's "upload_start" and "upload_end" events belong to the bucket, not
to a range: `UploadProgress` counts the ranges still being handed to gRPC so
that "upload_end" fires once, after the last one. Everything here runs on the
transport's event loop thread (no lock), and imports neither grpc nor asyncio.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from gradsync_proto import chunking, dtypes
from gradsync_proto.codec import ChunkHeader, encode_gradient
from gradsync_proto.v1 import gradsync_pb2 as pb

from gradsync.path.buffers import BucketBuffer

#: Called as (event, step, bucket_index) for "upload_start" and "upload_end".
UploadEvent = Callable[[str, int, int], None]


@dataclass
class BucketUpload:
    """One bucket of one step, as submitted: bytes in the wire dtype `dtype`."""

    step: int
    bucket_index: int
    buffer: BucketBuffer
    dtype: int
    #: The DType the averages are to come back in (every chunk says so); 0 = `dtype`.
    reply_dtype: int = 0
    #: A local leader's partial sum: the ranks it holds (every chunk says so); () = own.
    covered_ranks: tuple[int, ...] = ()
    #: Same-host payload path: `buffer` lies at this offset of the segment the
    #: coordinator holds; chunks then carry no payload, only where it lies. None = TCP.
    segment_offset: int | None = None
    #: Of `covered_ranks`: those whose own gradient held NaN/Inf (every chunk says so).
    nonfinite_ranks: tuple[int, ...] = ()


@dataclass
class UploadProgress:
    """How far a bucket's upload is, across all of its ranges (loop thread only)."""

    ranges_left: int
    started: bool = False


@dataclass
class RangeUpload:
    """Bytes [lo, hi) of a bucket, bound for one shard."""

    upload: BucketUpload
    lo: int
    hi: int
    progress: UploadProgress


def bucket_byte_ranges(num_bytes: int, dtype: int, shard_count: int) -> list[tuple[int, int]]:
    """Byte range [lo, hi) of each shard in a bucket of `num_bytes` bytes of wire `dtype`.

    Raises:
        ValueError: `num_bytes` is not a whole number of `dtype` elements (only
            checked when sharded: unsharded, the one range is the whole bucket).
    """
    if shard_count <= 1:
        return [(0, num_bytes)]
    size = dtypes.itemsize(dtype)
    if num_bytes % size:
        raise ValueError(
            f"a bucket of {num_bytes} bytes is not a whole number of "
            f"{dtypes.dtype_name(dtype)} elements ({size} bytes each)"
        )
    return [
        chunking.shard_byte_range(num_bytes // size, size, shard_count, index)
        for index in range(shard_count)
    ]


def expected_chunks(
    num_bytes: int, dtype: int, shard_count: int, chunk_bytes: int
) -> dict[int, int]:
    """{absolute offset: length} of every chunk of a bucket, over all shards' grids."""
    spans: dict[int, int] = {}
    for lo, hi in bucket_byte_ranges(num_bytes, dtype, shard_count):
        spans.update(chunking.range_chunk_spans(lo, hi, chunk_bytes))
    return spans


def split_upload(upload: BucketUpload, shard_count: int) -> list[RangeUpload | None]:
    """The upload's range for each shard index; None where a shard's range is empty.

    Range 0 is never None: it travels on the leader's stream and carries the
    bucket's events even when the bucket is empty.
    """
    ranges = bucket_byte_ranges(upload.buffer.size, upload.dtype, shard_count)
    busy = sum(1 for lo, hi in ranges if hi > lo)
    progress = UploadProgress(ranges_left=busy)
    return [
        RangeUpload(upload, lo, hi, progress) if hi > lo or index == 0 else None
        for index, (lo, hi) in enumerate(ranges)
    ]


def range_messages(
    part: RangeUpload, chunk_bytes: int, epoch: int, on_event: UploadEvent
) -> Iterator[bytes]:
    """Serialized WorkerMessages carrying `part`, chunk by chunk (absolute offsets).

    Fires "upload_start" before the bucket's first chunk on any stream, and
    "upload_end" just before its last chunk on the last stream is handed over.
    """
    upload, progress = part.upload, part.progress
    if not progress.started:
        progress.started = True
        on_event("upload_start", upload.step, upload.bucket_index)
    last_offset = max(
        (offset for offset, _ in chunking.range_chunk_spans(part.lo, part.hi, chunk_bytes)),
        default=None,
    )
    if last_offset is None:  # an empty bucket: nothing to send, the upload is over
        if progress.ranges_left == 0:
            on_event("upload_end", upload.step, upload.bucket_index)
        return
    for offset, pieces in _chunks(upload, part, chunk_bytes):
        header = ChunkHeader(
            step=upload.step,
            membership_epoch=epoch,
            bucket_index=upload.bucket_index,
            offset=offset,
            dtype=upload.dtype,
            reply_dtype=upload.reply_dtype,
            covered_ranks=upload.covered_ranks,
            nonfinite_ranks=upload.nonfinite_ranks,
            scale=upload.buffer.scale_at(offset),  # an int8 bucket's, on this very grid
            weight=upload.buffer.weight,
        )
        if upload.buffer.encoded is not None:  # the sparse 2-bit wire's own bytes
            header.encoding = pb.ENCODING_TOPK2
        if upload.segment_offset is not None:
            header.in_segment, header.segment_offset = True, upload.segment_offset + offset
        message = encode_gradient(header, pieces)
        # What went out, for a resend after a restart (a view into the message, no copy).
        upload.buffer.record(offset, pieces, message)
        if offset == last_offset:  # handed to gRPC next: this range's end
            progress.ranges_left -= 1
            if progress.ranges_left == 0:
                on_event("upload_end", upload.step, upload.bucket_index)
        yield message


def _chunks(
    upload: BucketUpload, part: RangeUpload, chunk_bytes: int
) -> Iterator[tuple[int, Sequence[memoryview]]]:
    """(offset, payload pieces) of each chunk; no pieces when the payload stays in the segment."""
    encoded = upload.buffer.encoded
    if encoded is not None:  # a sparse bucket: each chunk's own payload (never in a segment)
        for offset, _ in chunking.range_chunk_spans(part.lo, part.hi, chunk_bytes):
            yield offset, [memoryview(encoded[offset])]
        return
    if upload.segment_offset is None:
        yield from upload.buffer.range_chunks(part.lo, part.hi, chunk_bytes)
        return
    for offset, _ in chunking.range_chunk_spans(part.lo, part.hi, chunk_bytes):
        yield offset, ()
