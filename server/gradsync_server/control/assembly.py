"""A job that assembles: who has joined, who is missing, and how long they have waited.

Ranks of a multi-host job rarely start together (a person typing on three
hosts, a scheduler placing pods one by one), so the first ranks may wait
minutes for the last. Waiting ranks are alive (they send heartbeats) and
must not be mistaken for dead ones; what they and the operator need is to
hear who is still missing. This module builds the `AssemblyProgress` the job
sends when a rank joins, leaves or is refused and every ~10 s, and the line
the coordinator logs at the same period. Pure logic, time from an injected
clock; no gRPC, no asyncio.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

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
