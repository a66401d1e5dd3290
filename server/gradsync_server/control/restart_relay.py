"""A donor rank's state on its way to the ranks behind it, at a restarted job's start.

When a restarted coordinator continues from the ranks' own state
(`control.restart`), the ranks that are behind (or have no state at all) need
the state of a rank that is ahead. That rank (the donor) is welcomed first and
uploads its state as `CheckpointChunk(heal=True)` at the step the job goes on
from; the job holds the others' Welcome until the state is complete, then
sends it to the ranks behind as resume chunks, like a checkpoint. The bytes
are counted in the job's budget as they arrive (a declared size is a claim).
Pure logic, no I/O.
"""

from __future__ import annotations

from gradsync_proto.codes import Code
from gradsync_proto.v1 import gradsync_pb2 as pb

from gradsync_server.control.restart import Continue
from gradsync_server.dataplane.budget import OwnerBudget
from gradsync_server.dataplane.uploads import BlobAssembler
from gradsync_server.errors import RejectedMessage


class RestartRelay:
    """Collects the donor's state for `plan.behind` (one per restarted job, while it lasts).

    Args:
        plan: the restarted job's decision (donor, step, ranks behind).
        chunk_bytes: the job's chunk size (every chunk but the last is this long).
        max_blob_bytes: the largest state accepted (`--max-checkpoint-mb`).
        budget: where the state's bytes are counted while they arrive.
    """

    def __init__(
        self, plan: Continue, chunk_bytes: int, max_blob_bytes: int, budget: OwnerBudget
    ) -> None:
        self.plan = plan
        self._chunk_bytes = chunk_bytes
        self._max_blob_bytes = max_blob_bytes
        self._budget = budget
        self._assembler: BlobAssembler | None = None

    def add(self, rank: int, chunk: pb.CheckpointChunk) -> bytes | None:
        """Take one chunk of the donor's state; return the whole state once complete.

        Raises:
            RejectedMessage: not the donor, not the step the job goes on from, or a
                malformed upload (the bytes held so far are given back).
        """
        plan = self.plan
        if rank != plan.donor:
            raise RejectedMessage(
                Code.FAILED_PRECONDITION,
                f"rank {rank} sent state for step {chunk.step}; only rank {plan.donor} was "
                f"asked for its state (for rank(s) {list(plan.behind)})",
            )
        if chunk.step != plan.step:
            self.release()
            raise RejectedMessage(
                Code.INVALID_ARGUMENT,
                f"rank {rank} sent its state of step {chunk.step}, but it claimed step "
                f"{plan.step} when it rejoined; the ranks behind need that step's state",
            )
        if self._assembler is None:
            self._assembler = BlobAssembler(
                f"rank {rank}'s state of step {plan.step} for rank(s) {list(plan.behind)}",
                chunk.total_bytes,
                self._chunk_bytes,
                (self._max_blob_bytes, "--max-checkpoint-mb"),
                self._budget,
                oversize=Code.INVALID_ARGUMENT,
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
