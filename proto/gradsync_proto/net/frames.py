"""The frame plane: a worker's Sync stream as length-prefixed frames on a plain socket.

Why it exists: for a small model the per-step cost of a worker's
stream is not its bytes but grpc-python's per-message work (HTTP/2 framing,
its poller and event-engine threads, the copies into and out of its slices),
on both ends. The messages themselves are the same bytes gRPC would carry
(`WorkerMessage` / `CoordinatorMessage`, gradient chunks encoded by
`gradsync_proto.codec`), so the coordinator serves a frame connection with
the very handler it serves a gRPC Sync stream with; only the pipe differs.

A connection, after TLS when the coordinator has it:

1. the worker sends a HELLO frame: `MAGIC`, then the token in UTF-8 (empty
   without one); the coordinator compares it in constant time before it
   reads anything else, and refuses with a STATUS frame otherwise;
2. MESSAGE frames both ways, each one message of the stream;
3. the coordinator's last frame is a STATUS frame (code, details): the gRPC
   status the same stream would have ended with. A connection that closes
   without one broke (UNAVAILABLE to the worker).

Every frame is a 5-byte header (kind, then the body's length, big-endian)
and the body. A length is a claim, not an allocation: a frame longer than
the receiver's limit ends the connection before its body is read.

`FrameReader` parses frames from an asyncio `BufferedProtocol` without a copy
for large bodies: small frames are cut from a staging buffer, a large body is
received straight into a buffer of its own size.
"""

from __future__ import annotations

import asyncio
import struct
from collections.abc import Callable

from gradsync_proto import defaults
from gradsync_proto.codes import Code

__all__ = [
    "HEADER",
    "HELLO",
    "JOIN_BELOW_BYTES",
    "MAGIC",
    "MESSAGE",
    "STATUS",
    "WRITE_HIGH_WATER",
    "FrameError",
    "FrameReader",
    "decode_hello",
    "decode_status",
    "hello_frame",
    "status_frame",
    "write_message",
]

#: kind (1 byte), body length (4 bytes, big-endian).
HEADER = struct.Struct("!BI")
MESSAGE, HELLO, STATUS = 0, 1, 2
_KINDS = (MESSAGE, HELLO, STATUS)
#: First bytes of every HELLO: the protocol and its version.
MAGIC = b"gradsync-frames/1\n"
#: The longest HELLO a coordinator reads (magic and a token of the longest allowed size).
MAX_HELLO_BYTES = len(MAGIC) + 4096 * 4
#: Above this many unsent bytes a sender waits for the socket (asyncio's write high water).
WRITE_HIGH_WATER = 1024 * 1024
#: Bodies up to this size are joined to their header: one copy of the body, and one
#: send instead of two. Two sends cost more than the copy up to a chunk's size: the
#: header alone goes out as a packet of its own (TCP_NODELAY) and wakes the reader
#: for 5 bytes. Measured at W = 16 on a tiny model (257 KiB messages): the
#: coordinator's two writes took 53 us each under load, the whole send 117 us.
JOIN_BELOW_BYTES = defaults.CHUNK_BYTES + defaults.HEADER_SLACK_BYTES
#: The longest details of a STATUS frame sent (longer ones are cut).
MAX_DETAILS_BYTES = 16 * 1024
_CODE = struct.Struct("!I")
#: Below this a frame is cut from the staging buffer (one small copy); above it the
#: body is received straight into a buffer of its own.
_STAGING_BYTES = 64 * 1024


class FrameError(ValueError):
    """The peer sent something that is not a frame stream (the message says what).

    `code` is the status the stream ends with: INVALID_ARGUMENT, or
    RESOURCE_EXHAUSTED for a frame over the size limit (gRPC's code for that).
    """

    def __init__(self, message: str, code: Code = Code.INVALID_ARGUMENT) -> None:
        super().__init__(message)
        self.code = code


def write_message(transport: asyncio.WriteTransport, raw: bytes) -> None:
    """Write one MESSAGE frame: a body up to a chunk's size joined to its header (one
    send), a larger one after it (no copy of the body; Python 3.11's `writelines`
    would join them)."""
    if len(raw) < JOIN_BELOW_BYTES:
        transport.write(HEADER.pack(MESSAGE, len(raw)) + raw)
    else:
        transport.write(HEADER.pack(MESSAGE, len(raw)))
        transport.write(raw)


def hello_frame(token: str | None) -> bytes:
    """The worker's first frame: the protocol magic and its token."""
    body = MAGIC + (token or "").encode("utf-8")
    return HEADER.pack(HELLO, len(body)) + body


def decode_hello(body: bytes | bytearray) -> str:
    """The token a HELLO presents ("" for none).

    Raises:
        FrameError: not a gradsync frame stream, or another version of it.
    """
    if not bytes(body[: len(MAGIC)]) == MAGIC:
        raise FrameError(
            f"the first frame does not start with {MAGIC!r}: not a gradsync worker, or "
            "another version of gradsync's frame protocol"
        )
    try:
        return bytes(body[len(MAGIC) :]).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise FrameError(f"the token in the first frame is not UTF-8: {exc}") from None


def status_frame(code: int, details: str) -> bytes:
    """The coordinator's last frame: the stream's status code and details."""
    text = details.encode("utf-8")[:MAX_DETAILS_BYTES]
    body = _CODE.pack(code) + text
    return HEADER.pack(STATUS, len(body)) + body


def decode_status(body: bytes | bytearray) -> tuple[int, str]:
    """(code, details) of a STATUS frame.

    Raises:
        FrameError: shorter than its code.
    """
    if len(body) < _CODE.size:
        raise FrameError(f"a status frame of {len(body)} bytes is shorter than its code")
    (code,) = _CODE.unpack_from(body)
    return code, bytes(body[_CODE.size :]).decode("utf-8", "replace")


class FrameReader(asyncio.BufferedProtocol):
    """Frames out of a byte stream, handed to `on_frame(kind, body)` in order.

    Args:
        max_body_bytes: the longest body accepted; a longer claim ends the
            connection (`on_lost` gets a FrameError) before a byte of it is read.
        on_frame: called with each frame's kind and body, on the loop. A body
            is a `bytearray` the callee may keep.
        on_lost: called once when the connection ends: None for a clean EOF,
            else why (an OSError, or a FrameError for bytes that are not frames).
    """

    def __init__(
        self,
        max_body_bytes: int,
        on_frame: Callable[[int, bytearray], None],
        on_lost: Callable[[BaseException | None], None],
    ) -> None:
        self.max_body_bytes = max_body_bytes
        self._on_frame = on_frame
        self._on_lost = on_lost
        self._staging = bytearray(_STAGING_BYTES)
        self._view = memoryview(self._staging)
        self._start = 0  # first unparsed byte of the staging buffer
        self._end = 0  # one past the last received byte of the staging buffer
        self._body: bytearray | None = None  # a large body being received in place
        self._body_kind = MESSAGE
        self._body_filled = 0
        self._failed: BaseException | None = None
        self._lost = False
        self.transport: asyncio.BaseTransport | None = None

    # ------------------------------------------------------------ protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport

    def get_buffer(self, sizehint: int) -> memoryview:
        if self._body is not None:
            return memoryview(self._body)[self._body_filled :]
        if self._end == _STAGING_BYTES:  # full: move what is unparsed to the front
            pending = self._end - self._start
            self._view[:pending] = self._view[self._start : self._end]
            self._start, self._end = 0, pending
        return self._view[self._end :]

    def buffer_updated(self, nbytes: int) -> None:
        if self._failed is not None:
            return
        try:
            if self._body is not None:
                self._body_filled += nbytes
                if self._body_filled == len(self._body):
                    body, self._body = self._body, None
                    self._on_frame(self._body_kind, body)
                return
            self._end += nbytes
            self._parse()
        except Exception as exc:  # a bad frame, or the callee's: end the connection
            self._fail(exc)

    def eof_received(self) -> bool:
        return False  # close the transport (connection_lost follows)

    def connection_lost(self, exc: Exception | None) -> None:
        if self._lost:
            return
        self._lost = True
        partial = self._body is not None or self._end > self._start
        if exc is None and partial and self._failed is None:
            exc = FrameError("the connection closed in the middle of a frame")
        self._on_lost(self._failed or exc)

    # ------------------------------------------------------------ parsing
    def _parse(self) -> None:
        """Deliver every whole frame in the staging buffer; start a large body in place."""
        view = self._view
        while self._end - self._start >= HEADER.size and self._failed is None:
            kind, length = HEADER.unpack_from(view, self._start)
            if kind not in _KINDS:
                raise FrameError(f"a frame of unknown kind {kind}: not a gradsync frame stream")
            if length > self.max_body_bytes:
                raise FrameError(
                    f"a frame claims {length} bytes, more than the limit of "
                    f"{self.max_body_bytes} bytes: refused before reading it",
                    Code.RESOURCE_EXHAUSTED,
                )
            begin = self._start + HEADER.size
            available = self._end - begin
            if available >= length:
                self._start = begin + length
                self._on_frame(kind, bytearray(view[begin : begin + length]))
                continue
            if length + HEADER.size <= _STAGING_BYTES:
                break  # a small frame, not complete yet: wait for more in the staging buffer
            body = bytearray(length)  # bounded by max_body_bytes above
            body[:available] = view[begin : self._end]
            self._body, self._body_kind, self._body_filled = body, kind, available
            self._start = self._end = 0
            return
        if self._start == self._end:
            self._start = self._end = 0

    @property
    def failed(self) -> BaseException | None:
        """Why parsing stopped (a bad frame, or what `on_frame` raised); None while it runs."""
        return self._failed

    def _fail(self, exc: BaseException) -> None:
        self._failed = exc
        self.refuse(exc)

    def refuse(self, exc: BaseException) -> None:
        """Bytes that are not frames (or a callee that raised): drop the connection."""
        if isinstance(self.transport, asyncio.Transport):
            self.transport.abort()
