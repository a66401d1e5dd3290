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
"""

from __future__ import annotations

from collections.abc import Hashable


class ByteBudget:
    """Counts bytes held by reservations against a fixed limit.

    Args:
        limit: the most bytes all reservations may hold together.

    Raises:
        ValueError: `limit` is not positive.
    """

    def __init__(self, limit: int) -> None:
        if limit <= 0:
            raise ValueError(f"byte budget limit must be positive, got {limit}")
        self.limit = limit
        self._used = 0
        self._by_owner: dict[Hashable, int] = {}

    @property
    def used(self) -> int:
        """Bytes held by all open reservations."""
        return self._used

    def fits(self, extra: int) -> bool:
        """True if `extra` more bytes stay within the limit."""
        return self._used + extra <= self.limit

    def held_by(self, owner: Hashable) -> int:
        """Bytes held by the open reservations of `owner` (e.g. a job id)."""
        return self._by_owner.get(owner, 0)

    def reserve(self, owner: Hashable) -> Reservation:
        """A new, empty reservation on behalf of `owner`."""
        return Reservation(self, owner)

    def _move(self, owner: Hashable, delta: int) -> None:
        self._used += delta
        total = self._by_owner.get(owner, 0) + delta
        if total:
            self._by_owner[owner] = total
        else:
            self._by_owner.pop(owner, None)


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
