"""A coordinator-wide cap on buffered gradient bytes (pure logic)."""

from __future__ import annotations


class ByteBudget:
    """Counts bytes held by in-flight reductions against a fixed limit.

    Memory held by the coordinator grows with the number of partially reduced
    chunks; this is the single place that bounds it, so a flood of uploads
    gets RESOURCE_EXHAUSTED instead of growing without limit.
    """

    def __init__(self, limit: int) -> None:
        if limit <= 0:
            raise ValueError(f"byte budget limit must be positive, got {limit}")
        self.limit = limit
        self.used = 0

    def fits(self, extra: int) -> bool:
        """True if `extra` more bytes stay within the limit."""
        return self.used + extra <= self.limit

    def adjust(self, delta: int) -> None:
        """Record `delta` bytes allocated (positive) or freed (negative)."""
        self.used = max(0, self.used + delta)
