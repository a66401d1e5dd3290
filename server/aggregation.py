"""Order-independent averaging of gradient chunks: pure logic, no gRPC.

The coordinator feeds one `BucketReduction` per (step, bucket) with the chunks
ranks upload, in whatever order the network delivers them; it returns each
chunk's average the moment the last expected rank has contributed to it.

Bitwise reproducibility: floating-point addition is not associative, so the
sum is always formed in ascending rank order (r0 + r1 + r2 ...), whatever the
arrival order. A contribution that arrives "early" (its predecessor in rank
order is still missing) is parked until the prefix before it is complete;
in-order arrivals are folded straight into the accumulator. The result is the
same bytes for every interleaving, and memory holds at most one accumulator
plus the parked payloads per chunk.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt
from gradsync import wire


@dataclass
class _ChunkState:
    """Partial sum of one chunk: ranks[:next_position] are folded in."""

    accumulator: npt.NDArray[np.floating] | None = None
    next_position: int = 0
    parked: dict[int, bytes | memoryview] = field(default_factory=dict)
    contributed: set[int] = field(default_factory=set)


class DuplicateContributionError(ValueError):
    """A rank contributed the same chunk twice."""


class BucketReduction:
    """Averages one bucket of one step across a fixed set of ranks.

    Args:
        ranks: the ranks whose contributions make up the average; the sum is
            formed in ascending rank order.
        dtype: wire dtype of the bucket (a `gradsync.v1.DType` value).
        num_bytes: size of the bucket in bytes.
        chunk_bytes: chunk size; offsets are multiples of it.

    The caller validates offsets and lengths (it knows the rank and step to put
    in error messages); this class trusts them and only refuses duplicates.
    """

    def __init__(self, ranks: Sequence[int], dtype: int, num_bytes: int, chunk_bytes: int) -> None:
        if not ranks:
            raise ValueError("a reduction needs at least one rank")
        self._order = sorted(ranks)
        self._position = {rank: position for position, rank in enumerate(self._order)}
        self.dtype = dtype
        self.num_bytes = num_bytes
        self.chunk_bytes = chunk_bytes
        self._chunks: dict[int, _ChunkState] = {}
        self._chunks_done = 0
        self._chunks_total = wire.num_chunks(num_bytes, chunk_bytes)
        self.buffered_bytes = 0

    @property
    def contributors(self) -> int:
        """Number of ranks averaged over (the divisor)."""
        return len(self._order)

    @property
    def complete(self) -> bool:
        """True once every chunk's average has been produced."""
        return self._chunks_done == self._chunks_total

    def add(self, rank: int, offset: int, payload: bytes | memoryview) -> memoryview | None:
        """Fold one rank's chunk in; return the chunk's average if now complete.

        Raises:
            KeyError: `rank` is not one of the reduction's ranks.
            DuplicateContributionError: `rank` already sent this chunk.
        """
        position = self._position[rank]
        state = self._chunks.get(offset)
        if state is None:
            state = self._chunks[offset] = _ChunkState()
        if rank in state.contributed:
            raise DuplicateContributionError(
                f"rank {rank} already contributed the chunk at offset {offset}"
            )
        state.contributed.add(rank)
        before = self._state_bytes(state)
        if position == state.next_position:
            self._fold(state, payload)
            while state.next_position in state.parked:
                self._fold(state, state.parked.pop(state.next_position))
        else:
            state.parked[position] = payload
        if state.next_position < len(self._order):
            self.buffered_bytes += self._state_bytes(state) - before
            return None
        # Complete: every rank is folded in, in rank order.
        assert state.accumulator is not None  # set by the first _fold
        state.accumulator /= len(self._order)
        averaged = wire.from_accumulator(state.accumulator, self.dtype)
        self.buffered_bytes -= before
        del self._chunks[offset]
        self._chunks_done += 1
        return averaged

    def _fold(self, state: _ChunkState, payload: bytes | memoryview) -> None:
        if state.accumulator is None:
            state.accumulator = wire.to_accumulator(payload, self.dtype)
        else:
            wire.add_into(state.accumulator, payload, self.dtype)
        state.next_position += 1

    @staticmethod
    def _state_bytes(state: _ChunkState) -> int:
        accumulator = 0 if state.accumulator is None else state.accumulator.nbytes
        return accumulator + sum(len(parked) for parked in state.parked.values())
