"""Rank 0's initial state broadcast: which chunks arrived, and whether it is complete.

After Welcome, rank 0 uploads its parameters and buffers and the coordinator
relays them so that every rank starts equal (architecture invariant 2). Until
that broadcast is complete the others cannot train, so a rank lost during it
must fail the others at once instead of leaving them to their join timeout;
the job asks `complete` to decide. Each chunk is checked by the shared
`gradsync_proto.blobs.BlobAssembly` before it is relayed, which only counts
it: the coordinator forwards the bytes as they come and keeps none. Pure
logic, no gRPC, no asyncio.
"""

from __future__ import annotations

from gradsync_proto.blobs import BadChunk, BlobAssembly
from gradsync_proto.codes import Code
from gradsync_proto.v1 import gradsync_pb2 as pb


class StateBroadcast:
    """Chunks of the state blob seen so far.

    Args:
        chunk_bytes: chunk size every rank must use.
    """

    def __init__(self, chunk_bytes: int) -> None:
        self._chunk_bytes = chunk_bytes
        self.state_bytes = 0
        self._assembly = self._expect(0)
        #: Nothing more is to be relayed (empty state, resumed job, or every chunk seen).
        self.complete = False

    def _expect(self, state_bytes: int) -> BlobAssembly:
        """Checks (and counts, keeping nothing) the chunks of a `state_bytes` state blob."""
        return BlobAssembly(
            "rank 0's state",
            state_bytes,
            self._chunk_bytes,
            in_order=False,
            keep=False,
            empty_chunk=False,  # an empty state is no chunk at all
        )

    def start(self, state_bytes: int, needed: bool) -> None:
        """The job is assembled: expect `state_bytes` from rank 0 if the broadcast is `needed`."""
        self.state_bytes = state_bytes
        self._assembly = self._expect(state_bytes)
        self.complete = not needed or self._assembly.complete

    def accept(self, rank: int, chunk: pb.StateChunk) -> tuple[Code, str] | None:
        """Why `rank`'s state chunk cannot be relayed, or None once it is counted."""
        if rank != 0:
            return (Code.INVALID_ARGUMENT, f"rank {rank} sent state; only rank 0 broadcasts")
        try:
            if self._assembly.add(chunk.offset, chunk.payload):
                self.complete = True
        except BadChunk as bad:
            return (bad.code, bad.message)
        return None
