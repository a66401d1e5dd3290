"""A coordinator-wide cap on buffered gradient bytes that does its own bookkeeping (pure logic).

Memory held by the coordinator grows with the number of partially reduced
chunks; this is the single place that bounds it, so a flood of uploads gets
RESOURCE_EXHAUSTED instead of growing without limit (architecture invariant 5).

Callers never add or subtract bytes by hand: each holder of memory (one
bucket's reduction of one job's open step) takes a `Reservation` and tells it
how many bytes it holds *now* (`hold`), an absolute figure rather than a
delta, so a missed or doubled adjustment cannot drift the total. `release`
returns exactly what the reservation holds and is idempotent, so every path
that frees a step (completion, abort, a broken or refused job) can release
without knowing whether another path already did.

Per-job shares: one job must not be able to hold the whole
budget and so make every other job's uploads fail. Each owner (a job id)
may hold at most `owner_limit` bytes (default: half the limit; flag
`--max-job-buffered-mb`), so whatever one job does, at least
`limit - owner_limit` bytes remain for the others. Jobs see the budget
through an `OwnerBudget` view whose `fits` checks both caps; its `used` and
`limit` report whichever cap binds, and `holding` says it in words with the
flag that sets it, so every refusal (gradients, checkpoints, healing state,
collective inputs: one budget for all of them) names the cap that bit.
"""

from __future__ import annotations

from collections.abc import Hashable


def outbox_pool_bytes(max_buffered_bytes: int, max_outbox_bytes: int) -> int:
    """What all outboxes of a server may queue together: the gradient budget's figure,
    but never less than four outboxes' caps. A pool smaller than a few outboxes would
    drop healthy readers that are a message or two behind (a small gradient budget
    once dropped a rank while rank 0's state broadcast was relayed to it)."""
    return max(max_buffered_bytes, 4 * max_outbox_bytes)


class ByteBudget:
    """Counts bytes held by reservations against a fixed limit.

    Args:
        limit: the most bytes all reservations may hold together.
        owner_limit: the most bytes the reservations of one owner may hold
            together (None: half of `limit`, at least 1 byte).

    Raises:
        ValueError: `limit` is not positive, or `owner_limit` is not in 1..limit.
    """

    def __init__(self, limit: int, owner_limit: int | None = None) -> None:
        if limit <= 0:
            raise ValueError(f"byte budget limit must be positive, got {limit}")
        if owner_limit is None:
            owner_limit = max(1, limit // 2)
        if not 1 <= owner_limit <= limit:
            raise ValueError(f"per-owner limit must be in 1..{limit}, got {owner_limit}")
        self.limit = limit
        self.owner_limit = owner_limit
        self._used = 0
        self._by_owner: dict[Hashable, int] = {}

    @property
    def used(self) -> int:
        """Bytes held by all open reservations."""
        return self._used

    def fits(self, extra: int) -> bool:
        """True if `extra` more bytes stay within the limit."""
        return self._used + extra <= self.limit

    def for_owner(self, owner: Hashable) -> OwnerBudget:
        """The view of this budget that one owner (a job) checks against."""
        return OwnerBudget(self, owner)

    def held_by(self, owner: Hashable) -> int:
        """Bytes held by the open reservations of `owner` (e.g. a job id)."""
        return self._by_owner.get(owner, 0)

    def reserve(self, owner: Hashable) -> Reservation:
        """A new, empty reservation on behalf of `owner`."""
        return Reservation(self, owner)

    def holding(self) -> str:
        """What is held against the limit and the flag that sets it, for a refusal."""
        return (
            f"the coordinator already buffers {self._used} bytes "
            f"(limit {self.limit} bytes, --max-buffered-mb)"
        )

    def _move(self, owner: Hashable, delta: int) -> None:
        self._used += delta
        total = self._by_owner.get(owner, 0) + delta
        if total:
            self._by_owner[owner] = total
        else:
            self._by_owner.pop(owner, None)


class OwnerBudget:
    """One owner's view of a `ByteBudget`: `fits` also checks the owner's share.

    It offers what the job's parts use of a budget (`fits`, `reserve`,
    `used`, `limit`), so they need not know about shares. `used` and `limit`
    report the cap with the least headroom, so a refusal names the one that bit.
    """

    def __init__(self, budget: ByteBudget, owner: Hashable) -> None:
        self.budget = budget
        self.owner = owner

    def _owner_binds(self) -> bool:
        budget = self.budget
        own_room = budget.owner_limit - budget.held_by(self.owner)
        return own_room < budget.limit - budget.used

    @property
    def used(self) -> int:
        """Bytes held under the binding cap (the owner's, or everyone's)."""
        if self._owner_binds():
            return self.budget.held_by(self.owner)
        return self.budget.used

    @property
    def limit(self) -> int:
        """The binding cap (the owner's share, or the whole budget)."""
        return self.budget.owner_limit if self._owner_binds() else self.budget.limit

    def fits(self, extra: int) -> bool:
        """True if the owner may take `extra` more bytes."""
        budget = self.budget
        return budget.fits(extra) and budget.held_by(self.owner) + extra <= budget.owner_limit

    def holding(self) -> str:
        """What is held against the binding cap and the flag that sets it, for a refusal."""
        budget = self.budget
        if not self._owner_binds():
            return budget.holding()
        return (
            f"job '{self.owner}' already buffers {budget.held_by(self.owner)} bytes, its "
            f"share of the coordinator's (limit {budget.owner_limit} bytes, --max-job-buffered-mb)"
        )

    def reserve(self, owner: Hashable | None = None) -> Reservation:
        """A new, empty reservation of this view's owner (`owner` must be it, if given)."""
        if owner is not None and owner != self.owner:
            raise ValueError(f"budget view of {self.owner!r} asked to reserve for {owner!r}")
        return self.budget.reserve(self.owner)


class Reservation:
    """The bytes one holder keeps against a `ByteBudget` (see the module docstring).

    The limit is checked by the caller with `ByteBudget.fits` before it takes
    memory, because what it does when over budget (refuse a chunk, with a
    message naming the rank and bucket) is its own business.
    """

    def __init__(self, budget: ByteBudget, owner: Hashable) -> None:
        self._budget = budget
        self.owner = owner
        self._held = 0
        self._released = False

    @property
    def held(self) -> int:
        """Bytes this reservation holds now."""
        return self._held

    def hold(self, nbytes: int) -> None:
        """Record that the holder now keeps `nbytes` (not a delta).

        Raises:
            ValueError: `nbytes` is negative.
            RuntimeError: the reservation was released (a use-after-free bug).
        """
        if nbytes < 0:
            raise ValueError(f"a reservation cannot hold {nbytes} bytes")
        if self._released:
            raise RuntimeError(f"reservation of {self.owner!r} used after release")
        self._budget._move(self.owner, nbytes - self._held)
        self._held = nbytes

    def release(self) -> None:
        """Give back everything held; later calls do nothing."""
        if self._released:
            return
        self._budget._move(self.owner, -self._held)
        self._held = 0
        self._released = True
