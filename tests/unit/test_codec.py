"""The zero-copy codec must produce and accept exactly protobuf's bytes."""

from __future__ import annotations

import math
import random
import struct

import pytest
from google.protobuf.message import DecodeError
from gradsync_proto.codec import (
    PAYLOAD_ALIGNMENT,
    ChunkHeader,
    decode_gradient,
    encode_gradient,
    header_of,
)
from gradsync_proto.v1 import gradsync_pb2 as pb


def random_header(rng: random.Random) -> ChunkHeader:
    return ChunkHeader(
        step=rng.choice([0, 1, 127, 128, 2**40]),
        membership_epoch=rng.choice([0, 3, 300]),
        bucket_index=rng.randrange(0, 5000),
        offset=rng.choice([0, 1 << 20, 123 << 22]),
        dtype=rng.choice([1, 2, 3, 4]),
        encoding=0,
        contributors=rng.choice([0, 2, 64]),
        reply_dtype=rng.choice([0, 0, 1, 4]),
        covered_ranks=rng.choice([(), (0,), (3, 4, 7), (5, 2**32 - 1), tuple(range(200))]),
        in_segment=rng.choice([False, True]),
        segment_offset=rng.choice([0, 64, 2**40 + 7]),
        nonfinite_ranks=rng.choice([(), (1,), (3, 7), (2**32 - 1,)]),
        scale=rng.choice([0.0, 0.0, 1.5, 2.0**-140, 3.4028234663852886e38, float("inf")]),
    )


@pytest.mark.parametrize("seed", range(20))
def test_roundtrip_against_protobuf(seed: int) -> None:
    rng = random.Random(seed)
    header = random_header(rng)
    payload = rng.randbytes(rng.choice([0, 1, 127, 128, 4096, 70000]))
    encoded = encode_gradient(header, memoryview(payload))
    for message_type in (pb.WorkerMessage, pb.CoordinatorMessage):
        parsed = message_type.FromString(encoded)
        assert parsed.WhichOneof("kind") == "gradient"
        assert header_of(parsed.gradient) == header
        assert parsed.gradient.payload == payload
        # protobuf's own encoding decodes to the same thing through the fast path
        decoded = decode_gradient(parsed.SerializeToString())
        assert decoded is not None
        assert decoded[0] == header and bytes(decoded[1]) == payload


def test_reply_dtype_travels_as_field_9_both_ways() -> None:
    """The fp32-answer request must survive the fast encoder and the fast decoder."""
    header = ChunkHeader(step=3, bucket_index=1, offset=64, dtype=4, reply_dtype=1)
    encoded = encode_gradient(header, b"\x00\x01")
    parsed = pb.WorkerMessage.FromString(encoded).gradient
    assert parsed.reply_dtype == pb.DTYPE_FLOAT32
    assert pb.GradientChunk.DESCRIPTOR.fields_by_name["reply_dtype"].number == 9
    from_protobuf = pb.WorkerMessage(
        gradient=pb.GradientChunk(step=3, dtype=pb.DTYPE_BFLOAT16, reply_dtype=pb.DTYPE_FLOAT32)
    ).SerializeToString()
    assert b"\x48\x01" in from_protobuf  # key (9 << 3) | varint, value FLOAT32
    decoded = decode_gradient(from_protobuf)
    assert decoded is not None and decoded[0].reply_dtype == pb.DTYPE_FLOAT32
    assert decode_gradient(encoded) == (header, memoryview(b"\x00\x01"))


def test_other_messages_fall_back_to_protobuf() -> None:
    join = pb.WorkerMessage(join=pb.Join(job_id="j", rank=1)).SerializeToString()
    assert decode_gradient(join) is None
    assert decode_gradient(b"") is None


@pytest.mark.parametrize(
    "garbage", [b"\x12\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff", b"\x12\x05\x08"]
)
def test_garbage_is_rejected_here_or_by_the_protobuf_fallback(garbage: bytes) -> None:
    try:
        result = decode_gradient(garbage)
    except ValueError:
        return
    assert result is None
    with pytest.raises(DecodeError):
        pb.WorkerMessage.FromString(garbage)


def test_nonfinite_ranks_travel_as_field_13_packed_or_not() -> None:
    """The members a leader names for NaN/Inf survive both paths, apart from covered_ranks."""
    header = ChunkHeader(
        step=2, bucket_index=1, dtype=1, covered_ranks=(4, 5), nonfinite_ranks=(5,)
    )
    encoded = encode_gradient(header, b"\x00" * 8)
    assert list(pb.WorkerMessage.FromString(encoded).gradient.nonfinite_ranks) == [5]
    assert pb.GradientChunk.DESCRIPTOR.fields_by_name["nonfinite_ranks"].number == 13
    assert decode_gradient(encoded) == (header, memoryview(b"\x00" * 8))
    # Unpacked varints of field 13 after a packed run append to it alone.
    body = b"\x08\x02\x18\x01\x52\x02\x04\x05" + b"\x6a\x01\x04" + b"\x68\x05" + b"\x3a\x00"
    raw = b"\x12" + bytes([len(body)]) + body
    decoded = decode_gradient(raw)
    assert decoded is not None
    assert decoded[0].covered_ranks == (4, 5) and decoded[0].nonfinite_ranks == (4, 5)
    assert header_of(pb.WorkerMessage.FromString(raw).gradient) == decoded[0]


def test_covered_ranks_travel_as_field_10_packed_or_not() -> None:
    """A leader's covered ranks survive both paths, in protobuf's packed and unpacked forms."""
    header = ChunkHeader(step=2, bucket_index=1, dtype=1, covered_ranks=(4, 5, 300))
    encoded = encode_gradient(header, b"\x00" * 8)
    assert list(pb.WorkerMessage.FromString(encoded).gradient.covered_ranks) == [4, 5, 300]
    assert pb.GradientChunk.DESCRIPTOR.fields_by_name["covered_ranks"].number == 10
    assert b"\x52\x04\x04\x05\xac\x02" in encoded  # key (10 << 3) | length, packed varints
    assert decode_gradient(encoded) == (header, memoryview(b"\x00" * 8))
    # Unpacked varints (and a packed run after them) append, as protobuf reads them.
    body = b"\x08\x02\x18\x01\x28\x01" + b"\x50\x04" + b"\x52\x02\x05\x06" + b"\x3a\x00"
    raw = b"\x12" + bytes([len(body)]) + body
    decoded = decode_gradient(raw)
    assert decoded is not None and decoded[0].covered_ranks == (4, 5, 6)
    assert header_of(pb.WorkerMessage.FromString(raw).gradient) == decoded[0]
    # A value protobuf truncates to 32 bits is left to protobuf.
    big = b"\x50\x80\x80\x80\x80\x10"  # 2**32
    assert decode_gradient(b"\x12" + bytes([len(big)]) + big) is None
    # A packed run that ends mid-varint is not protobuf.
    cut = b"\x52\x01\x80"
    with pytest.raises(ValueError):
        decode_gradient(b"\x12" + bytes([len(cut)]) + cut)
    with pytest.raises(DecodeError):
        pb.WorkerMessage.FromString(b"\x12" + bytes([len(cut)]) + cut)


def test_in_segment_travels_as_fields_11_and_12() -> None:
    """The same-host path's header-only chunk survives both parsers; any non-zero bool is True."""
    header = ChunkHeader(
        step=4, bucket_index=2, offset=4096, dtype=1, in_segment=True, segment_offset=1 << 33
    )
    encoded = encode_gradient(header, b"")
    parsed = pb.WorkerMessage.FromString(encoded).gradient
    assert parsed.in_segment and parsed.segment_offset == 1 << 33 and parsed.payload == b""
    assert pb.GradientChunk.DESCRIPTOR.fields_by_name["in_segment"].number == 11
    assert pb.GradientChunk.DESCRIPTOR.fields_by_name["segment_offset"].number == 12
    assert decode_gradient(encoded) == (header, memoryview(b""))
    body = b"\x08\x01\x58\x02"  # step 1, in_segment = 2 (protobuf reads True)
    raw = b"\x12" + bytes([len(body)]) + body
    decoded = decode_gradient(raw)
    assert decoded is not None and decoded[0].in_segment is True
    assert header_of(pb.WorkerMessage.FromString(raw).gradient) == decoded[0]


def test_an_int8_chunks_scale_travels_as_float_field_14_and_the_last_one_wins() -> None:
    """A float32 value survives both parsers exactly, NaN included; protobuf keeps the last."""
    assert pb.GradientChunk.DESCRIPTOR.fields_by_name["scale"].number == 14
    scale = struct.unpack("<f", struct.pack("<f", 0.1))[0]  # a float32 value
    header = ChunkHeader(step=3, offset=4096, dtype=pb.DTYPE_INT8, reply_dtype=1, scale=scale)
    encoded = encode_gradient(header, b"\x01\xff")
    assert decode_gradient(encoded) == (header, memoryview(b"\x01\xff"))
    assert header_of(pb.WorkerMessage.FromString(encoded).gradient) == header
    nan = encode_gradient(ChunkHeader(dtype=pb.DTYPE_INT8, scale=math.nan), b"")
    decoded = decode_gradient(nan)
    assert decoded is not None and math.isnan(decoded[0].scale)
    assert math.isnan(pb.WorkerMessage.FromString(nan).gradient.scale)
    twice = b"\x75" + struct.pack("<f", 1.0) + b"\x75" + struct.pack("<f", -2.0)  # key 14 << 3 | 5
    raw = b"\x12" + bytes([len(twice)]) + twice
    decoded = decode_gradient(raw)
    assert decoded is not None and decoded[0].scale == -2.0
    assert pb.WorkerMessage.FromString(raw).gradient.scale == -2.0


def test_a_scale_in_another_wire_type_or_cut_short_is_left_to_protobuf() -> None:
    as_varint = b"\x70\x05"  # field 14 as a varint: not a float, protobuf decides
    assert decode_gradient(b"\x12" + bytes([len(as_varint)]) + as_varint) is None
    cut = b"\x75\x00\x00"  # two of the float's four bytes
    with pytest.raises(ValueError, match="truncated"):
        decode_gradient(b"\x12" + bytes([len(cut)]) + cut)
    with pytest.raises(DecodeError):
        pb.WorkerMessage.FromString(b"\x12" + bytes([len(cut)]) + cut)


@pytest.mark.parametrize("seed", range(20))
def test_payloads_start_at_an_aligned_offset_of_the_message(seed: int) -> None:
    """Whatever the header's size, the payload starts at a multiple of 16 bytes, so a
    received message's payload is summed in place (no alignment copy on the coordinator)."""
    rng = random.Random(seed)
    header = random_header(rng)
    payload = rng.randbytes(rng.choice([1, 127, 128, 4096, 70000, 262144]))
    encoded = encode_gradient(header, [payload[:3], memoryview(payload)[3:]])
    decoded = decode_gradient(encoded)
    assert decoded is not None
    view = decoded[1]
    assert bytes(view) == payload and decoded[0] == header
    offset = len(encoded) - len(view)  # the payload is the message's last bytes
    assert offset % PAYLOAD_ALIGNMENT == 0, offset
    parsed = pb.WorkerMessage.FromString(encoded).gradient
    assert parsed.payload == payload and set(parsed.alignment) <= {0}


def test_an_empty_payload_gets_no_alignment_field() -> None:
    """A header-only chunk (the same-host segment path) stays as short as protobuf's."""
    header = ChunkHeader(step=5, bucket_index=2, dtype=1, in_segment=True, segment_offset=64)
    encoded = encode_gradient(header, b"")
    parsed = pb.WorkerMessage.FromString(encoded)
    assert parsed.gradient.alignment == b""
    assert bytes([19 << 3 | 2 | 0x80, 1]) not in encoded  # the alignment field's tag
    assert decode_gradient(encoded) == (header, memoryview(b""))
