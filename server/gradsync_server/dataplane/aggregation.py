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

With local groups (hierarchical aggregation, `host_groups`) the ranks summed
here are the units' leaders: a leader's contribution is its host's partial
sum (formed there in local rank order) and weighs as many ranks as it covers.
Units are summed in ascending leader rank order, the average divides by the
summed weights (the ranks it holds), and `last_contributors` is that sum.

Membership may change mid-step (elastic policy): `drop_rank` removes a lost
rank from every pending chunk that it has not contributed to (a contribution
already received stays, and counts in the divisor: the average is always over
the contributions it contains), and `add_rank` adds a rejoining rank.

Weighted averages (DiLoCo's `weighted` rounds, `gradsync_server.dataplane.rounds`):
a contribution added with a `sample_weight` w is multiplied by w (in the
accumulation dtype, w rounded to it) before it is folded in, still in rank
order, and the chunk divides by the sum of the weights, formed in float64 in
the same order; the quotient is formed in float64 too and rounded once to the
accumulation dtype: sum(w_i g_i) / sum(w_i). (`rounds.MIN_WEIGHT` keeps every
w_i a normal float32 number, so the sum is never 0.)

Uneven inputs (DDP's `join()`) are the one exception to "divide by the
contributions": a rank that ran out of inputs contributes nothing, yet the
average keeps dividing by the world size, as DDP's default
`divide_by_initial_world_size=True` does. `divisor` overrides the count for that.

Accumulation dtype: a float64 bucket is summed in float64, every other wire
dtype (float32, float16/bfloat16 from a comm hook, int8 dequantized with its
chunk's scale, `gradsync_proto.int8_wire`) in float32, and the sum
is divided by the count in that dtype (DDP's all-reduce sums float32 buckets
in float32 too; a 16-bit wire gains a wider sum here). Overflow is the one place where float32
is not enough: two ranks sending 3e38 sum to inf although their mean 3e38 is
representable. So every contribution is classified as it arrives
(`classify`, one BLAS dot product: a finite x.x proves every |x| < 2**64 for
float32, 2**512 for float64, so no sum of fewer than 2**64 such contributions
can overflow). A chunk whose contributions are all `TAME` (every real
gradient) is summed exactly as before, bit for bit. From the first `LARGE` or
`NONFINITE` contribution folded into a chunk, the chunk also keeps a float64
shadow sum (scaled by 2**-64, so float64 buckets cannot overflow it either),
folded in the same rank order; at the end, only the elements whose float32
sum came out non-finite while their shadow is finite (every input finite)
take the shadow's mean, rounded to the bucket's dtype, so a representable
mean comes out and an unrepresentable one is inf. Elements with a NaN or Inf
input stay NaN/Inf: what to do about those is the coordinator's
`--nonfinite` policy (`gradsync_server.dataplane.nonfinite`), decided per contribution
from the same classification.
"""

from __future__ import annotations

import bisect
import enum
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt
from gradsync_proto import chunking, dtypes
from gradsync_proto.dtypes import dtype_name
from gradsync_proto.v1 import gradsync_pb2 as pb

from gradsync_server.dataplane.accumulators import (
    WIDE,
    average_bytes,
    decoded,
    from_accumulator,
    owned_accumulator,
    scaled_accumulator,
)


class Magnitude(enum.IntEnum):
    """What a contribution can do to a float sum (see the module docstring)."""

    #: Every element finite and below 2**64 (2**512 for float64): no sum overflows.
    TAME = 0
    #: Every element finite, but large enough that a sum might overflow.
    LARGE = 1
    #: Some element is NaN or +-Inf.
    NONFINITE = 2


#: Exponent bits of float16 / bfloat16, all set for Inf and NaN.
_F16_EXPONENT = 0x7C00
_BF16_EXPONENT = 0x7F80
#: The largest bfloat16 exponent field still TAME: |x| < 2**64, as float32's bound.
_BF16_TAME_EXPONENT = (127 + 63) << 7
#: The shadow sum's scale: a power of two (exact), small enough that 2**64
#: float64 contributions cannot overflow it.
_SHADOW_SCALE = 2.0**-64


def classify(payload: bytes | memoryview, dtype: int) -> Magnitude:
    """Whether a contribution is `TAME`, `LARGE` or `NONFINITE` (`measured_classify`)."""
    return measured_classify(payload, dtype)[0]


def measured_classify(payload: bytes | memoryview, dtype: int) -> tuple[Magnitude, float]:
    """Whether a contribution is `TAME`, `LARGE` or `NONFINITE`, in one pass.

    float32/float64: x.x is finite exactly when every x_i**2 is (rounding is
    monotonic, so one square past the dtype's max makes the sum inf, and a NaN
    or Inf makes it NaN or inf); only then is the payload scanned again
    (`np.isfinite`) to tell large from non-finite. 16-bit: the largest
    exponent field says both at once. About 15-20 us per aligned MiB of
    float32, less than the add it guards (~25 us); a whole 25 MB bucket at
    W = 4 costs ~2.5 ms more than before (8.5 -> 11.3 ms of summing).

    Returns:
        The magnitude and x.x, the sum of squares (a per-step screen's norm, for
        free; inf when it overflows or holds NaN/Inf, nan for a 16-bit payload).
    """
    if dtype in WIDE:
        values = decoded(payload, dtype)
        with np.errstate(over="ignore", invalid="ignore"):  # overflow is what we look for
            square_sum = float(np.dot(values, values))
        if math.isfinite(square_sum):
            return Magnitude.TAME, square_sum
        finite = bool(np.isfinite(values).all())
        return (Magnitude.LARGE if finite else Magnitude.NONFINITE), math.inf
    if dtype in (pb.DTYPE_FLOAT16, pb.DTYPE_BFLOAT16):
        bits = np.frombuffer(payload, dtype="<u2")
        if not len(bits):
            return Magnitude.TAME, math.nan
        mask = _F16_EXPONENT if dtype == pb.DTYPE_FLOAT16 else _BF16_EXPONENT
        # The largest magnitude (bits & 0x7FFF), in two reads and no temporary: among
        # positive values it is the largest int16, among negative ones the largest
        # uint16 less the sign bit. Its exponent field is the largest one.
        largest = max(int(bits.view("<i2").max()), int(bits.max()) - 0x8000)
        top = largest & mask
        if top == mask:
            return Magnitude.NONFINITE, math.nan
        if dtype == pb.DTYPE_BFLOAT16 and top > _BF16_TAME_EXPONENT:
            return Magnitude.LARGE, math.nan
        return Magnitude.TAME, math.nan
    raise ValueError(f"unsupported dtype {dtype_name(dtype)}")


def examine(payload: bytes | memoryview, dtype: int) -> tuple[bytes | memoryview, Magnitude]:
    """The payload, copied if its elements are misaligned, and its `classify` magnitude."""
    payload, magnitude, _ = measured_examine(payload, dtype)
    return payload, magnitude


def measured_examine(
    payload: bytes | memoryview, dtype: int
) -> tuple[bytes | memoryview, Magnitude, float]:
    """The payload, copied if its elements are misaligned, and its `measured_classify`.

    A chunk's payload is a view into the received message. gradsync's encoder
    puts it at an aligned offset (`gradsync_proto.codec.PAYLOAD_ALIGNMENT`), so
    it is checked and summed where it lies; a payload from another encoder may
    start anywhere, and numpy then falls back from BLAS and SIMD to slow loops
    (a misaligned MiB: dot 69 us, add 50 us; aligned: 13 us and 22 us). One copy
    (~20 us) makes the check and the later fold fast, and frees the message it
    was cut from, so it costs no memory.

    The copy is a fresh, aligned, writable array (returned as a byte memoryview
    of it) that nothing else holds: the first contribution of a chunk becomes
    its accumulator in place (`owned_accumulator`) instead of being copied again.
    """
    itemsize = dtypes.itemsize(dtype)
    address = np.frombuffer(payload, dtype=np.uint8).__array_interface__["data"][0]
    if address % itemsize:
        # Copied as unsigned integers: every bit as sent, NaN payloads included.
        payload = np.frombuffer(payload, dtype=f"<u{itemsize}").copy().data.cast("B")
    return payload, *measured_classify(payload, dtype)


def count_nonfinite(payload: bytes | memoryview, dtype: int) -> int:
    """How many elements of a payload are NaN or +-Inf (for messages: the rare path)."""
    if dtype in WIDE:
        return int(np.count_nonzero(~np.isfinite(decoded(payload, dtype))))
    if dtype in (pb.DTYPE_FLOAT16, pb.DTYPE_BFLOAT16):
        mask = np.uint16(_F16_EXPONENT if dtype == pb.DTYPE_FLOAT16 else _BF16_EXPONENT)
        return int(np.count_nonzero((np.frombuffer(payload, dtype="<u2") & mask) == mask))
    raise ValueError(f"unsupported dtype {dtype_name(dtype)}")


@dataclass
class _ChunkState:
    """Partial sum of one chunk: expected[:next_position] are folded in."""

    expected: list[int]
    accumulator: npt.NDArray[np.floating] | None = None
    next_position: int = 0
    parked: dict[int, tuple[bytes | memoryview, Magnitude, int, float | None]] = field(
        default_factory=dict
    )
    contributed: set[int] = field(default_factory=set)
    #: Ranks the contributions folded so far hold (each weighs its covered ranks).
    weight: int = 0
    #: Float64 sum scaled by _SHADOW_SCALE, from the first untame contribution on.
    shadow: npt.NDArray[np.float64] | None = None
    #: Sum of the sample weights folded so far (weighted reductions only).
    sample_total: float = 0.0


#: A screened merge (`gradsync_server.dataplane.screening`): given a complete chunk's
#: offset and its contributions in ascending rank order (in the accumulation dtype),
#: the chunk's sum, its divisor and how many contributions it holds.
ScreenedMerge = Callable[
    [int, list[tuple[int, npt.NDArray[np.floating]]]],
    tuple[npt.NDArray[np.floating], float, int],
]


class DuplicateContributionError(ValueError):
    """A rank contributed the same chunk twice."""


class BucketReduction:
    """Averages one bucket of one step across a set of ranks.

    Args:
        ranks: the ranks whose contributions make up the average (the unit
            leaders, with local groups); the sum is formed in ascending rank order.
        dtype: wire dtype of the bucket (a `gradsync.v1.DType` value); offsets,
            lengths and `num_bytes` count its bytes (an int8 wire: one per element).
        num_bytes: size of the bucket in bytes.
        chunk_bytes: chunk size; offsets are multiples of it.
        divisor: divide every chunk's sum by this instead of by the summed
            weights of its contributions (uneven inputs); None = the weights.
        byte_range: the bytes [lo, hi) of the bucket this reduction averages (a
            coordinator shard's range); None = the whole bucket. Offsets stay
            absolute in the bucket; completion counts the range's chunks.
        reply_dtype: the dtype averages are returned in; None = `dtype`. float32
            for a 16-bit `dtype` hands out the fp32 accumulator's bytes (twice
            the chunk's length) instead of rounding it back to 16 bits.
        average_dtype: the dtype `add` returns averages in, if not `reply_dtype`: an
            outer bucket's answer (DiLoCo) is computed from the float32 average
            whatever dtype it is answered in (`outer_answer`).

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
        average_dtype: int | None = None,
    ) -> None:
        if not ranks:
            raise ValueError("a reduction needs at least one rank")
        if divisor is not None and divisor < len(ranks):
            raise ValueError(f"divisor {divisor} is below the {len(ranks)} contributing ranks")
        self.divisor = divisor
        self._ranks = sorted(ranks)
        self.dtype = dtype
        #: What `add` takes: payloads of the wire dtype, but float32 for an int8 wire,
        #: whose chunks need their own scale and so arrive dequantized (`chunk_checks`).
        self.payload_dtype = pb.DTYPE_FLOAT32 if dtype == pb.DTYPE_INT8 else dtype
        self.reply_dtype = dtype if reply_dtype is None else reply_dtype
        self.average_dtype = self.reply_dtype if average_dtype is None else average_dtype
        self.num_bytes = num_bytes
        self.chunk_bytes = chunk_bytes
        self._chunks: dict[int, _ChunkState] = {}
        self._chunks_done = 0
        # Offsets already averaged: a chunk sent again after its average went out
        # must be refused, not start a second sum that would count towards
        # completion in place of a chunk never sent (found by the fuzzer).
        self._finished: set[int] = set()
        lo, hi = (0, num_bytes) if byte_range is None else byte_range
        if not 0 <= lo <= hi <= num_bytes:
            raise ValueError(f"byte range [{lo}, {hi}) is not inside a {num_bytes}-byte bucket")
        #: Bytes this reduction averages (the whole bucket unless sharded).
        self.range_bytes = hi - lo
        #: Chunks this reduction averages before it is complete.
        self.chunks_total = chunking.num_chunks(hi - lo, chunk_bytes)
        self.buffered_bytes = 0
        self.last_contributors = len(self._ranks)
        #: Hold every contribution of a chunk and merge them with this once it is
        #: complete (a screen's clip, exclude or robust merge); None = sum on arrival.
        self.screened_merge: ScreenedMerge | None = None
        #: With `screened_merge`: a chunk with a contribution that is not `TAME` is summed
        #: as usual instead (with its float64 shadow: the screen merges without one).
        self.screen_tame_only = False

    @property
    def contributors(self) -> int:
        """Number of contributions (units) a chunk starting now waits for."""
        return len(self._ranks)

    @property
    def complete(self) -> bool:
        """True once every chunk's average has been produced."""
        return self._chunks_done == self.chunks_total

    def add(
        self,
        rank: int,
        offset: int,
        payload: bytes | memoryview,
        magnitude: Magnitude | None = None,
        weight: int = 1,
        sample_weight: float | None = None,
    ) -> memoryview | None:
        """Fold one rank's chunk in; return the chunk's average (in `reply_dtype`) if complete.

        Args:
            payload: the chunk's bytes in `payload_dtype` (an int8 chunk dequantized).
            magnitude: `classify(payload, payload_dtype)` if the caller already has it
                (the coordinator classifies to apply its --nonfinite policy; it
                passes the payload `examine` returned).
            weight: how many ranks the contribution holds (a local leader's
                partial sum: its covered ranks; the caller validated them).
            sample_weight: weigh the contribution by this (a weighted DiLoCo round;
                the caller validated it: finite, > 0); None = an unweighted mean.
                A reduction's contributions are all weighted or none.

        Raises:
            KeyError: `rank` is not expected in this chunk.
            DuplicateContributionError: `rank` already sent this chunk.
        """
        if offset in self._finished:
            raise DuplicateContributionError(
                f"rank {rank} sent the chunk at offset {offset} after its average was sent"
            )
        state = self._chunks.get(offset)
        if state is None:
            state = self._chunks[offset] = _ChunkState(list(self._ranks))
        if rank in state.contributed:
            raise DuplicateContributionError(
                f"rank {rank} already contributed the chunk at offset {offset}"
            )
        if rank not in state.expected:
            raise KeyError(rank)
        if magnitude is None:
            payload, magnitude = examine(payload, self.payload_dtype)
        state.contributed.add(rank)
        before = self._state_bytes(state)
        state.parked[rank] = (payload, magnitude, weight, sample_weight)
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

    def _advance(
        self, offset: int, state: _ChunkState, before: int, screened: bool = True
    ) -> memoryview | None:
        """Fold the parked prefix in rank order; finish the chunk when nothing is missing."""
        if screened and self.screened_merge is not None:
            return self._merge_screened(offset, state, before, self.screened_merge)
        while (
            state.next_position < len(state.expected)
            and state.expected[state.next_position] in state.parked
        ):
            payload, magnitude, weight, sample_weight = state.parked.pop(
                state.expected[state.next_position]
            )
            state.weight += weight
            if sample_weight is not None:
                self._fold_weighted(state, payload, sample_weight)
            else:
                # Only the first contribution becomes the accumulator: the others are read.
                first = state.accumulator is None
                values = (owned_accumulator if first else decoded)(payload, self.payload_dtype)
                self._fold(state, values, magnitude is Magnitude.TAME)
            state.next_position += 1
        if state.next_position < len(state.expected):
            self.buffered_bytes += self._state_bytes(state) - before
            return None
        # Complete: every expected rank is folded in, in rank order.
        assert state.accumulator is not None  # at least one contribution was folded
        divisor: float | np.floating = self.divisor or state.weight
        if state.sample_total:  # weighted: sum(w_i) in float64, and the quotient formed in it
            divisor = np.float64(state.sample_total)
        self.last_contributors = state.weight
        if state.shadow is None:  # the divide writes the reply (the accumulator is spent)
            averaged = average_bytes(state.accumulator, divisor, self.average_dtype)
        else:
            _divide_with_shadow(state.accumulator, state.shadow, divisor)
            averaged = from_accumulator(state.accumulator, self.average_dtype)
        return self._finish(offset, before, averaged)

    def _merge_screened(
        self, offset: int, state: _ChunkState, before: int, screened_merge: ScreenedMerge
    ) -> memoryview | None:
        """Hold the chunk's contributions until every expected one is in; then merge them."""
        if any(rank not in state.parked for rank in state.expected):
            self.buffered_bytes += self._state_bytes(state) - before
            return None
        untame = any(parked[1] is not Magnitude.TAME for parked in state.parked.values())
        if untame and self.screen_tame_only:
            return self._advance(offset, state, before, screened=False)
        contributions = [
            (rank, decoded(state.parked[rank][0], self.payload_dtype)) for rank in state.expected
        ]
        total, divisor, self.last_contributors = screened_merge(offset, contributions)
        state.parked.clear()
        averaged = average_bytes(total, total.dtype.type(divisor), self.average_dtype)
        return self._finish(offset, before, averaged)

    def _finish(self, offset: int, before: int, averaged: memoryview) -> memoryview:
        """The chunk at `offset` (which held `before` bytes) is averaged: forget it."""
        self.buffered_bytes -= before
        del self._chunks[offset]
        self._finished.add(offset)
        self._chunks_done += 1
        return averaged

    def _fold_weighted(
        self, state: _ChunkState, payload: bytes | memoryview, sample_weight: float
    ) -> None:
        """Fold w * contribution in (its own magnitude decides the shadow), and count w."""
        with np.errstate(over="ignore", invalid="ignore"):  # overflow is classified next
            values = scaled_accumulator(payload, self.payload_dtype, sample_weight)
        state.sample_total += sample_weight
        accumulation = pb.DTYPE_FLOAT64 if values.dtype == np.float64 else pb.DTYPE_FLOAT32
        magnitude = classify(values.data.cast("B"), accumulation) if state.shadow is None else None
        self._fold(state, values, magnitude is Magnitude.TAME)

    def _fold(self, state: _ChunkState, values: npt.NDArray[np.floating], tame: bool) -> None:
        """Fold a contribution in, and into its float64 shadow unless it is `tame` while
        the chunk has no shadow (every real gradient: no overflow possible, the sum as it
        always was); a shadow is started if need be.

        `values` becomes the accumulator if the chunk has none yet (then it must
        be an array the reduction owns); otherwise it is only read.

        With a shadow the accumulator is summed exactly as on the fast path (its
        finite elements stay bitwise the same); overflow and NaN are expected
        there, hence no warnings.
        """
        if tame and state.shadow is None:
            if state.accumulator is None:
                state.accumulator = values
            else:
                state.accumulator += values
            return
        with np.errstate(over="ignore", invalid="ignore"):
            if state.accumulator is None:
                state.accumulator = values
                state.shadow = values.astype(np.float64) * _SHADOW_SCALE
                return
            if state.shadow is None:
                state.shadow = state.accumulator.astype(np.float64) * _SHADOW_SCALE
            state.shadow += values.astype(np.float64) * _SHADOW_SCALE
            state.accumulator += values

    @staticmethod
    def _state_bytes(state: _ChunkState) -> int:
        accumulator = 0 if state.accumulator is None else state.accumulator.nbytes
        shadow = 0 if state.shadow is None else state.shadow.nbytes
        return accumulator + shadow + sum(len(parked[0]) for parked in state.parked.values())


def _divide_with_shadow(
    accumulator: npt.NDArray[np.floating],
    shadow: npt.NDArray[np.float64],
    divisor: float | np.floating,
) -> None:
    """accumulator /= divisor; where that sum overflowed from finite inputs, the shadow's mean.

    An element whose accumulator is not finite but whose shadow is had only
    finite inputs: its float32 (or float64) sum overflowed. Its mean is taken
    from the shadow and rounded to the accumulator's dtype (inf only when the
    mean itself is not representable). Every other element keeps the usual
    quotient, bit for bit.
    """
    with np.errstate(over="ignore", invalid="ignore"):
        accumulator /= divisor
        overflowed = ~np.isfinite(accumulator) & np.isfinite(shadow)
        if overflowed.any():
            means = shadow[overflowed] / divisor / _SHADOW_SCALE
            accumulator[overflowed] = means.astype(accumulator.dtype)
