"""Order-independent averaging of gradient chunks: pure logic, no gRPC.

The coordinator feeds one `BucketReduction` per (step, bucket) with the chunks
ranks upload, in whatever order the network delivers them; it returns each
chunk's average the moment the last expected rank has contributed to it.

Bitwise reproducibility: floating-point addition is not associative, so the
sum is always formed in ascending rank order (r0 + r1 + r2 ...), whatever the
arrival order. A contribution that arrives "early" (a lower rank is still
missing) is parked until the prefix before it is complete; in-order arrivals
are folded straight into the accumulator. The result is the same bytes for
every interleaving, and memory holds at most one accumulator plus the parked
payloads per chunk.

Membership may change mid-step (elastic policy): `drop_rank` removes a lost
rank from every pending chunk that it has not contributed to (a contribution
already received stays, and counts in the divisor: the average is always over
the contributions it contains), and `add_rank` adds a rejoining rank.

Uneven inputs (DDP's `join()`) are the one exception to "divide by the
contributions": a rank that ran out of inputs contributes nothing, yet the
average keeps dividing by the world size, as DDP's default
`divide_by_initial_world_size=True` does. `divisor` overrides the count for that.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt
from gradsync.protocol import chunking
from gradsync.protocol.dtypes import dtype_name
from gradsync.v1 import gradsync_pb2 as pb


def to_accumulator(payload: bytes | memoryview, dtype: int) -> npt.NDArray[np.floating]:
    """Decode raw bytes into a fresh, writable accumulation array (fp32 or fp64)."""
    if dtype == pb.DTYPE_FLOAT64:
        return np.frombuffer(payload, dtype="<f8").copy()
    if dtype == pb.DTYPE_FLOAT32:
        return np.frombuffer(payload, dtype="<f4").copy()
    if dtype == pb.DTYPE_FLOAT16:
        return np.frombuffer(payload, dtype="<f2").astype(np.float32)
    if dtype == pb.DTYPE_BFLOAT16:
        # bfloat16 is the upper half of a float32: shift the bits into place.
        widened = np.frombuffer(payload, dtype="<u2").astype(np.uint32) << 16
        return widened.view(np.float32)
    raise ValueError(f"unsupported dtype {dtype_name(dtype)}")


def add_into(
    accumulator: npt.NDArray[np.floating], payload: bytes | memoryview, dtype: int
) -> None:
    """accumulator += decode(payload), without an extra copy for fp32/fp64."""
    if dtype == pb.DTYPE_FLOAT64:
        accumulator += np.frombuffer(payload, dtype="<f8")
    elif dtype == pb.DTYPE_FLOAT32:
        accumulator += np.frombuffer(payload, dtype="<f4")
    else:
        accumulator += to_accumulator(payload, dtype)


def from_accumulator(values: npt.NDArray[np.floating], dtype: int) -> memoryview:
    """Raw bytes of the wire dtype for an accumulation array (a view when no cast is needed)."""
    if dtype == pb.DTYPE_FLOAT64:
        return values.astype("<f8", copy=False).data.cast("B")
    if dtype == pb.DTYPE_FLOAT32:
        return values.astype("<f4", copy=False).data.cast("B")
    if dtype == pb.DTYPE_FLOAT16:
        return values.astype("<f2").data.cast("B")
    if dtype == pb.DTYPE_BFLOAT16:
        bits = values.astype(np.float32, copy=False).view(np.uint32)
        # Round to nearest, ties to even, as torch does when narrowing to bf16.
        rounding = ((bits >> 16) & 1) + np.uint32(0x7FFF)
        return ((bits + rounding) >> 16).astype("<u2").data.cast("B")
    raise ValueError(f"unsupported dtype {dtype_name(dtype)}")


@dataclass
class _ChunkState:
    """Partial sum of one chunk: expected[:next_position] are folded in."""

    expected: list[int]
    accumulator: npt.NDArray[np.floating] | None = None
    next_position: int = 0
    parked: dict[int, bytes | memoryview] = field(default_factory=dict)
    contributed: set[int] = field(default_factory=set)


class DuplicateContributionError(ValueError):
    """A rank contributed the same chunk twice."""


class BucketReduction:
    """Averages one bucket of one step across a set of ranks.

    Args:
        ranks: the ranks whose contributions make up the average; the sum is
            formed in ascending rank order.
        dtype: wire dtype of the bucket (a `gradsync.v1.DType` value).
        num_bytes: size of the bucket in bytes.
        chunk_bytes: chunk size; offsets are multiples of it.
        divisor: divide every chunk's sum by this instead of by the number of
            contributions (uneven inputs); None = the contributions.
        byte_range: the bytes [lo, hi) of the bucket this reduction averages (a
            coordinator shard's range); None = the whole bucket. Offsets stay
            absolute in the bucket; completion counts the range's chunks.
        reply_dtype: the dtype averages are returned in; None = `dtype`. float32
            for a 16-bit `dtype` hands out the fp32 accumulator's bytes (twice
            the chunk's length) instead of rounding it back to 16 bits.

    The caller validates offsets and lengths (it knows the rank and step to put
    in error messages); this class trusts them and only refuses duplicates.
    """

    def __init__(
        self,
        ranks: Sequence[int],
        dtype: int,
        num_bytes: int,
        chunk_bytes: int,
        divisor: int | None = None,
        byte_range: tuple[int, int] | None = None,
        reply_dtype: int | None = None,
    ) -> None:
        if not ranks:
            raise ValueError("a reduction needs at least one rank")
        if divisor is not None and divisor < len(ranks):
            raise ValueError(f"divisor {divisor} is below the {len(ranks)} contributing ranks")
        self.divisor = divisor
        self._ranks = sorted(ranks)
        self.dtype = dtype
        self.reply_dtype = dtype if reply_dtype is None else reply_dtype
        self.num_bytes = num_bytes
        self.chunk_bytes = chunk_bytes
        self._chunks: dict[int, _ChunkState] = {}
        self._chunks_done = 0
        lo, hi = (0, num_bytes) if byte_range is None else byte_range
        if not 0 <= lo <= hi <= num_bytes:
            raise ValueError(f"byte range [{lo}, {hi}) is not inside a {num_bytes}-byte bucket")
        #: Bytes this reduction averages (the whole bucket unless sharded).
        self.range_bytes = hi - lo
        #: Chunks this reduction averages before it is complete.
        self.chunks_total = chunking.num_chunks(hi - lo, chunk_bytes)
        self.buffered_bytes = 0
        self.last_contributors = len(self._ranks)

    @property
    def contributors(self) -> int:
        """Number of ranks a chunk starting now would be averaged over."""
        return len(self._ranks)

    @property
    def complete(self) -> bool:
        """True once every chunk's average has been produced."""
        return self._chunks_done == self.chunks_total

    def add(self, rank: int, offset: int, payload: bytes | memoryview) -> memoryview | None:
        """Fold one rank's chunk in; return the chunk's average (in `reply_dtype`) if complete.

        Raises:
            KeyError: `rank` is not expected in this chunk.
            DuplicateContributionError: `rank` already sent this chunk.
        """
        state = self._chunks.get(offset)
        if state is None:
            state = self._chunks[offset] = _ChunkState(list(self._ranks))
        if rank in state.contributed:
            raise DuplicateContributionError(
                f"rank {rank} already contributed the chunk at offset {offset}"
            )
        if rank not in state.expected:
            raise KeyError(rank)
        state.contributed.add(rank)
        before = self._state_bytes(state)
        state.parked[rank] = payload
        return self._advance(offset, state, before)

    def drop_rank(self, rank: int) -> list[tuple[int, memoryview]]:
        """Stop waiting for `rank`; return (offset, average) of chunks that completed."""
        if rank in self._ranks:
            self._ranks.remove(rank)
        completed = []
        for offset, state in list(self._chunks.items()):
            if rank in state.expected and rank not in state.contributed:
                before = self._state_bytes(state)
                state.expected.remove(rank)
                averaged = self._advance(offset, state, before)
                if averaged is not None:
                    completed.append((offset, averaged))
        return completed

    def add_rank(self, rank: int) -> None:
        """Also wait for `rank` in every chunk not yet complete.

        Only valid while no pending chunk has folded a rank above `rank`
        (the coordinator adds ranks before the lowest live rank contributes).
        """
        if rank not in self._ranks:
            bisect.insort(self._ranks, rank)
        for state in self._chunks.values():
            if rank not in state.expected:
                position = bisect.bisect_left(state.expected, rank)
                if position < state.next_position:
                    raise ValueError(f"rank {rank} would be summed out of rank order")
                state.expected.insert(position, rank)

    def _advance(self, offset: int, state: _ChunkState, before: int) -> memoryview | None:
        """Fold the parked prefix in rank order; finish the chunk when nothing is missing."""
        while (
            state.next_position < len(state.expected)
            and state.expected[state.next_position] in state.parked
        ):
            payload = state.parked.pop(state.expected[state.next_position])
            if state.accumulator is None:
                state.accumulator = to_accumulator(payload, self.dtype)
            else:
                add_into(state.accumulator, payload, self.dtype)
            state.next_position += 1
        if state.next_position < len(state.expected):
            self.buffered_bytes += self._state_bytes(state) - before
            return None
        # Complete: every expected rank is folded in, in rank order.
        assert state.accumulator is not None  # at least one contribution was folded
        state.accumulator /= self.divisor or state.next_position
        self.last_contributors = state.next_position
        averaged = from_accumulator(state.accumulator, self.reply_dtype)
        self.buffered_bytes -= before
        del self._chunks[offset]
        self._chunks_done += 1
        return averaged

    @staticmethod
    def _state_bytes(state: _ChunkState) -> int:
        accumulator = 0 if state.accumulator is None else state.accumulator.nbytes
        return accumulator + sum(len(parked) for parked in state.parked.values())
