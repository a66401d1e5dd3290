"""A local leader's bookkeeping: which bucket of which step waits for whom (pure logic).

The leader's I/O thread (`gradsync.local.local_group`) turns messages into calls
here and does what they answer: send REDUCE, sum a share, hand a bucket off.
Nothing here blocks, sends or sums, so the rules can be read, and tested, on
their own. The caller holds the group's lock around every call.

The rules:
- a bucket is reduced once every live member posted it; a member excluded
  since (dropped by the coordinator) no longer counts, a bucket it had
  posted keeps its gradient;
- no REDUCE of a later step goes out while a member may still be copying the
  previous averages out of the shared result region (it is deferred until
  every COPIED);
- the leader sums its own share and the shares of members that are gone;
- a bucket is handed off (uploaded) when every share is summed.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

Key = tuple[int, int]  # (step, bucket)


@dataclass
class Pending:
    """One bucket of one step between its first POSTED and its hand-off."""

    dtype: int
    posted: set[int] = field(default_factory=set)
    #: The slots whose gradients the sum holds (set when the REDUCE goes out).
    covered: tuple[int, ...] = ()
    summed: set[int] = field(default_factory=set)
    reducing: bool = False
    #: Slots whose gradient held NaN/Inf, as the shares' summers found (`sum_share`).
    nonfinite: set[int] = field(default_factory=set)


class LeaderSchedule:
    """The leader's view of its group's buckets (see the module docstring).

    Args:
        members: the group's size (slots 0..members-1; slot 0 is the leader).
    """

    def __init__(self, members: int) -> None:
        self.members = members
        self._pending: dict[Key, Pending] = {}
        self._handed: dict[int, set[int]] = {}
        self._newest_step = -1
        self._awaiting_copied: set[int] = set()
        self._deferred: list[Key] = []

    def post(self, slot: int, step: int, bucket: int, dtype: int) -> bool:
        """`slot` posted `bucket` of `step`. False: a step the others already left (aborted)."""
        if step < self._newest_step:
            return False
        if step > self._newest_step:
            self._newest_step = step
            for key in [k for k in self._pending if k[0] < step]:
                del self._pending[key]
            for old in [s for s in self._handed if s < step]:
                del self._handed[old]
            self._deferred = [k for k in self._deferred if k[0] >= step]
        self._pending.setdefault((step, bucket), Pending(dtype)).posted.add(slot)
        return True

    def start(self, step: int, bucket: int, excluded: set[int], gone: set[int]) -> Pending | None:
        """The bucket to reduce now, with the shares the leader sums marked summed, or None
        (not every live member posted it, it is reducing already, or it is deferred).

        Args:
            excluded: slots the coordinator dropped (no longer waited for).
            gone: slots lost or excluded: the leader sums their shares.
        """
        pending = self._pending.get((step, bucket))
        if pending is None or pending.reducing:
            return None
        live = {s for s in range(self.members) if s not in excluded}
        if not live <= pending.posted:
            return None
        if self._awaiting_copied:  # a follower still reads the result region
            self._deferred.append((step, bucket))
            return None
        pending.reducing = True
        pending.covered = tuple(sorted(pending.posted))
        pending.summed.update({0} | gone)
        return pending

    def summed(self, step: int, bucket: int, slot: int, culprits: Iterable[int]) -> None:
        """`slot` summed its share of the bucket; `culprits` held NaN/Inf in it."""
        pending = self._pending.get((step, bucket))
        if pending is not None:
            pending.summed.add(slot)
            pending.nonfinite.update(culprits)

    def owed_by(self, slot: int) -> list[tuple[Key, Pending]]:
        """The buckets `slot` was told to sum and did not (it is gone): now the leader's."""
        owed = [(k, p) for k, p in self._pending.items() if p.reducing and slot not in p.summed]
        for _, pending in owed:
            pending.summed.add(slot)
        return owed

    def finish(self, step: int, bucket: int) -> Pending | None:
        """The bucket, taken out, once every share is summed; else None."""
        pending = self._pending.get((step, bucket))
        if pending is None or len(pending.summed) < self.members:
            return None
        del self._pending[(step, bucket)]
        return pending

    def handed_off(self, step: int, bucket: int) -> None:
        """The bucket's sum went to the coordinator."""
        self._handed.setdefault(step, set()).add(bucket)

    def handed(self, step: int) -> int:
        """How many buckets of `step` were handed off."""
        return len(self._handed.get(step, ()))

    def unposted(self, step: int, num_buckets: int) -> list[tuple[int, list[int]]]:
        """(bucket, slots that have not posted it) of every bucket of `step` not handed off."""
        handed = self._handed.get(step, set())
        missing = []
        for bucket in range(num_buckets):
            if bucket in handed:
                continue
            pending = self._pending.get((step, bucket))
            posted = pending.posted if pending is not None else set()
            missing.append((bucket, [s for s in range(self.members) if s not in posted]))
        return missing

    def published(self, step: int, readers: Iterable[int]) -> None:
        """The averages of `step` are in the result region; `readers` will copy them out."""
        self._awaiting_copied = set(readers)
        self._handed.pop(step, None)

    def copied(self, slot: int) -> None:
        """`slot` copied the averages out (or will never: it is gone)."""
        self._awaiting_copied.discard(slot)

    def take_deferred(self) -> list[Key]:
        """The buckets deferred while a member read the result region, once none does."""
        if self._awaiting_copied or not self._deferred:
            return []
        deferred, self._deferred = self._deferred, []
        return deferred

    def keys(self) -> list[Key]:
        """Every bucket in progress (to re-plan after an exclusion)."""
        return list(self._pending)
