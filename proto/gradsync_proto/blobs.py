"""A byte blob on the wire: cut into chunks by the sender, put back together by the receiver.

Checkpoints, a donor's healing state, the resume download, rank 0's state
broadcast and every collective's inputs and results are byte blobs that
travel the same way: chunk k covers [k*C, min((k+1)*C, size)) of the blob
(`gradsync_proto.chunking`), the chunks go in order on one stream, and the
receiver checks every offset and length before it keeps a byte. Both the
worker and the coordinator send and receive such blobs, so the cutting
(`blob_chunks`) and the checking and reassembly (`BlobAssembly`) live here
once; each end wraps a chunk's (offset, payload) in its own message and
adds only what is its own (a cap on the declared size, a byte budget, how a
refusal travels).

Memory follows the bytes that arrived, never the size a sender declares
(one 14-byte CheckpointChunk declaring 2 GiB made the coordinator
zero-fill 2 GiB): the declared total is only a claim that chunks are checked
against, the buffer grows by each chunk's bytes, and a chunk that arrives
ahead of a gap is held apart until the gap fills. Pure logic, no I/O.
"""

from __future__ import annotations

from collections.abc import Iterator

from gradsync_proto import chunking
from gradsync_proto.codes import Code

__all__ = ["BadChunk", "BlobAssembly", "blob_chunks"]


def blob_chunks(
    blob: bytes | bytearray | memoryview, chunk_bytes: int, *, empty_chunk: bool = False
) -> Iterator[tuple[int, bytes]]:
    """Yield (offset, payload) of every chunk of `blob`, in order.

    Args:
        blob: the bytes to send (a numpy array's `.data` works too).
        chunk_bytes: the most payload bytes per chunk (the Welcome's).
        empty_chunk: an empty blob is still one empty chunk at offset 0 (a
            collective's input or result must arrive to be counted); without
            it an empty blob is no chunk at all (an empty state broadcast).
    """
    view = memoryview(blob).cast("B")
    if not len(view) and empty_chunk:
        yield 0, b""
    for offset, length in chunking.chunk_spans(len(view), chunk_bytes):
        yield offset, view[offset : offset + length].tobytes()


class BadChunk(ValueError):
    """A chunk that does not fit the blob it claims to belong to.

    `code` is what the coordinator answers with (INVALID_ARGUMENT for a
    misplaced, mis-sized or repeated chunk; the assembly's `oversize` code for
    one above the chunk limit); `message` names the blob and both values.
    """

    def __init__(self, code: Code, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class BlobAssembly:
    """The chunks of one blob of `total_bytes` as they arrive, each checked against the rule.

    Args:
        what: the blob and its sender, opening every message ("checkpoint of
            step 5 from rank 0").
        total_bytes: the size the sender declares: checked against, never allocated.
        chunk_bytes: the wire chunk size.
        in_order: refuse a chunk that arrives before the one it follows (a
            sender sends in order on one stream; checkpoint, healing, state
            and resume receivers insist). False: any order (collective inputs
            and results, the coordinator's state relay), chunks ahead of a
            gap held apart until it fills.
        keep: keep the bytes (False: check and count them only, for a relay
            that forwards each chunk as it comes).
        oversize: the code of a chunk above `chunk_bytes`.
        empty_chunk: as for `blob_chunks`: an empty blob is one empty chunk at
            offset 0, so that its arrival is known (False: it is no chunk, and
            complete from the start).
    """

    def __init__(
        self,
        what: str,
        total_bytes: int,
        chunk_bytes: int,
        *,
        in_order: bool = True,
        keep: bool = True,
        oversize: Code = Code.RESOURCE_EXHAUSTED,
        empty_chunk: bool = True,
    ) -> None:
        if chunk_bytes <= 0:
            raise ValueError(f"{what}: the chunk size must be positive, got {chunk_bytes}")
        self.what = what
        self.total_bytes = total_bytes
        self.chunk_bytes = chunk_bytes
        self._in_order = in_order
        self._keep = keep
        self._oversize = oversize
        self._empty_chunk = empty_chunk
        #: The contiguous bytes from offset 0 (empty when not kept).
        self._data = bytearray()
        #: Where the contiguous prefix ends (the next chunk expected in order).
        self._next = 0
        #: Chunks that arrived ahead of a gap, by offset (payloads empty when not kept).
        self._ahead: dict[int, bytes] = {}
        self._chunks = 0
        #: Bytes received so far (held in memory when kept).
        self.received = 0

    @property
    def chunks_expected(self) -> int:
        """How many chunks make the blob (an empty one: one, or none without `empty_chunk`)."""
        chunks = chunking.num_chunks(self.total_bytes, self.chunk_bytes)
        return chunks or (1 if self._empty_chunk else 0)

    @property
    def chunks_received(self) -> int:
        """How many chunks arrived."""
        return self._chunks

    @property
    def complete(self) -> bool:
        """True once every chunk arrived."""
        return self._chunks == self.chunks_expected

    def missing_offsets(self) -> list[int]:
        """Offsets of the chunks still missing, ascending (for a timeout's message)."""
        if self.total_bytes == 0:
            return [0] if self._chunks < self.chunks_expected else []
        grid = range(self._next, self.total_bytes, self.chunk_bytes)
        return [offset for offset in grid if offset not in self._ahead]

    def check(self, offset: int, length: int, claimed_total: int | None = None) -> None:
        """Refuse a chunk of `length` bytes at `offset` that cannot belong here (stores nothing).

        Args:
            claimed_total: the blob's size as this chunk states it (every
                chunk repeats it on the wire), if it does.

        Raises:
            BadChunk: claiming another size than the blob's, above the chunk
                limit, off the grid or beyond the blob, repeated, ahead of
                order (`in_order`), or not the length the rule gives its offset.
        """
        what, total, size = self.what, self.total_bytes, self.chunk_bytes
        one_empty = total == 0 and self._empty_chunk
        if claimed_total is not None and claimed_total != total:
            raise BadChunk(
                Code.INVALID_ARGUMENT,
                f"{what}: the chunk at offset {offset} claims {claimed_total} bytes in all, "
                f"not {total}",
            )
        if length > size:
            raise BadChunk(
                self._oversize,
                f"{what}: {length} bytes in one chunk at offset {offset}; the chunk limit is "
                f"{size} bytes",
            )
        if one_empty and (offset or length):
            raise BadChunk(
                Code.INVALID_ARGUMENT,
                f"{what}: {length} bytes at offset {offset}, but it was declared empty "
                "(total_bytes 0: one empty chunk at offset 0)",
            )
        if not one_empty and (offset % size or offset >= total):
            raise BadChunk(
                Code.INVALID_ARGUMENT,
                f"{what}: chunk at offset {offset} is out of range or misaligned; offsets must "
                f"be multiples of {size} below {total}",
            )
        if offset < self._next or offset in self._ahead or (one_empty and self._chunks):
            raise BadChunk(
                Code.INVALID_ARGUMENT, f"{what}: the chunk at offset {offset} arrived twice"
            )
        if self._in_order and offset != self._next:
            raise BadChunk(
                Code.INVALID_ARGUMENT,
                f"{what}: the chunk at offset {offset} arrived before the one at offset "
                f"{self._next}; chunks must be sent in order",
            )
        expected = chunking.expected_chunk_length(total, size, offset)
        if length != expected:
            raise BadChunk(
                Code.INVALID_ARGUMENT,
                f"{what}: {length} bytes at offset {offset}, expected {expected} "
                f"({total} bytes in chunks of {size})",
            )

    def add(
        self, offset: int, payload: bytes | memoryview, claimed_total: int | None = None
    ) -> bool:
        """Check and store one chunk; return True once the blob is complete.

        Raises:
            BadChunk: see `check` (nothing is stored then).
        """
        self.check(offset, len(payload), claimed_total)
        self._chunks += 1
        self.received += len(payload)
        if offset != self._next:
            self._ahead[offset] = bytes(payload) if self._keep else b""
            return self.complete
        self._extend(payload)
        while self._next in self._ahead:  # a gap filled: what waited behind it follows
            self._extend(self._ahead.pop(self._next))
        return self.complete

    def _extend(self, payload: bytes | memoryview) -> None:
        """Append the chunk at `_next` to the contiguous prefix."""
        if self._keep:
            self._data += payload
        self._next += chunking.expected_chunk_length(self.total_bytes, self.chunk_bytes, self._next)

    def blob(self) -> bytearray:
        """The assembled bytes (once complete and kept), not copied; `release` lets go."""
        if not self.complete:
            raise ValueError(
                f"{self.what}: {self._chunks} of {self.chunks_expected} chunks arrived; "
                "the blob is incomplete"
            )
        return self._data

    def release(self) -> None:
        """Drop every byte held (idempotent)."""
        self._data = bytearray()
        self._ahead.clear()
