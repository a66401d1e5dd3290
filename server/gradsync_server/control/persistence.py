"""A job's checkpoint bookkeeping: the upload in progress, the resume point, the last durable step.

Architecture invariant 7 (durability) spans two worlds: collecting rank 0's
checkpoint upload chunk by chunk and deciding when it is complete is protocol
logic, while writing it to a store is blocking I/O. This module is the first
half, pure and testable without a store: it turns a complete upload into a
`Persist` action (carried out by `gradsync_server.rpc.checkpointer`) and
remembers the checkpoint a job resumes from. No gRPC, no asyncio, no store calls.
"""

from __future__ import annotations

from gradsync_proto.codes import Code
from gradsync_proto.v1 import gradsync_pb2 as pb

from gradsync_server.dataplane.actions import Persist
from gradsync_server.dataplane.budget import OwnerBudget
from gradsync_server.dataplane.uploads import BlobAssembler
from gradsync_server.errors import RejectedMessage
from gradsync_server.store.checkpoint import Checkpoint, PruneGuard


class Persistence:
    """Checkpoint state of one job.

    Args:
        chunk_bytes: chunk size every rank must use.
        limit_bytes: the largest checkpoint accepted (`--max-checkpoint-mb`).
        budget: where an upload's bytes are counted while it arrives (None: nowhere).
    """

    def __init__(
        self, chunk_bytes: int, limit_bytes: int, budget: OwnerBudget | None = None
    ) -> None:
        self._chunk_bytes = chunk_bytes
        self._limit_bytes = limit_bytes
        self._budget = budget
        self._resume: Checkpoint | None = None
        #: Step of the newest checkpoint acknowledged as durable (-1: none).
        self.last_checkpoint_step = -1
        #: Steps this job asked the store to save (what its pruning may delete).
        self._written: set[int] = set()
        self._upload: tuple[int, BlobAssembler] | None = None

    @property
    def resume(self) -> Checkpoint | None:
        """The checkpoint this job resumes from (None: it starts from rank 0's state)."""
        return self._resume

    def resume_from(self, checkpoint: Checkpoint | None) -> None:
        """Resume from `checkpoint` (loaded from the store before the job assembles)."""
        self._resume = checkpoint

    def on_upload_chunk(self, chunk: pb.CheckpointChunk) -> Persist | None:
        """Collect one chunk of rank 0's upload; return the Persist once it is complete.

        Raises:
            RejectedMessage: the upload is malformed (rank 0's stream ends).
        """
        if chunk.total_bytes == 0:
            raise RejectedMessage(Code.INVALID_ARGUMENT, "rank 0 sent an empty checkpoint")
        if self._upload is None or self._upload[0] != chunk.step:
            self.abandon_upload()  # an unfinished older upload gives its bytes back
            what = f"checkpoint of step {chunk.step} from rank 0"
            assembler = BlobAssembler(
                what,
                chunk.total_bytes,
                self._chunk_bytes,
                (self._limit_bytes, "--max-checkpoint-mb"),
                self._budget,
                oversize=Code.INVALID_ARGUMENT,  # a checkpoint's oversized chunk is mis-sized
            )
            self._upload = (chunk.step, assembler)
        step, assembler = self._upload
        try:
            complete = assembler.add(chunk.offset, chunk.payload, chunk.total_bytes)
        except RejectedMessage:
            self.abandon_upload()
            raise
        if not complete:
            return None
        self._upload = None
        return Persist(step, assembler.blob())

    def abandon_upload(self) -> None:
        """Drop an unfinished upload and give its bytes back (idempotent)."""
        if self._upload is not None:
            self._upload[1].release()
            self._upload = None

    def prune_guard(self) -> PruneGuard:
        """What this job's saves may prune: never a newer checkpoint it did not write."""
        resumed_from = self.resume.step if self.resume is not None else -1
        return PruneGuard(resumed_from, frozenset(self._written))

    def wrote(self, step: int) -> None:
        """This job asked the store to save the checkpoint of `step` (its pruning may delete it)."""
        self._written.add(step)

    def saved(self, step: int) -> None:
        """The checkpoint of `step` is durable."""
        self.last_checkpoint_step = max(self.last_checkpoint_step, step)
