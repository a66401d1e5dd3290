"""A host group's arena: first-fit blocks in a sparse file, pages reserved as blocks reach them."""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest
from gradsync.distributed.host_arena import RESERVE_STEP_BYTES, Arena, arena_bytes

MIB = 1 << 20


def _arena(tmp_path: Path, start: int, size: int) -> tuple[int, Arena]:
    fd = os.open(tmp_path / "segment", os.O_RDWR | os.O_CREAT, 0o600)
    os.ftruncate(fd, start + size)
    return fd, Arena(fd, start, size, str(tmp_path))


def test_blocks_are_placed_first_fit_and_reserved_in_steps(tmp_path: Path) -> None:
    fd, arena = _arena(tmp_path, 4 * MIB, 16 * MIB)
    try:
        first = arena.allocate(3 * MIB + 1)
        assert first == 4 * MIB  # offsets are the segment's
        assert arena.reserved == 4 * MIB  # 3 MiB + 1 byte, in whole steps
        assert os.fstat(fd).st_blocks * 512 >= 4 * MIB  # the pages are really there
        second = arena.allocate(10)
        assert second == first + 3 * MIB + 64  # 64-byte aligned, right behind
        arena.free(first)
        assert arena.allocate(MIB) == first  # the hole is reused
        assert arena.reserved == 4 * MIB and arena.live == 2
        with pytest.raises(ValueError, match="no room for 16777216 bytes among 2 blocks"):
            arena.allocate(16 * MIB)
        assert RESERVE_STEP_BYTES == MIB
    finally:
        os.close(fd)


def test_fewer_than_slots_blocks_in_flight_always_fit(tmp_path: Path) -> None:
    slots, largest = 8, 4096
    fd, arena = _arena(tmp_path, 0, arena_bytes(slots, largest))
    try:
        rng = random.Random(3)
        live: list[int] = []
        for _ in range(2000):
            if len(live) == slots or (live and rng.random() < 0.5):
                arena.free(live.pop(rng.randrange(len(live))))
            else:
                live.append(arena.allocate(rng.randint(0, largest)))
        assert arena.live == len(live)
    finally:
        os.close(fd)
