"""Rank 0's initial state broadcast: which chunks arrived, and whether it is complete.

After Welcome, rank 0 uploads its parameters and buffers and the coordinator
relays them so that every rank starts equal (architecture invariant 2). Until
that broadcast is complete the others cannot train, so a rank lost during it
must fail the others at once instead of leaving them to their join timeout;
the job asks `complete` to decide. Pure logic, no gRPC, no asyncio.
"""

from __future__ import annotations

from gradsync_proto import chunking
from gradsync_proto.codes import Code
from gradsync_proto.v1 import gradsync_pb2 as pb

from gradsync_server.dataplane.chunk_checks import check_chunk


class StateBroadcast:
    """Chunks of the state blob seen so far.

    Args:
        chunk_bytes: chunk size every rank must use.
    """

    def __init__(self, chunk_bytes: int) -> None:
        self._chunk_bytes = chunk_bytes
        self.state_bytes = 0
        self._offsets_seen: set[int] = set()
        #: Nothing more is to be relayed (empty state, resumed job, or every chunk seen).
        self.complete = False

    def start(self, state_bytes: int, needed: bool) -> None:
        """The job is assembled: expect `state_bytes` from rank 0 if the broadcast is `needed`."""
        self.state_bytes = state_bytes
        self.complete = not needed or state_bytes == 0

    def problem(self, rank: int, chunk: pb.StateChunk) -> tuple[Code, str] | None:
        """Why `rank`'s state chunk cannot be relayed, or None."""
        if rank != 0:
            return (Code.INVALID_ARGUMENT, f"rank {rank} sent state; only rank 0 broadcasts")
        problem = check_chunk(
            "state",
            chunk.offset,
            len(chunk.payload),
            self.state_bytes,
            "the state blob",
            self._chunk_bytes,
            rank=0,
        )
        if problem is None and chunk.offset in self._offsets_seen:
            problem = (
                Code.INVALID_ARGUMENT,
                f"rank 0 sent the state chunk at offset {chunk.offset} twice",
            )
        return problem

    def record(self, offset: int) -> None:
        """A valid chunk at `offset` was relayed."""
        self._offsets_seen.add(offset)
        if len(self._offsets_seen) == chunking.num_chunks(self.state_bytes, self._chunk_bytes):
            self.complete = True
