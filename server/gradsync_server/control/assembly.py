"""A job that assembles: who has joined, who is missing, and how long they have waited.

Ranks of a multi-host job rarely start together (a person typing on three
hosts, a scheduler placing pods one by one), so the first ranks may wait
minutes for the last. Waiting ranks are alive (they send heartbeats) and
must not be mistaken for dead ones; what they and the operator need is to
hear who is still missing. This module builds the `AssemblyProgress` the job
sends when a rank joins, leaves or is refused and every ~10 s, and the line
the coordinator logs at the same period; then follows rank 0's state
broadcast, the last step before the first (`StateBroadcast`). Pure logic,
time from an injected clock; no gRPC, no asyncio.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from gradsync_proto.blobs import BadChunk, BlobAssembly
from gradsync_proto.codes import Code
from gradsync_proto.v1 import gradsync_pb2 as pb

from gradsync_server import defaults


class Assembly:
    """Progress reports of one assembling job.

    Args:
        job_id: the job's name (for the log line).
        world_size: ranks the job needs.
        clock: monotonic time source (injectable for tests).
        heartbeat_interval_s: how often waiting ranks must send a heartbeat (advertised).
        report_period_s: how often waiting ranks and the log hear who is missing.
    """

    def __init__(
        self,
        job_id: str,
        world_size: int,
        clock: Callable[[], float],
        heartbeat_interval_s: float,
        report_period_s: float = defaults.ASSEMBLY_REPORT_PERIOD_S,
    ) -> None:
        self._job_id = job_id
        self._world_size = world_size
        self._clock = clock
        self._heartbeat_interval_s = heartbeat_interval_s
        self._report_period_s = report_period_s
        #: When the first rank of the current wait joined (None while nobody waits).
        self.started_at: float | None = None
        self._next_report = 0.0

    def waited_s(self) -> float:
        """Seconds since the first waiting rank joined (0 while nobody waits)."""
        return 0.0 if self.started_at is None else self._clock() - self.started_at

    def missing(self, joined: Sequence[int]) -> list[int]:
        """Ranks of the world that have not joined, ascending."""
        present = set(joined)
        return [rank for rank in range(self._world_size) if rank not in present]

    def progress(self, joined: Sequence[int], refused: str = "") -> pb.CoordinatorMessage:
        """The AssemblyProgress for the waiting ranks `joined` (starting the clock if needed).

        Every message sent also restarts the period of `report_due`.
        """
        now = self._clock()
        if self.started_at is None and joined:
            self.started_at = now
        if not joined:
            self.started_at = None
        self._next_report = now + self._report_period_s
        return pb.CoordinatorMessage(
            assembly=pb.AssemblyProgress(
                joined_ranks=sorted(joined),
                missing_ranks=self.missing(joined),
                waited_s=self.waited_s(),
                heartbeat_interval_s=self._heartbeat_interval_s,
                refused=refused,
            )
        )

    def report_due(self) -> bool:
        """True when the waiting ranks have not heard from the coordinator for a period."""
        return self.started_at is not None and self._clock() >= self._next_report

    def describe(self, joined: Sequence[int]) -> str:
        """ "job 'J': waiting for ranks [2] of 3 (20 s)", for the log."""
        return (
            f"job '{self._job_id}': waiting for ranks {self.missing(joined)} of "
            f"{self._world_size} ({self.waited_s():.0f} s); joined {sorted(joined)}"
        )


class StateBroadcast:
    """Rank 0's initial state broadcast, once the job is assembled: which chunks arrived.

    After Welcome, rank 0 uploads its parameters and buffers and the coordinator
    relays them so that every rank starts equal (architecture invariant 2). Until
    that broadcast is complete the others cannot train, so a rank lost during it
    must fail the others at once instead of leaving them to their join timeout;
    the job asks `complete` to decide. Each chunk is checked by the shared
    `gradsync_proto.blobs.BlobAssembly` before it is relayed, which only counts
    it: the coordinator forwards the bytes as they come and keeps none.

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
