"""Late DiLoCo contributions: uploads for a round that closed without them (pure logic).

A rank excused from round s (`gradsync_server.dataplane.rounds`) still
uploads its pseudo-gradient for s: it did not know the round closed. Each of
its chunks is answered at once with the current global parameters and the
step to continue at (`GradientChunk.next_step`), so the rank ends up holding
the global model and joins the open round; the coordinator never waits for it.

What happens to the pseudo-gradient is the job's policy:

- **drop** (the default): it is discarded. Nothing is held, the round
  averages are exactly those of the ranks that made it in time, and a slow
  rank costs the others nothing but its missing samples. The default because
  it keeps every round's average a function of that round's global parameters
  alone (as plain DiLoCo), and needs no staleness tuning.
- **merge** with `max_staleness = s`: the complete contribution is kept (one
  per rank at most, its bytes held in the coordinator's byte budget) and
  added into the next round that *starts* after it is complete, as one more
  contribution summed after the live ranks (in rank order: bitwise
  independent of arrival order), if that round is at most s rounds after the
  one it was made for; otherwise it is dropped. Its staleness is reported in
  the answers (`GradientChunk.merged_late`, `staleness`).

Only the chunks of outer buckets (the parameters) are kept; the rest of a
late upload (the presence vector) is echoed back to its rank.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from gradsync_server.dataplane.aggregation import Magnitude
from gradsync_server.dataplane.budget import Reservation
from gradsync_server.dataplane.grace import GraceWindow
from gradsync_server.dataplane.rounds import RoundPolicy

__all__ = ["LATE_RANK_BASE", "LateContribution", "Stragglers"]

#: A merged late contribution of rank r is summed as "rank" LATE_RANK_BASE + r: after
#: every live rank, in rank order among the late ones (real ranks are far below).
LATE_RANK_BASE = 1 << 31


@dataclass
class LateContribution:
    """One rank's upload for a round that closed without it."""

    rank: int
    #: The round (step) it was made for.
    step: int
    #: Its weight in a weighted average (set by its first outer chunk; 1 unweighted).
    weight: float = 0.0
    #: Chunks each bucket has (known from the bucket's first chunk).
    chunks_needed: dict[int, int] = field(default_factory=dict)
    #: Offsets of the chunks each bucket delivered.
    seen: dict[int, set[int]] = field(default_factory=dict)
    #: Kept outer chunks: (bucket, offset) -> (wire dtype, payload, magnitude).
    kept: dict[tuple[int, int], tuple[int, bytes, Magnitude]] = field(default_factory=dict)
    reservation: Reservation | None = None

    def complete(self, bucket_count: int) -> bool:
        """True once every bucket delivered every chunk."""
        return len(self.chunks_needed) == bucket_count and all(
            len(self.seen.get(b, ())) >= n for b, n in self.chunks_needed.items()
        )

    def held_bytes(self) -> int:
        return sum(len(payload) for _, payload, _ in self.kept.values())

    def release(self) -> None:
        if self.reservation is not None:
            self.reservation.release()
        self.kept.clear()


class Stragglers:
    """The straggler state of one job's open step and of its late ranks.

    Args:
        policy: the job's round policy.
    """

    def __init__(self, policy: RoundPolicy | None = None) -> None:
        self.policy = policy or RoundPolicy()
        #: The adaptive deadline (`round_deadline_auto`), None with a fixed one.
        self.window = GraceWindow() if self.policy.auto else None
        #: Ranks excused from the open round (it closed, or is closing, without them).
        self.excused: set[int] = set()
        #: The weight each rank claimed in the open round, and where first.
        self.weights: dict[int, tuple[float, str]] = {}
        #: Late contributions merged into the open round (chosen when it began).
        self.merging: list[LateContribution] = []
        #: True once the open round received its first chunk.
        self.begun = False
        #: Rank -> the round its late upload is for (owed, not complete yet).
        self._owed: dict[int, int] = {}
        #: Late uploads in progress or complete and waiting for a round, by rank.
        self._late: dict[int, LateContribution] = {}
        #: Late contributions dropped (too stale, or the policy drops them).
        self.dropped = 0

    def owes(self, rank: int, step: int) -> bool:
        """True if a chunk of `rank` for `step` is a late one."""
        return self._owed.get(rank) == step

    def excuse(self, rank: int, step: int) -> None:
        """`rank` is excused from round `step`: its upload for it will be late.

        A rank that still owes an older round keeps owing that one (it uploads
        it first, and is then told to continue at the open round).
        """
        self.excused.add(rank)
        self._owed.setdefault(rank, step)

    def late_upload(self, rank: int, step: int) -> LateContribution:
        """The late contribution `rank` is uploading for `step` (started on its first chunk)."""
        late = self._late.get(rank)
        if late is None or late.step != step:
            if late is not None:
                late.release()  # one per rank: an older one it never completed is gone
            late = self._late[rank] = LateContribution(rank, step)
        return late

    def finish_upload(self, rank: int) -> None:
        """`rank`'s late upload is complete: it owes nothing; drop it unless merging."""
        self._owed.pop(rank, None)
        if not self.policy.merge_late:
            late = self._late.pop(rank, None)
            if late is not None:
                late.release()
            self.dropped += 1

    def begin(self, step: int, members: Mapping[int, object], bucket_count: int) -> None:
        """The open round `step` received its first chunk: choose what it merges.

        Complete late contributions at most `max_staleness` rounds old are
        merged (taken out of the store); older ones are dropped. Ranks no
        longer members are forgotten.
        """
        self.begun = True
        for rank in [r for r in self._owed if r not in members]:
            del self._owed[rank]
        for rank, late in list(self._late.items()):
            if rank not in members:
                late.release()
                del self._late[rank]
            elif rank not in self._owed and late.complete(bucket_count):
                del self._late[rank]
                if step - late.step <= self.policy.max_staleness:
                    self.merging.append(late)
                else:
                    late.release()
                    self.dropped += 1
        self.merging.sort(key=lambda late: late.rank)

    def end_round(self) -> None:
        """The open round completed or was abandoned: forget its state."""
        for late in self.merging:
            late.release()  # its bytes went into the round's reductions (or nowhere)
        self.merging.clear()
        self.excused.clear()
        self.weights.clear()
        self.begun = False

    def release(self) -> None:
        """Free every late contribution held (the job ended)."""
        self.end_round()
        for late in self._late.values():
            late.release()
        self._late.clear()
        self._owed.clear()

    def held_bytes(self) -> int:
        """Bytes of late contributions waiting for a round."""
        return sum(late.held_bytes() for late in self._late.values())
