"""Reassembly of a blob uploaded in chunks (pure logic): checkpoints.

Chunks follow the wire rule (chunk k covers [k*C, min((k+1)*C, size))), so
every offset and length can be checked, duplicates refused and completion
known without trusting the sender.
"""

from __future__ import annotations

from gradsync.protocol import chunking
from gradsync.protocol.codes import Code
from gradsync.server.errors import RejectedMessage


class BlobAssembler:
    """Collects the chunks of one blob of `total_bytes`.

    Raises RejectedMessage (RESOURCE_EXHAUSTED) at construction when the blob
    is larger than `limit_bytes`.
    """

    def __init__(self, what: str, total_bytes: int, chunk_bytes: int, limit_bytes: int) -> None:
        if total_bytes > limit_bytes:
            raise RejectedMessage(
                Code.RESOURCE_EXHAUSTED,
                f"{what} has {total_bytes} bytes; the coordinator accepts at most {limit_bytes}",
            )
        self.what = what
        self.total_bytes = total_bytes
        self.chunk_bytes = chunk_bytes
        self._data = bytearray(total_bytes)
        self._seen: set[int] = set()
        self._received = 0

    def add(self, offset: int, payload: bytes) -> bool:
        """Store one chunk; return True once the blob is complete.

        Raises:
            RejectedMessage: INVALID_ARGUMENT for a misaligned, mis-sized or repeated chunk.
        """
        if offset % self.chunk_bytes or offset >= max(self.total_bytes, 1):
            raise RejectedMessage(
                Code.INVALID_ARGUMENT,
                f"{self.what}: chunk at offset {offset}; offsets must be multiples of "
                f"{self.chunk_bytes} below {self.total_bytes}",
            )
        expected = chunking.expected_chunk_length(self.total_bytes, self.chunk_bytes, offset)
        if len(payload) != expected:
            raise RejectedMessage(
                Code.INVALID_ARGUMENT,
                f"{self.what}: {len(payload)} bytes at offset {offset}, expected {expected}",
            )
        if offset in self._seen:
            raise RejectedMessage(
                Code.INVALID_ARGUMENT, f"{self.what}: chunk at offset {offset} sent twice"
            )
        self._seen.add(offset)
        self._data[offset : offset + len(payload)] = payload
        self._received += len(payload)
        return self._received == self.total_bytes

    def blob(self) -> bytes:
        """The assembled bytes (call once complete)."""
        return bytes(self._data)
