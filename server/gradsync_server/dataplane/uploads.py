"""Reassembly of a blob uploaded in chunks (pure logic): checkpoints and healing state.

Chunks follow the wire rule (chunk k covers [k*C, min((k+1)*C, size))), so
every offset and length can be checked, duplicates refused and completion
known without trusting the sender.

Memory follows the bytes that arrived, never the size a sender declares
(issue 11: one 14-byte CheckpointChunk declaring 2 GiB made the coordinator
zero-fill 2 GiB). The declared total is checked against a cap first, chunks
must then come in order (the worker sends them so on one stream), the buffer
grows by each chunk's bytes, and what it holds is counted in the
coordinator's byte budget through a `Reservation`, released when the blob is
taken or the upload abandoned.
"""

from __future__ import annotations

from gradsync_proto import chunking
from gradsync_proto.codes import Code

from gradsync_server.dataplane.budget import OwnerBudget, Reservation
from gradsync_server.errors import RejectedMessage


class _Unbudgeted:
    """Stands in for a reservation where no budget is involved (unit tests)."""

    held = 0

    def fits(self, extra: int) -> bool:
        return True

    def hold(self, nbytes: int) -> None:
        self.held = nbytes

    def release(self) -> None:
        self.held = 0


class BlobAssembler:
    """Collects the chunks of one blob of `total_bytes`, in order.

    Args:
        what: the blob in messages ("checkpoint of step 5 from rank 0").
        total_bytes: the size the sender declares (checked, not allocated).
        chunk_bytes: the wire chunk size.
        limit_bytes: the largest blob accepted (`--max-checkpoint-mb`).
        budget: the job's share of the byte budget, where the bytes held are
            counted and checked (None: nowhere).

    Raises:
        RejectedMessage: RESOURCE_EXHAUSTED at construction when the blob is
            larger than `limit_bytes`.
    """

    def __init__(
        self,
        what: str,
        total_bytes: int,
        chunk_bytes: int,
        limit_bytes: int,
        budget: OwnerBudget | None = None,
    ) -> None:
        if total_bytes > limit_bytes:
            raise RejectedMessage(
                Code.RESOURCE_EXHAUSTED,
                f"{what} declares {total_bytes} bytes; the coordinator accepts at most "
                f"{limit_bytes} (--max-checkpoint-mb)",
            )
        self.what = what
        self.total_bytes = total_bytes
        self.chunk_bytes = chunk_bytes
        self._data = bytearray()
        self._budget: OwnerBudget | _Unbudgeted = budget or _Unbudgeted()
        self._reservation: Reservation | _Unbudgeted = (
            budget.reserve() if budget is not None else _Unbudgeted()
        )

    @property
    def received(self) -> int:
        """Bytes received so far (and held)."""
        return len(self._data)

    def add(self, offset: int, payload: bytes) -> bool:
        """Store one chunk; return True once the blob is complete.

        Raises:
            RejectedMessage: INVALID_ARGUMENT for a misaligned, mis-sized, repeated
                or out-of-order chunk; RESOURCE_EXHAUSTED when the byte budget is full.
        """
        if offset % self.chunk_bytes or offset >= max(self.total_bytes, 1):
            raise RejectedMessage(
                Code.INVALID_ARGUMENT,
                f"{self.what}: chunk at offset {offset}; offsets must be multiples of "
                f"{self.chunk_bytes} below {self.total_bytes}",
            )
        if offset < self.received:
            raise RejectedMessage(
                Code.INVALID_ARGUMENT, f"{self.what}: chunk at offset {offset} sent twice"
            )
        if offset != self.received:
            raise RejectedMessage(
                Code.INVALID_ARGUMENT,
                f"{self.what}: chunk at offset {offset} arrived before the one at offset "
                f"{self.received}; chunks must be sent in order",
            )
        expected = chunking.expected_chunk_length(self.total_bytes, self.chunk_bytes, offset)
        if len(payload) != expected:
            raise RejectedMessage(
                Code.INVALID_ARGUMENT,
                f"{self.what}: {len(payload)} bytes at offset {offset}, expected {expected}",
            )
        if not self._budget.fits(len(payload)):
            raise RejectedMessage(
                Code.RESOURCE_EXHAUSTED,
                f"{self.what}: no room for {len(payload)} more bytes at offset {offset} in "
                "the coordinator's buffer budget (--max-buffered-mb)",
            )
        self._data += payload
        self._reservation.hold(len(self._data))
        return len(self._data) == self.total_bytes

    def blob(self) -> bytes:
        """The assembled bytes (call once complete); the budget is given back."""
        data = bytes(self._data)
        self.release()
        return data

    def release(self) -> None:
        """Drop what is held and give it back to the budget (idempotent)."""
        self._data = bytearray()
        self._reservation.release()
