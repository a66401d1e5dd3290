"""One rank's part of its host group's shared segment: a block per op in flight.

A host group (`gradsync.distributed.host_group`) hands its all-reduces over
in one shared segment. Each rank owns one arena of it (the same size for
every rank, one after another): a member places each input it posts in a
block of its own arena, the leader each result it hands out in a block of
its own. A block lives while its op does (a member's input until its result
is copied out, a leader's result until every member has copied it), so what
a rank holds is what it has in flight, not a region per op slot of the
largest size an op may have.

Memory: the segment is a sparse file, as large as every arena together, of
which only what is reserved holds pages. An arena reserves (`posix_fallocate`)
from its start up to the end of its highest block, in steps of
`RESERVE_STEP_BYTES`, when a block first reaches there, and keeps it (the next
op of that size reuses it). A rank therefore holds about the bytes of the ops
it has in flight at once (DDP: one step's buckets), never more than its
arena. Blocks are placed first fit from the arena's start (so the reservation
stays low), and an arena of twice `slots` times the largest op always has a
hole for one more op while fewer than `slots` are live. A reservation that
the shared-memory directory cannot give raises `SharedMemoryError` naming
the bytes and what to do, instead of a SIGBUS when the page is first touched.

Pure bookkeeping plus the one system call; no threads (the caller locks).
"""

from __future__ import annotations

import bisect
import errno
import os

from gradsync.errors import SharedMemoryError
from gradsync.local.local_segment import ALIGN_BYTES, shortage_message

__all__ = ["RESERVE_STEP_BYTES", "Arena", "arena_bytes"]

#: The arena's reservation grows by whole steps of this many bytes.
RESERVE_STEP_BYTES = 1 << 20


def _align(value: int) -> int:
    return (value + ALIGN_BYTES - 1) // ALIGN_BYTES * ALIGN_BYTES


def arena_bytes(slots: int, max_op_bytes: int) -> int:
    """An arena's size: room for `slots` ops of `max_op_bytes` in flight whatever the holes.

    With at most `slots - 1` blocks live, the free space (at least `slots + 1`
    ops' worth) is cut into at most `slots` holes, so one is larger than an op.
    """
    return 2 * slots * _align(max_op_bytes)


class Arena:
    """Blocks of `[start, start + size)` of the segment behind `fd`, reserved as they grow.

    Args:
        fd: the segment's file (kept open by the caller).
        start: the arena's offset in the segment.
        size: the arena's size (`arena_bytes`).
        directory: where the segment lives (for the shortage message).
    """

    def __init__(self, fd: int, start: int, size: int, directory: str) -> None:
        self._fd = fd
        self._start = start
        self._size = size
        self._directory = directory
        #: Live blocks as (offset in the arena, length), by offset.
        self._blocks: list[tuple[int, int]] = []
        #: Bytes from the arena's start backed by pages.
        self.reserved = 0

    @property
    def live(self) -> int:
        """Blocks allocated and not yet freed."""
        return len(self._blocks)

    def allocate(self, nbytes: int) -> int:
        """A block of `nbytes` (its offset in the segment), reserved before it is returned.

        Raises:
            SharedMemoryError: the directory cannot back the block.
            ValueError: no hole fits (more ops in flight than the arena was made for).
        """
        length = max(ALIGN_BYTES, _align(nbytes))
        position = 0
        index = len(self._blocks)
        for i, (offset, used) in enumerate(self._blocks):
            if offset - position >= length:
                index = i
                break
            position = offset + used
        if position + length > self._size:
            raise ValueError(
                f"no room for {nbytes} bytes among {len(self._blocks)} blocks in flight in an "
                f"arena of {self._size} bytes"
            )
        self._reserve(position + length)
        self._blocks.insert(index, (position, length))
        return self._start + position

    def free(self, offset: int) -> None:
        """Give back the block at `offset` (from `allocate`); unknown offsets are ignored."""
        local = offset - self._start
        index = bisect.bisect_left(self._blocks, (local, 0))
        if index < len(self._blocks) and self._blocks[index][0] == local:
            del self._blocks[index]

    def _reserve(self, end: int) -> None:
        if end <= self.reserved:
            return
        target = min(self._size, -(-end // RESERVE_STEP_BYTES) * RESERVE_STEP_BYTES)
        try:
            os.posix_fallocate(self._fd, self._start + self.reserved, target - self.reserved)
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.ENOMEM, errno.EFBIG):
                raise SharedMemoryError(shortage_message(target, self._directory)) from exc
            raise
        self.reserved = target
