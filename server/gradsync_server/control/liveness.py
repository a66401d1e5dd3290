"""When each rank of a job was last heard from (pure logic, time from an injected clock).

Architecture invariant 6 (no silent hang) needs the coordinator to notice a
rank that stopped talking: every message counts as a sign of life, and a
rank silent for longer than the heartbeat timeout is declared dead by the
watchdog (`gradsync_server.rpc.watchdog`). A rank whose worker beats
on its side channel (`gradsync_server.rpc.leader_role.serve_beat`: authenticated, with a
sequence above the last one accepted) is judged by those beats alone from
the first one on: they travel on a connection without bulk data, where
neither a full send queue delays them nor a frozen process's queued bytes
stand in for them. This module only keeps the record, so
the rule can be tested with a fake clock and no sockets; deciding what to do
with a silent rank belongs to the job and the servicer.
"""

from __future__ import annotations

from collections.abc import Callable


class Liveness:
    """Last sign of life and last reported step of each rank.

    Args:
        clock: monotonic time source (injectable for tests).
    """

    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self._last_seen: dict[int, float] = {}
        self._reported_step: dict[int, int] = {}
        #: The highest side-channel beat sequence accepted from each rank's session.
        self._beat_sequence: dict[int, int] = {}

    def start(self, rank: int) -> None:
        """Begin tracking `rank` as seen now (it just joined)."""
        self._last_seen[rank] = self._clock()
        self._reported_step[rank] = 0
        self._beat_sequence[rank] = 0

    def last_beat_sequence(self, rank: int) -> int | None:
        """The highest beat sequence accepted from tracked `rank` (0: none yet); None: untracked."""
        return self._beat_sequence.get(rank) if rank in self._last_seen else None

    def beat(self, rank: int, sequence: int, step: int) -> None:
        """A side-channel beat (already authenticated) with a sequence above the last."""
        if rank in self._last_seen:
            self._beat_sequence[rank] = sequence
            self._last_seen[rank] = self._clock()
            self._reported_step[rank] = step

    def touch(self, rank: int, reported_step: int | None = None) -> None:
        """Record a sign of life from a tracked `rank` on its Sync stream.

        Untracked ranks are ignored, and so are ranks that beat on the side
        channel (`beat`): once one beat was accepted, only beats count, because a
        frozen worker's kernel keeps delivering what its send queue holds for
        seconds after the process stopped.
        """
        if rank not in self._last_seen or self._beat_sequence.get(rank, 0) > 0:
            return
        self._last_seen[rank] = self._clock()
        if reported_step is not None:
            self._reported_step[rank] = reported_step

    def forget(self, rank: int) -> None:
        """Stop tracking `rank` (it left or was lost)."""
        self._last_seen.pop(rank, None)
        self._reported_step.pop(rank, None)
        self._beat_sequence.pop(rank, None)

    def silent_ranks(self, ranks: list[int] | tuple[int, ...], timeout_s: float) -> list[int]:
        """Those of `ranks` not heard from for longer than `timeout_s`, ascending."""
        now = self._clock()
        return [
            rank
            for rank in sorted(ranks)
            if rank in self._last_seen and now - self._last_seen[rank] > timeout_s
        ]

    def seconds_since_seen(self, rank: int) -> float:
        """Seconds since `rank`'s last sign of life (0 for an untracked rank)."""
        seen = self._last_seen.get(rank)
        return 0.0 if seen is None else self._clock() - seen

    def reported_step(self, rank: int) -> int:
        """The step `rank` last reported in a heartbeat (0 before any)."""
        return self._reported_step.get(rank, 0)
