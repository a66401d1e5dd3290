"""A blob uploaded to the coordinator in chunks, within its caps (pure logic).

Checkpoints, healing state and collective inputs are reassembled by the
shared `gradsync_proto.blobs.BlobAssembly` (the wire rule, every offset and
length checked, memory following the bytes that arrived). What only the
coordinator adds is here: the declared total is checked against a cap
before anything is held, the bytes held are counted in the coordinator's
byte budget through a `Reservation` (checked before each chunk is kept,
released when the blob is taken or the upload abandoned), and a refusal is
a `RejectedMessage` that ends the sender's stream.

A rank's state uploaded for other ranks (a healing donor's, or a restarted
job's donor relayed to the ranks behind it) is one such blob: `DonorState`.
"""

from __future__ import annotations

from gradsync_proto.blobs import BadChunk, BlobAssembly
from gradsync_proto.codes import Code
from gradsync_proto.v1 import gradsync_pb2 as pb

from gradsync_server.dataplane.budget import OwnerBudget, Reservation
from gradsync_server.errors import RejectedMessage


class BlobAssembler:
    """Collects the chunks of one uploaded blob of `total_bytes`.

    Args:
        what: the blob and its sender, in messages ("checkpoint of step 5 from rank 0").
        total_bytes: the size the sender declares (checked, not allocated).
        chunk_bytes: the wire chunk size.
        limit: (the largest blob accepted, the flag that sets it), or None
            where the caller checked the size itself (collectives).
        budget: the job's share of the byte budget, where the bytes held are
            counted and checked (None: nowhere).
        in_order: chunks must come in order (see `BlobAssembly`).
        oversize: the code of a chunk above the chunk limit.
        keep: assemble the bytes (False: check and count them only; the caller keeps
            the chunks, as `collective_fold.HeldInput` does).

    Raises:
        RejectedMessage: RESOURCE_EXHAUSTED at construction when the blob is
            larger than the limit.
    """

    def __init__(
        self,
        what: str,
        total_bytes: int,
        chunk_bytes: int,
        limit: tuple[int, str] | None,
        budget: OwnerBudget | None = None,
        *,
        in_order: bool = True,
        oversize: Code = Code.RESOURCE_EXHAUSTED,
        keep: bool = True,
    ) -> None:
        if limit is not None and total_bytes > limit[0]:
            raise RejectedMessage(
                Code.RESOURCE_EXHAUSTED,
                f"{what} declares {total_bytes} bytes; the coordinator accepts at most "
                f"{limit[0]} ({limit[1]})",
            )
        self._assembly = BlobAssembly(
            what, total_bytes, chunk_bytes, in_order=in_order, oversize=oversize, keep=keep
        )
        self._budget = budget
        self._reservation: Reservation | None = budget.reserve() if budget is not None else None

    @property
    def total_bytes(self) -> int:
        """The size the sender declared."""
        return self._assembly.total_bytes

    @property
    def received(self) -> int:
        """Bytes received so far (and held)."""
        return self._assembly.received

    @property
    def complete(self) -> bool:
        """True once every chunk arrived."""
        return self._assembly.complete

    def add(self, offset: int, payload: bytes, claimed_total: int | None = None) -> bool:
        """Store one chunk (that says the blob has `claimed_total` bytes); True once complete.

        Raises:
            RejectedMessage: INVALID_ARGUMENT for a chunk claiming another size, a
                misaligned, mis-sized, repeated or (in order) out-of-order chunk;
                RESOURCE_EXHAUSTED when the byte budget is full.
        """
        assembly = self._assembly
        try:
            assembly.check(offset, len(payload), claimed_total)
        except BadChunk as bad:
            raise RejectedMessage(bad.code, bad.message) from None
        budget = self._budget
        if budget is not None and not budget.fits(len(payload)):
            raise RejectedMessage(
                Code.RESOURCE_EXHAUSTED,
                f"{assembly.what}: no room for {len(payload)} more bytes at offset {offset}: "
                f"{budget.holding()}",
            )
        complete = assembly.add(offset, payload)
        if self._reservation is not None:
            self._reservation.hold(assembly.received)
        return complete

    def blob(self) -> bytes:
        """The assembled bytes (call once complete); the budget is given back."""
        return bytes(self.take())

    def take(self) -> bytearray:
        """The assembled bytes (call once complete), handed over without a copy: the
        assembler holds nothing more and the budget is given back."""
        data = self._assembly.blob()
        self.release()  # (drops the assembler's reference, not the bytes)
        return data

    def release(self) -> None:
        """Drop what is held and give it back to the budget (idempotent)."""
        self._assembly.release()
        if self._reservation is not None:
            self._reservation.release()


class DonorState:
    """One donor rank's state, uploaded as `CheckpointChunk(heal=True)` for other ranks.

    Args:
        donor: the rank asked for its state.
        chunk_bytes: the job's chunk size (every chunk but the last is this long).
        max_blob_bytes: the largest state accepted (`--max-checkpoint-mb`).
        budget: where the state's bytes are counted while they arrive.
    """

    def __init__(
        self, donor: int, chunk_bytes: int, max_blob_bytes: int, budget: OwnerBudget | None
    ) -> None:
        self.donor = donor
        self._chunk_bytes = chunk_bytes
        self._max_blob_bytes = max_blob_bytes
        self._budget = budget
        self._assembler: BlobAssembler | None = None

    def add(self, what: str, chunk: pb.CheckpointChunk) -> bytes | None:
        """Take one chunk (`what` names the state from its first); the whole state once complete.

        Raises:
            RejectedMessage: a malformed upload (the bytes held so far are given back).
        """
        if self._assembler is None:
            self._assembler = BlobAssembler(
                what,
                chunk.total_bytes,
                self._chunk_bytes,
                (self._max_blob_bytes, "--max-checkpoint-mb"),
                self._budget,
                oversize=Code.INVALID_ARGUMENT,  # as a checkpoint's
            )
        try:
            complete = self._assembler.add(chunk.offset, chunk.payload, chunk.total_bytes)
        except RejectedMessage:
            self.release()
            raise
        if not complete:
            return None
        blob = self._assembler.blob()  # gives its bytes back to the budget
        self._assembler = None
        return blob

    def release(self) -> None:
        """Give back the bytes held so far (idempotent)."""
        if self._assembler is not None:
            self._assembler.release()
            self._assembler = None
