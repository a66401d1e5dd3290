"""What the average of a narrow wire comes back as: 16 bits, or the fp32 accumulator itself.

A comm hook may send a float32 bucket as float16/bfloat16 (half the bytes up)
and ask, in every chunk's `reply_dtype`, for the average in float32. The
coordinator accumulates in float32 anyway, so answering in float32 costs the
bytes down but saves the last rounding of the gradient (the one back to 16
bits), which is the larger of the two for bf16's 8-bit mantissa. Every rank
must ask the same for a (step, bucket): the reply is one message for all.

A float32 reply is twice the wire bytes, so it cannot travel as one message
per input chunk (the message limit is one chunk plus slack). It is cut on the
reply's own grid instead: this shard's range [lo, hi) of the bucket in wire
bytes is [2 lo, 2 hi) in reply bytes, chunked from 2 lo like any range
(`chunking.range_chunk_spans`), which is exactly the grid a worker expects
for a float32 bucket of the same elements. An input chunk at offset o of L
bytes lies on the wire grid (o - lo is a multiple of the chunk size), so its
reply [2 o, 2 o + 2 L) starts on the reply grid and covers whole reply chunks.

An int8 wire (DiLoCo's pseudo-gradients, one scale per chunk) is answered in
float32 here: an int8 average would need scales of its own and round it a
second time. Its reply is four times the wire bytes, cut the same way from
4 lo. (A bucket of an outer optimizer is answered as its job says instead,
`outer_answer`: float32 by default, or the int8 change of the public copy,
one message per input chunk with its own scale.) Pure logic, no gRPC.
"""

from __future__ import annotations

import dataclasses

from gradsync_proto import chunking, dtypes
from gradsync_proto.codec import ChunkHeader, encode_gradient
from gradsync_proto.v1 import gradsync_pb2 as pb

from gradsync_server.dataplane.actions import SegmentAverage, Send

#: 16-bit wire dtypes a comm hook may compress a float32/float64 bucket to.
COMPRESSED_WIRE = (pb.DTYPE_FLOAT16, pb.DTYPE_BFLOAT16)
#: The int8 wire (a scale per chunk): a float32 bucket's only, answered in float32 only.
INT8_WIRE = pb.DTYPE_INT8


def reply_dtype_problem(reply_dtype: int, wire_dtype: int, native_dtype: int) -> str | None:
    """Why `reply_dtype` cannot answer a `wire_dtype` payload of a `native_dtype` bucket, or None.

    Allowed: the payload's own dtype, or float32 for a 16-bit payload of a
    float32 bucket: the one case where the answer lands in the bucket's buffer
    as is (a float64 bucket would still need a cast on the worker, and any other
    widening would only cost bytes). An int8 payload: float32 only.
    """
    if wire_dtype == INT8_WIRE:
        if reply_dtype == pb.DTYPE_FLOAT32 and native_dtype == pb.DTYPE_FLOAT32:
            return None
        return (
            f"asked for the average as {dtypes.dtype_name(reply_dtype)}, but an int8 payload "
            f"(of a {dtypes.dtype_name(native_dtype)} bucket) is answered in float32 only "
            "(reply dtype FLOAT32)"
        )
    if reply_dtype == wire_dtype:
        return None
    if (
        reply_dtype == pb.DTYPE_FLOAT32
        and wire_dtype in COMPRESSED_WIRE
        and native_dtype == pb.DTYPE_FLOAT32
    ):
        return None
    allowed = dtypes.dtype_name(wire_dtype)
    if wire_dtype in COMPRESSED_WIRE and native_dtype == pb.DTYPE_FLOAT32:
        allowed += " or float32"
    return (
        f"asked for the average as {dtypes.dtype_name(reply_dtype)}, but a "
        f"{dtypes.dtype_name(wire_dtype)} payload of a {dtypes.dtype_name(native_dtype)} "
        f"bucket can only be answered as {allowed}"
    )


def answer_sends(
    header: ChunkHeader,
    averaged: memoryview,
    wire_dtype: int,
    chunk_bytes: int,
    units: tuple[int, ...],
    from_segment: tuple[int, ...],
) -> list[Send]:
    """The messages answering the input chunk at `header.offset`, encoded once for all.

    Args:
        header: the answer's header (step, epoch, bucket, the input's offset, the reply
            dtype, contributors, ...); each piece gets its own offset.
        averaged: the answer, in the reply dtype.
        units: who gets it.
        from_segment: those of `units` whose upload came from their same-host segment:
            they get a `SegmentAverage` (nothing encoded) when the reply is one piece.
    """
    # One piece at the input's offset when the reply is in the wire dtype; otherwise the
    # reply grid's pieces the chunk covers: cutting [2 o, 2 o + 2 L) from its own start
    # is the reply range's grid, since 2 o is on it (see the module docstring).
    pieces = [(header.offset, averaged)]
    if header.dtype != wire_dtype:
        start = header.offset * (dtypes.itemsize(header.dtype) // dtypes.itemsize(wire_dtype))
        spans = chunking.range_chunk_spans(start, start + len(averaged), chunk_bytes)
        pieces = [(piece, averaged[piece - start : piece - start + n]) for piece, n in spans]
    sends = []
    for piece_offset, piece in pieces:
        piece_header = dataclasses.replace(header, offset=piece_offset)
        # A segment's upload is answered on its own grid, in its own dtype (one piece).
        whole = piece_offset == header.offset and len(piece) == len(averaged)
        direct = from_segment if whole else ()
        others = tuple(u for u in units if u not in direct)
        if others:
            sends.append(Send(others, encode_gradient(piece_header, piece)))
        if direct:
            sends.append(Send(direct, SegmentAverage(piece_header, piece)))
    return sends
