"""The frame format and its parser (`gradsync_proto.net.frames`), fed byte by byte.

`FrameReader` is an asyncio `BufferedProtocol`: asyncio asks it for a buffer,
receives into it, and says how many bytes came. These tests play asyncio's
part with every way a byte stream can be cut (one byte at a time, a frame split
across staging refills, several frames in one receive, bodies larger than the
staging buffer) and check that exactly the frames sent come out, in order; and
that what is not a frame stream (an unknown kind, a claimed length over the
limit, a stream cut in the middle of a frame) ends the connection with a
`FrameError` that says why, before a large claim is allocated.
"""

from __future__ import annotations

import asyncio
import random

import pytest
from gradsync_proto.codes import Code
from gradsync_proto.net.frames import (
    HEADER,
    HELLO,
    MAGIC,
    MESSAGE,
    STATUS,
    FrameError,
    FrameReader,
    decode_hello,
    decode_status,
    hello_frame,
    status_frame,
)


class _Transport(asyncio.Transport):
    """What the parser calls on its transport: abort (on a bad frame)."""

    def __init__(self) -> None:
        super().__init__()
        self.aborted = False

    def abort(self) -> None:
        self.aborted = True


class Fed:
    """A FrameReader and what came out of it."""

    def __init__(self, limit: int = 1 << 24) -> None:
        self.frames: list[tuple[int, bytes]] = []
        self.lost: list[BaseException | None] = []
        self.reader = FrameReader(limit, self._frame, self.lost.append)
        self.transport = _Transport()
        self.reader.transport = self.transport  # type: ignore[assignment]

    def _frame(self, kind: int, body: bytearray) -> None:
        assert isinstance(body, bytearray)
        self.frames.append((kind, bytes(body)))

    def feed(self, data: bytes, cuts: list[int] | None = None) -> None:
        """Receive `data` as asyncio would, in pieces no larger than each buffer offered."""
        position = 0
        cuts = cuts or []
        while position < len(data):
            buffer = self.reader.get_buffer(-1)
            assert len(buffer) > 0
            size = min(len(buffer), len(data) - position)
            if cuts:
                size = min(size, cuts.pop(0))
            buffer[:size] = data[position : position + size]
            self.reader.buffer_updated(size)
            position += size


def encode(kind: int, body: bytes) -> bytes:
    return HEADER.pack(kind, len(body)) + body


def test_frames_cut_anywhere_come_out_whole_and_in_order() -> None:
    rng = random.Random(7)
    sizes = [0, 1, 5, 4096, 60_000, 65_531, 65_536, 70_000, 257 * 1024, 3, 2_000_000]
    bodies = [rng.randbytes(size) for size in sizes]
    stream = b"".join(encode(MESSAGE, body) for body in bodies) + status_frame(0, "done")
    for seed in range(4):
        fed = Fed()
        cut_rng = random.Random(seed)
        cuts = [cut_rng.choice([1, 2, 5, 7, 100, 4096, 70_000]) for _ in range(5000)]
        fed.feed(stream, cuts)
        assert [body for _, body in fed.frames[:-1]] == bodies
        assert fed.frames[-1][0] == STATUS
        assert decode_status(fed.frames[-1][1]) == (0, "done")
        fed.reader.connection_lost(None)
        assert fed.lost == [None] and not fed.transport.aborted


def test_one_byte_at_a_time() -> None:
    bodies = [b"a" * 10, b"", b"b" * 70_000, b"c"]
    stream = b"".join(encode(MESSAGE, body) for body in bodies)
    fed = Fed()
    fed.feed(stream, [1] * len(stream))
    assert [body for _, body in fed.frames] == bodies


def test_a_claim_over_the_limit_is_refused_before_it_is_allocated() -> None:
    fed = Fed(limit=1000)
    fed.feed(HEADER.pack(MESSAGE, 2**32 - 1))
    assert fed.frames == []
    assert fed.transport.aborted
    fed.reader.connection_lost(None)
    (error,) = fed.lost
    assert isinstance(error, FrameError)
    assert error.code is Code.RESOURCE_EXHAUSTED
    assert "4294967295 bytes, more than the limit of 1000" in str(error)


def test_an_unknown_kind_ends_the_connection() -> None:
    fed = Fed()
    fed.feed(encode(MESSAGE, b"ok") + HEADER.pack(9, 0))
    assert fed.frames == [(MESSAGE, b"ok")]
    assert fed.transport.aborted
    fed.reader.connection_lost(None)
    assert isinstance(fed.lost[0], FrameError) and "unknown kind 9" in str(fed.lost[0])


@pytest.mark.parametrize("cut", [3, HEADER.size + 10, HEADER.size + 100_000])
def test_a_stream_cut_inside_a_frame_is_an_error_not_a_clean_end(cut: int) -> None:
    fed = Fed()
    fed.feed(encode(MESSAGE, b"x" * 200_000)[:cut])
    fed.reader.connection_lost(None)
    assert isinstance(fed.lost[0], FrameError)
    assert "in the middle of a frame" in str(fed.lost[0])


def test_a_callee_that_raises_ends_the_connection_once() -> None:
    def explode(kind: int, body: bytearray) -> None:
        raise RuntimeError("bug")

    lost: list[BaseException | None] = []
    reader = FrameReader(1000, explode, lost.append)
    transport = _Transport()
    reader.transport = transport  # type: ignore[assignment]
    buffer = reader.get_buffer(-1)
    data = encode(MESSAGE, b"1") + encode(MESSAGE, b"2")
    buffer[: len(data)] = data
    reader.buffer_updated(len(data))
    assert transport.aborted
    reader.connection_lost(None)
    reader.connection_lost(None)  # asyncio may report twice: told once
    assert len(lost) == 1 and isinstance(lost[0], RuntimeError)


def test_hello_carries_the_token_and_refuses_other_protocols() -> None:
    frame = hello_frame("s3cret-token-0123456789")
    kind, length = HEADER.unpack_from(frame)
    assert kind == HELLO and length == len(frame) - HEADER.size
    assert decode_hello(frame[HEADER.size :]) == "s3cret-token-0123456789"
    assert decode_hello(hello_frame(None)[HEADER.size :]) == ""
    with pytest.raises(FrameError, match="not a gradsync worker"):
        decode_hello(b"GET / HTTP/1.1\r\n")
    with pytest.raises(FrameError, match="not UTF-8"):
        decode_hello(MAGIC + b"\xff\xfe")


def test_status_round_trips_and_is_bounded() -> None:
    body = status_frame(int(Code.UNAVAILABLE), "shutting down")[HEADER.size :]
    assert decode_status(body) == (int(Code.UNAVAILABLE), "shutting down")
    long = status_frame(2, "x" * 100_000)
    assert len(long) < 20_000
    with pytest.raises(FrameError, match="shorter than its code"):
        decode_status(b"\x00")
