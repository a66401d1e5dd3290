"""Zero-copy encoding and decoding of gradient chunks, byte-compatible with protobuf.

Gradient chunks are nearly all of the traffic. Building them as protobuf
objects costs two extra copies of every payload (into the message, then out
of it when serializing) and another when parsing. This module writes and
reads exactly the bytes protobuf would — `WorkerMessage{gradient: ...}` or
`CoordinatorMessage{gradient: ...}` (field 2 in both) — but copies the
payload only once (into the outgoing message) and hands the received payload
out as a memoryview into the received bytes. Any other message is left to
protobuf. Anything the fast parser does not recognize falls back to
protobuf too, so the contract stays `proto/gradsync_proto/v1/gradsync.proto`.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass

from gradsync_proto.v1 import gradsync_pb2 as pb

_GRADIENT_FIELD = 2  # `gradient` in both WorkerMessage and CoordinatorMessage
_PAYLOAD_FIELD = 7  # GradientChunk.payload
_WIRE_VARINT = 0
_WIRE_FIXED64 = 1
_WIRE_LENGTH = 2
_WIRE_FIXED32 = 5
_GRADIENT_TAG = bytes([(_GRADIENT_FIELD << 3) | _WIRE_LENGTH])
_PAYLOAD_TAG = bytes([(_PAYLOAD_FIELD << 3) | _WIRE_LENGTH])
_INT_FIELDS = {
    1: "step",
    2: "membership_epoch",
    3: "bucket_index",
    4: "offset",
    5: "dtype",
    6: "encoding",
    8: "contributors",
    9: "reply_dtype",
    12: "segment_offset",
    16: "merged_late",
    17: "staleness",
    18: "next_step",
}
_UINT64_MAX = (1 << 64) - 1
_UINT32_MAX = (1 << 32) - 1
_ENUM_MAX = (1 << 31) - 1  # enums are int32: larger varints read back negative
# The largest value each field holds as itself. Protobuf truncates a larger varint
# (to 64 bits, to 32 for uint32, and sign-extends enums), so such a value is handed
# to protobuf rather than reaching the job as a number protobuf would never produce.
_INT_FIELD_MAX = {
    1: _UINT64_MAX,
    2: _UINT64_MAX,
    3: _UINT32_MAX,
    4: _UINT64_MAX,
    5: _ENUM_MAX,
    6: _ENUM_MAX,
    8: _UINT32_MAX,
    9: _ENUM_MAX,
    12: _UINT64_MAX,
    16: _UINT32_MAX,
    17: _UINT32_MAX,
    18: _UINT64_MAX,
}
_MAX_FIELD_NUMBER = (1 << 29) - 1
#: GradientChunk.covered_ranks: repeated uint32, packed by protobuf's encoder (both
#: forms are read, as protobuf reads them: each unpacked varint or packed run appends).
_COVERED_FIELD = 10
#: GradientChunk.in_segment: a bool (any non-zero varint reads as True, as in protobuf).
_IN_SEGMENT_FIELD = 11
#: GradientChunk.nonfinite_ranks: repeated uint32, read as covered_ranks is.
_NONFINITE_FIELD = 13
#: The repeated uint32 fields, by field number: where decode_gradient collects each.
_REPEATED_FIELDS = (_COVERED_FIELD, _NONFINITE_FIELD)
#: GradientChunk.screened_ranks and screen_note: set only on the rare answer whose chunk
#: the coordinator's screen flagged; such a message is left to protobuf.
_SCREEN_FIELDS = (24, 25)
#: GradientChunk.scale: a float (fixed32, little-endian IEEE binary32), an int8 chunk's.
_SCALE_FIELD = 14
_FLOAT = struct.Struct("<f")
#: GradientChunk.weight: a double (fixed64, little-endian IEEE binary64), a weighted round's.
_WEIGHT_FIELD = 15
_DOUBLE = struct.Struct("<d")
#: GradientChunk.alignment: zero bytes before the payload that align it (see
#: `encode_gradient`); read as any unknown length-delimited field: skipped.
_ALIGNMENT_TAG = bytes([(19 << 3 | _WIRE_LENGTH) & 0x7F | 0x80, (19 << 3 | _WIRE_LENGTH) >> 7])
#: Where payloads start in an encoded message: a multiple of this many bytes.
PAYLOAD_ALIGNMENT = 16
#: The alignment fields' sizes tried (none, then a tag, a one-byte length and
#: 0..31 zero bytes). The outer length's varint may grow by a byte somewhere in
#: that run, skipping one offset; 32 sizes still hit every offset modulo 16.
_ALIGNMENT_SIZES = (0, *range(3, 3 + 2 * PAYLOAD_ALIGNMENT))


@dataclass(slots=True)
class ChunkHeader:
    """Every GradientChunk field except the payload."""

    step: int = 0
    membership_epoch: int = 0
    bucket_index: int = 0
    offset: int = 0
    dtype: int = 0
    encoding: int = 0
    contributors: int = 0
    #: Worker -> coordinator: the DType the average is to come back in (0 = the payload's).
    reply_dtype: int = 0
    #: Worker -> coordinator, from a local leader: the ranks its partial sum holds,
    #: ascending, the leader first (empty = the sender's own gradient).
    covered_ranks: tuple[int, ...] = ()
    #: Same-host payload path: the payload is (worker -> coordinator) or was put
    #: (coordinator -> worker) in the sender's registered segment, not in the message.
    in_segment: bool = False
    #: With `in_segment`: where the chunk's bytes lie in that segment.
    segment_offset: int = 0
    #: Worker -> coordinator, from a local leader: those of `covered_ranks` whose own
    #: gradient of the bucket held NaN/Inf, ascending (empty = none).
    nonfinite_ranks: tuple[int, ...] = ()
    #: Worker -> coordinator, an int8 payload: the chunk's quantization step (a float32
    #: value; element i is payload[i] * scale). 0 for every other payload.
    scale: float = 0.0
    #: Worker -> coordinator, a weighted DiLoCo round: the rank's weight (its samples).
    weight: float = 0.0
    #: Coordinator -> worker: late contributions merged into this average, and the
    #: largest staleness among them in rounds.
    merged_late: int = 0
    staleness: int = 0
    #: Coordinator -> worker: non-zero = the answer to a late contribution; continue here.
    next_step: int = 0
    #: Coordinator -> worker: ranks whose contribution to this chunk the screen flagged,
    #: and why (for people); empty = none.
    screened_ranks: tuple[int, ...] = ()
    screen_note: str = ""


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def encode_gradient(
    header: ChunkHeader, payload: bytes | memoryview | Sequence[bytes | memoryview]
) -> bytes:
    """Serialize a gradient chunk message (worker or coordinator side) in one copy.

    `payload` is the chunk's bytes, or a sequence of byte pieces that
    concatenate to them (a chunk may span several parameters' gradients).
    """
    parts = [payload] if isinstance(payload, bytes | memoryview) else list(payload)
    fields = pb.GradientChunk(
        step=header.step,
        membership_epoch=header.membership_epoch,
        bucket_index=header.bucket_index,
        offset=header.offset,
        dtype=header.dtype,  # type: ignore[arg-type]
        encoding=header.encoding,  # type: ignore[arg-type]
        contributors=header.contributors,
        reply_dtype=header.reply_dtype,  # type: ignore[arg-type]
        covered_ranks=header.covered_ranks,
        in_segment=header.in_segment,
        segment_offset=header.segment_offset,
        nonfinite_ranks=header.nonfinite_ranks,
        scale=header.scale,
        weight=header.weight,
        merged_late=header.merged_late,
        staleness=header.staleness,
        next_step=header.next_step,
        screened_ranks=header.screened_ranks,
        screen_note=header.screen_note,
    ).SerializeToString()
    length = sum(memoryview(part).nbytes for part in parts)
    head = _PAYLOAD_TAG + _varint(length)
    inner = _aligned(fields, head, length) if length else fields + head
    outer = _GRADIENT_TAG + _varint(len(inner) + length)
    return b"".join((outer, inner, *parts))


def _aligned(fields: bytes, payload_head: bytes, length: int) -> bytes:
    """`fields` + an `alignment` field + `payload_head`, so that the payload that
    follows starts at a multiple of `PAYLOAD_ALIGNMENT` bytes into the message.

    A received message is a bytes object whose data is 16-byte aligned, so an
    aligned offset is an aligned address: the coordinator checks and sums a
    payload in place (a misaligned one is copied first, ~20 us per MiB), and a
    worker copies an average out with aligned loads.
    """
    for size in _ALIGNMENT_SIZES:
        padding = b"" if size == 0 else _ALIGNMENT_TAG + bytes([size - 3]) + bytes(size - 3)
        inner = fields + padding + payload_head
        outer_bytes = len(_GRADIENT_TAG) + len(_varint(len(inner) + length))
        if (outer_bytes + len(inner)) % PAYLOAD_ALIGNMENT == 0:
            return inner
    return fields + payload_head  # unreachable (see _ALIGNMENT_SIZES)


def _read_varint(view: memoryview, position: int, end: int) -> tuple[int, int]:
    result = 0
    shift = 0
    while position < end:
        byte = view[position]
        position += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result, position
        shift += 7
        if shift > 63:
            break
    raise ValueError("malformed varint")


def decode_gradient(raw: bytes) -> tuple[ChunkHeader, memoryview] | None:
    """Parse a message that holds only a gradient chunk, without copying its payload.

    Returns:
        (header, payload view), or None when `raw` is some other message (or
        anything unusual: field number 0 or past 2**29 - 1, groups, unknown wire
        types, a value out of its field's range): the caller then parses it
        with protobuf, so whatever this returns is exactly protobuf's reading.

    Raises:
        ValueError: the bytes are not valid protobuf.
    """
    view = memoryview(raw)
    end = len(view)
    if end < 2 or view[0] != _GRADIENT_TAG[0]:
        return None
    length, position = _read_varint(view, 1, end)
    if position + length != end:
        return None  # more than one top-level field: let protobuf decide
    header = ChunkHeader()
    payload = view[0:0]
    repeated: dict[int, list[int]] = {field: [] for field in _REPEATED_FIELDS}
    while position < end:
        key, position = _read_varint(view, position, end)
        field, wire_type = key >> 3, key & 7
        if not 0 < field <= _MAX_FIELD_NUMBER or field in _SCREEN_FIELDS:
            return None  # invalid in protobuf (let it say so), or a screened answer (rare)
        if wire_type == _WIRE_VARINT:
            value, position = _read_varint(view, position, end)
            name = _INT_FIELDS.get(field)
            if field in repeated:
                if value > _UINT32_MAX:
                    return None  # protobuf truncates it: take protobuf's reading
                repeated[field].append(value)
            elif field == _IN_SEGMENT_FIELD:
                header.in_segment = value != 0
            elif field in (_SCALE_FIELD, _WEIGHT_FIELD):
                return None  # a float sent as a varint: protobuf decides
            elif name is not None:
                if value > _INT_FIELD_MAX[field]:
                    return None  # protobuf truncates it: take protobuf's reading
                setattr(header, name, value)
        elif wire_type == _WIRE_LENGTH:
            size, position = _read_varint(view, position, end)
            if position + size > end:
                raise ValueError("truncated length-delimited field")
            if field == _PAYLOAD_FIELD:
                payload = view[position : position + size]
            elif field in repeated:
                if not _read_packed(view, position, position + size, repeated[field]):
                    return None
            elif field in _INT_FIELDS or field in (_IN_SEGMENT_FIELD, _SCALE_FIELD, _WEIGHT_FIELD):
                return None  # packed or otherwise unusual: protobuf handles it
            position += size
        elif wire_type == _WIRE_FIXED64:
            if position + 8 > end:
                raise ValueError("truncated fixed64 field")
            if field == _WEIGHT_FIELD:  # the last one wins, as in protobuf
                (header.weight,) = _DOUBLE.unpack_from(view, position)
            position += 8
        elif wire_type == _WIRE_FIXED32:
            if position + 4 > end:
                raise ValueError("truncated fixed32 field")
            if field == _SCALE_FIELD:  # the last one wins, as in protobuf
                (header.scale,) = _FLOAT.unpack_from(view, position)
            elif field == _WEIGHT_FIELD:
                return None  # a double sent as fixed32: protobuf decides
            position += 4
        else:
            return None  # groups (3, 4) or invalid wire types: protobuf decides
    if position != end:
        raise ValueError("truncated message")
    if repeated[_COVERED_FIELD]:
        header.covered_ranks = tuple(repeated[_COVERED_FIELD])
    if repeated[_NONFINITE_FIELD]:
        header.nonfinite_ranks = tuple(repeated[_NONFINITE_FIELD])
    return header, payload


def _read_packed(view: memoryview, position: int, end: int, into: list[int]) -> bool:
    """Append the packed uint32 varints of view[position:end] to `into`.

    Returns:
        False when a value is past 2**32 - 1 (protobuf truncates it: the caller
        hands the message to protobuf).

    Raises:
        ValueError: a varint is malformed or runs past the packed field's end.
    """
    while position < end:
        value, position = _read_varint(view, position, end)
        if value > _UINT32_MAX:
            return False
        into.append(value)
    return True


def header_of(chunk: pb.GradientChunk) -> ChunkHeader:
    """The header fields of a protobuf GradientChunk (slow-path messages)."""
    return ChunkHeader(
        step=chunk.step,
        membership_epoch=chunk.membership_epoch,
        bucket_index=chunk.bucket_index,
        offset=chunk.offset,
        dtype=chunk.dtype,
        encoding=chunk.encoding,
        contributors=chunk.contributors,
        reply_dtype=chunk.reply_dtype,
        covered_ranks=tuple(chunk.covered_ranks),
        in_segment=chunk.in_segment,
        segment_offset=chunk.segment_offset,
        nonfinite_ranks=tuple(chunk.nonfinite_ranks),
        scale=chunk.scale,
        weight=chunk.weight,
        merged_late=chunk.merged_late,
        staleness=chunk.staleness,
        next_step=chunk.next_step,
        screened_ranks=tuple(chunk.screened_ranks),
        screen_note=chunk.screen_note,
    )
