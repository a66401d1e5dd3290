"""A failed shard data stream, held back while the leader decides (pure logic).

With a sharded coordinator, the leader is the one authority on shard loss: it
ends every rank's Sync stream with END_REASON_SHARD_LOST, so that every rank
sees the same error. A worker whose own data stream to a shard fails must
therefore not act alone: raising at once would close this rank's leader
stream first, and its peers would see a lost peer instead of a lost shard.
`ShardFault` keeps the first such failure and says when the grace (3
heartbeat intervals plus a margin, measured from the failure) is over; only
then do waits raise the shard's `ShardUnavailableError` themselves, naming
the shard and its address. `gradsync.control.inbox` holds one under its lock.
"""

from __future__ import annotations

from gradsync import defaults
from gradsync.errors import ShardUnavailableError

#: A failed shard stream is raised this long (plus 3 heartbeat intervals) after
#: the failure if the leader has not ended the job by then.
SHARD_GRACE_MARGIN_S = 5.0


def shard_grace_s(heartbeat_interval_s: float | None, margin_s: float) -> float:
    """How long waits keep waiting for the leader after a shard stream failed."""
    return 3 * (heartbeat_interval_s or defaults.HEARTBEAT_INTERVAL_S) + margin_s


class ShardFault:
    """The first failed shard stream of a link, and its grace (no lock: the caller's)."""

    def __init__(self) -> None:
        self.error: ShardUnavailableError | None = None
        self.deadline = 0.0

    def record(self, error: ShardUnavailableError, now: float, grace_s: float) -> bool:
        """Keep `error` if it is the first; return whether it was."""
        if self.error is not None:
            return False
        self.error, self.deadline = error, now + grace_s
        return True

    def due(self, now: float) -> ShardUnavailableError | None:
        """The error to raise now (the grace is over), or None."""
        if self.error is not None and now >= self.deadline:
            return self.error
        return None

    def bound(self, now: float, remaining_s: float) -> float:
        """How long a wait may sleep: until its own deadline or the grace's end."""
        if self.error is None:
            return remaining_s
        return max(0.0, min(remaining_s, self.deadline - now))

    def pending_note(self) -> str:
        """A note for a timeout's message while a failure waits for the leader ("" if none)."""
        if self.error is None:
            return ""
        return f" (a shard failed and the leader has not said why yet: {self.error})"
