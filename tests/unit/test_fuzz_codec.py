"""Property tests of the chunk codec and the chunking rule (hypothesis).

The coordinator parses every gradient chunk with the hand-written fast parser
(`decode_gradient`) before protobuf ever sees it, so the parser is the first
thing hostile bytes meet. Its contract: on any bytes it returns None (not a
lone gradient chunk: protobuf decides), raises ValueError (not protobuf), or
returns exactly what protobuf would parse. Nothing else may escape, and a
header the fast path accepts must never differ from protobuf's reading of
the same bytes (a field protobuf truncates to 32 bits must not reach the job
as a 64-bit number).

The chunking rule is checked the same way: the spans tile a buffer exactly,
and `check_chunk` accepts a chunk if and only if it is one of those spans,
and every refusal carries a status code and a message naming the values.

The profile is deterministic (`derandomize=True`, no example database), so
CI runs the same examples every time; raise `max_examples` locally to search
harder.
"""

from __future__ import annotations

import dataclasses
import itertools
import math

from google.protobuf.message import DecodeError
from gradsync_proto import chunking
from gradsync_proto.codec import ChunkHeader, decode_gradient, encode_gradient, header_of
from gradsync_proto.codes import Code
from gradsync_proto.v1 import gradsync_pb2 as pb
from gradsync_server.dataplane.chunk_checks import check_chunk, check_range_chunk, offset_problem
from hypothesis import HealthCheck, given, settings, strategies as st

FUZZ = settings(
    max_examples=400,
    derandomize=True,
    database=None,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)

U64 = 2**64 - 1
U32 = 2**32 - 1
# Values that sit on every boundary a varint or a field type has.
EDGES = [0, 1, 127, 128, 2**31 - 1, 2**31, U32, 2**32, 2**63, U64, 2**64, 2**70 - 1]


def varint(value: int) -> bytes:
    """Protobuf base-128 varint of a non-negative integer (any size, for hostile input)."""
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def encode_field(field: int, wire_type: int, value: int | bytes) -> bytes:
    key = varint((field << 3) | wire_type)
    if wire_type == 0:
        assert isinstance(value, int)
        return key + varint(value)
    if wire_type == 1:
        return key + (value if isinstance(value, bytes) else b"")[:8].ljust(8, b"\0")
    if wire_type == 5:
        return key + (value if isinstance(value, bytes) else b"")[:4].ljust(4, b"\0")
    raw = value if isinstance(value, bytes) else varint(value)
    return key + varint(len(raw)) + raw


integers = st.one_of(st.sampled_from(EDGES), st.integers(0, 2**70 - 1), st.integers(0, 300))
field_numbers = st.one_of(st.integers(1, 14), st.sampled_from([0, 15, 16, 2**29 - 1, 2**29]))
wire_types = st.sampled_from([0, 0, 0, 1, 2, 2, 3, 4, 5, 6, 7])


@st.composite
def gradient_fields(draw: st.DrawFn) -> bytes:
    """The body of a GradientChunk: known and unknown fields, any wire type, any value."""
    fields = draw(
        st.lists(
            st.tuples(field_numbers, wire_types, st.one_of(integers, st.binary(max_size=40))),
            max_size=12,
        )
    )
    body = b""
    for field, wire_type, value in fields:
        if wire_type in (3, 4, 6, 7):
            body += varint((field << 3) | wire_type)  # groups and invalid types: the bare key
        elif wire_type == 0:
            body += encode_field(field, 0, value if isinstance(value, int) else len(value))
        else:
            body += encode_field(field, wire_type, value)
    return body


@st.composite
def hostile_messages(draw: st.DrawFn) -> bytes:
    """Mostly messages that start like a gradient chunk, then cut, padded or bit-flipped."""
    body = draw(gradient_fields())
    prefix = draw(st.sampled_from([b"\x12", b"\x12", b"\x1a", b"\x0a", b""]))
    raw = prefix + varint(draw(st.sampled_from([len(body), len(body), len(body) + 1]))) + body
    mutation = draw(st.sampled_from(["none", "none", "truncate", "flip", "append"]))
    if mutation == "truncate" and raw:
        raw = raw[: draw(st.integers(0, len(raw) - 1))]
    elif mutation == "flip" and raw:
        index = draw(st.integers(0, len(raw) - 1))
        raw = raw[:index] + bytes([raw[index] ^ draw(st.integers(1, 255))]) + raw[index + 1 :]
    elif mutation == "append":
        raw += draw(st.binary(min_size=1, max_size=8))
    return raw


def assert_agrees_with_protobuf(raw: bytes) -> None:
    """The fast parser's whole contract on one input (see the module docstring)."""
    try:
        decoded = decode_gradient(raw)
    except ValueError:
        # Documented: not valid protobuf. Protobuf must agree, or the fast path
        # would refuse a message the contract allows.
        try:
            pb.WorkerMessage.FromString(raw)
        except DecodeError:
            return
        raise AssertionError(f"fast parser refused bytes protobuf accepts: {raw.hex()}") from None
    if decoded is None:
        return
    header, payload = decoded
    parsed = pb.WorkerMessage.FromString(raw)  # must not raise: the fast path accepted it
    assert parsed.WhichOneof("kind") == "gradient", raw.hex()
    slow = header_of(parsed.gradient)
    if math.isnan(header.scale) and math.isnan(slow.scale):  # NaN != NaN: compare the rest
        header, slow = dataclasses.replace(header, scale=0.0), dataclasses.replace(slow, scale=0.0)
    assert header == slow, raw.hex()
    assert bytes(payload) == parsed.gradient.payload, raw.hex()


@FUZZ
@given(st.binary(max_size=200))
def test_arbitrary_bytes_parse_or_fail_as_documented(raw: bytes) -> None:
    assert_agrees_with_protobuf(raw)


@FUZZ
@given(hostile_messages())
def test_mutated_gradient_messages_parse_exactly_as_protobuf(raw: bytes) -> None:
    assert_agrees_with_protobuf(raw)


headers = st.builds(
    ChunkHeader,
    step=st.integers(0, U64),
    membership_epoch=st.integers(0, U64),
    bucket_index=st.integers(0, U32),
    offset=st.integers(0, U64),
    dtype=st.sampled_from(list(pb.DType.values())),
    encoding=st.sampled_from(list(pb.Encoding.values())),
    contributors=st.integers(0, U32),
    reply_dtype=st.sampled_from(list(pb.DType.values())),
    covered_ranks=st.lists(st.integers(0, U32), max_size=6).map(tuple),
    in_segment=st.booleans(),
    segment_offset=st.integers(0, U64),
    nonfinite_ranks=st.lists(st.integers(0, U32), max_size=3).map(tuple),
    scale=st.floats(width=32, allow_nan=False),
)
payloads = st.lists(st.binary(max_size=300), max_size=4)


@FUZZ
@given(headers, payloads)
def test_any_header_round_trips_through_both_parsers(
    header: ChunkHeader, pieces: list[bytes]
) -> None:
    encoded = encode_gradient(header, pieces)
    decoded = decode_gradient(encoded)
    assert decoded is not None
    assert decoded[0] == header and bytes(decoded[1]) == b"".join(pieces)
    for message_type in (pb.WorkerMessage, pb.CoordinatorMessage):
        parsed = message_type.FromString(encoded)
        assert header_of(parsed.gradient) == header
        assert parsed.gradient.payload == b"".join(pieces)


@FUZZ
@given(headers, st.binary(max_size=300), st.data())
def test_truncated_encodings_never_escape_the_documented_errors(
    header: ChunkHeader, payload: bytes, data: st.DataObject
) -> None:
    encoded = encode_gradient(header, payload)
    cut = data.draw(st.integers(0, len(encoded) - 1))
    assert_agrees_with_protobuf(encoded[:cut])


# ---------------------------------------------------------------- the chunking rule
sizes = st.one_of(st.integers(0, 5000), st.sampled_from([0, 1, 4095, 4096, 4097, 2**40 + 3]))
chunk_sizes = st.one_of(st.integers(1, 600), st.sampled_from([1, 4096, 1 << 20]))


@FUZZ
@given(st.integers(0, 5000), chunk_sizes)
def test_chunk_spans_tile_the_buffer_exactly(total: int, chunk_bytes: int) -> None:
    spans = list(chunking.chunk_spans(total, chunk_bytes))
    assert len(spans) == chunking.num_chunks(total, chunk_bytes)
    position = 0
    for offset, length in spans:
        assert offset == position and 0 < length <= chunk_bytes
        assert length == chunking.expected_chunk_length(total, chunk_bytes, offset)
        position += length
    assert position == total


@FUZZ
@given(st.integers(0, 5000), st.integers(1, 9), st.sampled_from([1, 2, 4, 8]), chunk_sizes)
def test_shard_ranges_partition_every_bucket(
    elements: int, shards: int, itemsize: int, chunk_bytes: int
) -> None:
    ranges = chunking.shard_ranges(elements, shards)
    assert ranges[0][0] == 0 and ranges[-1][1] == elements
    assert all(a[1] == b[0] for a, b in itertools.pairwise(ranges))
    lengths = [stop - start for start, stop in ranges]
    assert max(lengths) - min(lengths) <= 1 and lengths == sorted(lengths, reverse=True)
    covered = 0
    for index in range(shards):
        lo, hi = chunking.shard_byte_range(elements, itemsize, shards, index)
        assert lo == covered
        covered = hi
        spans = list(chunking.range_chunk_spans(lo, hi, chunk_bytes))
        assert sum(length for _, length in spans) == hi - lo
    assert covered == elements * itemsize


def assert_refusal(problem: tuple[Code, str] | None, *values: int) -> None:
    assert problem is not None
    code, message = problem
    assert code in (Code.INVALID_ARGUMENT, Code.RESOURCE_EXHAUSTED)
    assert message and all(str(value) in message for value in values), message


@FUZZ
@given(sizes, chunk_sizes, st.integers(0, 2**64), st.integers(0, 2**33), st.integers(0, 2**31))
def test_check_chunk_accepts_exactly_the_grid(
    total: int, chunk_bytes: int, offset: int, length: int, rank: int
) -> None:
    problem = check_chunk("bucket 0", offset, length, total, "the bucket", chunk_bytes, rank)
    on_grid = (
        offset % chunk_bytes == 0
        and offset < total
        and length == chunking.expected_chunk_length(total, chunk_bytes, offset)
    )
    if on_grid:
        assert problem is None
    else:
        assert_refusal(problem, rank)


@FUZZ
@given(st.data(), sizes, chunk_sizes, st.integers(0, 2**31))
def test_every_grid_chunk_is_accepted(
    data: st.DataObject, total: int, chunk_bytes: int, rank: int
) -> None:
    if total == 0:
        return
    index = data.draw(st.integers(0, chunking.num_chunks(total, chunk_bytes) - 1))
    offset = index * chunk_bytes
    length = chunking.expected_chunk_length(total, chunk_bytes, offset)
    assert check_chunk("x", offset, length, total, "y", chunk_bytes, rank) is None


#: Two range ends (any order), a chunk size, an offset and a length: a shard's chunk.
range_chunks = (
    st.integers(0, 5000),
    st.integers(0, 5000),
    chunk_sizes,
    st.integers(0, 2**64),
    st.integers(0, 2**33),
)


@FUZZ
@given(*range_chunks, st.integers(0, 2**31))
def test_check_range_chunk_accepts_exactly_the_range_grid(
    a: int, b: int, chunk_bytes: int, offset: int, length: int, rank: int
) -> None:
    lo, hi = min(a, b), max(a, b)
    problem = check_range_chunk("bucket 0", offset, length, (lo, hi), "b", chunk_bytes, rank, "s1")
    if (offset, length) in set(chunking.range_chunk_spans(lo, hi, chunk_bytes)):
        assert problem is None
    else:
        assert_refusal(problem, rank)


@FUZZ
@given(*range_chunks, st.sampled_from([1, 2]))
def test_offset_problems_fast_acceptance_agrees_with_the_full_checks(
    a: int, b: int, chunk_bytes: int, offset: int, length: int, shard_count: int
) -> None:
    """`offset_problem` accepts without building a message; it must accept exactly
    what `check_chunk` (one shard) or `check_range_chunk` (several) accepts."""
    lo, hi = min(a, b), max(a, b)
    total = max(hi, 1)
    chunk = ChunkHeader(step=4, bucket_index=1, offset=offset, dtype=pb.DTYPE_FLOAT32)
    problem = offset_problem(
        3,
        chunk,
        length,
        pb.DTYPE_FLOAT32,
        wire_bytes=total,
        byte_range=(lo, hi),
        chunk_bytes=chunk_bytes,
        shard=(shard_count, "shard 1"),
        elements=total // 4,
    )
    if shard_count == 1:
        full = check_chunk("b", offset, length, total, "c", chunk_bytes, 3)
    else:
        full = check_range_chunk("b", offset, length, (lo, hi), "c", chunk_bytes, 3, "shard 1")
        full = full if lo < hi else (Code.INVALID_ARGUMENT, "holds no byte of it")
    assert (problem is None) == (full is None)
    if problem is not None:
        assert_refusal(problem, 3)
