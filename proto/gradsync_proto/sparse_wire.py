"""The sparse 2-bit wire: a chunk's top-k elements, 2 bits each, with one float32 step.

`gradsync.DiLoCo(wire_dtype=gradsync.SparseWire(density=...))` sends each
chunk of a float32 bucket (the int8 wire's grid: one element per int8 byte,
each shard's range chunked on its own) as its k largest elements by
magnitude, quantized to four levels; the coordinator answers with the same
form (`ENCODING_TOPK2`). Both ends share this module.

The rule, for a chunk of n float32 elements x:

- k = min(n, ceil(density * n)) (at least one element of a non-empty chunk);
- the k elements of largest |x|, ties going to the lowest index (so the
  choice is a function of the values alone, and a simulation can match it);
- step d = max|x_selected| / 3 in float32 (one rounding); the four levels are
  {-3, -1, +1, +3} * d: a uniform quantizer whose largest level is the
  largest selected magnitude;
- code c = clip(rint((x / d + 3) / 2), 0, 3) in float32 (rint: ties to even);
  the element stands for q = 2c - 3, an int8;
- the decoded chunk is the int8 array q (0 off the selection) and d, and its
  values are q * d in float32 (`int8_wire.dequantize`, one rounding): the
  very values the coordinator sums and a worker's error feedback subtracts;
- a chunk whose selection is all zero, or whose d underflows to 0, sends
  k = 0 and d = 0 (error feedback carries it); a chunk holding NaN or Inf
  sends k = 0 and d = NaN: it decodes to NaN everywhere, a non-finite
  contribution for the coordinator's `--nonfinite` policy, as on the int8 wire.

The payload, little-endian:

    form (1 byte: 0 = gap varints, 1 = bitmap) | n (varint) | k (varint) | d (float32)
    | indices | codes

Gap varints: k unsigned LEB128 varints, the first index, then each index
minus the previous minus 1 (so indices are strictly increasing by
construction). Bitmap: ceil(n / 8) bytes, bit i (LSB first) set for each
selected index, exactly k bits set and no bit at or past n. The encoder
picks the shorter form (gap varints on a tie). Codes: ceil(k / 4) bytes,
four 2-bit codes per byte, LSB first, the padding bits 0. The payload is
exactly this long: a byte more or less is refused.

`decode` refuses anything else with a `SparseWireError` that says what and
both values; `claimed_length` reads n alone, for the caller to check against
its chunk grid before anything is decoded. Pure numpy, no torch.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

__all__ = [
    "FORM_BITMAP",
    "FORM_GAPS",
    "MAX_DENSITY",
    "SparseChunk",
    "SparseWireError",
    "claimed_length",
    "decode",
    "density_problem",
    "encode",
    "encode_bucket",
    "select_count",
]

Floats = npt.NDArray[np.float32]
Int8s = npt.NDArray[np.int8]

#: Index forms.
FORM_GAPS = 0
FORM_BITMAP = 1
#: The densest selection the wire serves (denser, a 2-bit dense chunk would be cheaper).
MAX_DENSITY = 0.25
_THREE = np.float32(3)
_TWO = np.float32(2)
_FLOAT = struct.Struct("<f")
#: The longest varint read: 5 bytes hold 35 bits, far above any chunk's elements.
_MAX_VARINT_BYTES = 5


class SparseWireError(ValueError):
    """A sparse chunk's bytes are not what the rule (module docstring) allows."""


@dataclass(frozen=True)
class SparseChunk:
    """One decoded chunk: its int8 levels q (0 off the selection) and its float32 step."""

    q: Int8s
    step: float
    #: How many elements were sent (k).
    count: int

    def values(self) -> Floats:
        """q * step in float32 (a NaN/Inf step gives NaN everywhere)."""
        with np.errstate(over="ignore", invalid="ignore"):
            return self.q.astype(np.float32) * np.float32(self.step)


def density_problem(density: object) -> str | None:
    """Why `density` cannot be a sparse wire's density, or None."""
    if isinstance(density, bool) or not isinstance(density, int | float):
        return f"a density must be a number, got {density!r}"
    if not (math.isfinite(density) and 0 < density <= MAX_DENSITY):
        return f"a density must be in (0, {MAX_DENSITY}], got {density!r}"
    return None


def select_count(n: int, density: float) -> int:
    """k for a chunk of `n` elements: min(n, ceil(density * n))."""
    return min(n, math.ceil(density * n))


def _top_indices(magnitude: Floats, k: int) -> npt.NDArray[np.int64]:
    """Indices of the k largest magnitudes, ties to the lowest index, ascending."""
    n = magnitude.size
    if k >= n:
        return np.arange(n, dtype=np.int64)
    threshold = np.partition(magnitude, n - k)[n - k]
    above = np.flatnonzero(magnitude > threshold)
    ties = np.flatnonzero(magnitude == threshold)[: k - above.size]
    return np.sort(np.concatenate([above, ties]))


def _varint_sizes(values: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
    sizes = np.ones(values.size, dtype=np.int64)
    for bits in (7, 14, 21, 28):
        sizes += values >= (1 << bits)
    return sizes


def _varints(values: npt.NDArray[np.int64]) -> bytes:
    """Unsigned LEB128 of every value (each < 2**35), concatenated."""
    sizes = _varint_sizes(values)
    out = np.empty(int(sizes.sum()), dtype=np.uint8)
    ends = np.cumsum(sizes)
    starts = ends - sizes
    for byte in range(_MAX_VARINT_BYTES):
        has = sizes > byte
        groups = (values[has] >> (7 * byte)) & 0x7F
        more = (sizes[has] > byte + 1).astype(np.int64) << 7
        out[starts[has] + byte] = groups | more
    return out.tobytes()


def _varint(value: int) -> bytes:
    return _varints(np.array([value], dtype=np.int64))


def encode(values: Floats, density: float) -> tuple[bytes, SparseChunk]:
    """A chunk's sparse payload and what it decodes to (see the module docstring)."""
    n = values.size
    with np.errstate(invalid="ignore"):
        finite = bool(np.isfinite(values).all()) if n else True
    if not finite:
        return _payload(n, np.zeros(0, np.int64), np.zeros(0, np.uint8), math.nan), SparseChunk(
            np.zeros(n, np.int8), math.nan, 0
        )
    magnitude = np.abs(values)
    indices = _top_indices(magnitude, select_count(n, density))
    selected = values[indices]
    step = np.float32(np.max(magnitude[indices])) / _THREE if indices.size else np.float32(0)
    if step == 0:
        empty = np.zeros(0, np.int64)
        return _payload(n, empty, np.zeros(0, np.uint8), 0.0), SparseChunk(
            np.zeros(n, np.int8), 0.0, 0
        )
    codes = np.clip(np.rint((selected / step + _THREE) / _TWO), 0, 3).astype(np.uint8)
    q = np.zeros(n, dtype=np.int8)
    q[indices] = codes.astype(np.int8) * 2 - 3
    return _payload(n, indices, codes, float(step)), SparseChunk(q, float(step), indices.size)


def encode_bucket(
    values: Floats, spans: list[tuple[int, int]], density: float
) -> tuple[dict[int, bytes], Int8s, dict[int, float]]:
    """Every chunk of a bucket: {offset: payload}, the bucket's q and {offset: step}.

    Raises:
        ValueError: the spans do not cover `values` exactly once.
    """
    payloads: dict[int, bytes] = {}
    steps: dict[int, float] = {}
    q = np.zeros(values.size, dtype=np.int8)
    covered = 0
    for offset, length in spans:
        payloads[offset], chunk = encode(values[offset : offset + length], density)
        q[offset : offset + length] = chunk.q
        steps[offset] = chunk.step
        covered += length
    if covered != values.size:
        raise ValueError(f"the chunk grid covers {covered} of the bucket's {values.size} elements")
    return payloads, q, steps


def _payload(
    n: int, indices: npt.NDArray[np.int64], codes: npt.NDArray[np.uint8], step: float
) -> bytes:
    k = indices.size
    gaps = np.diff(indices, prepend=-1) - 1 if k else indices
    gap_bytes = int(_varint_sizes(gaps).sum())
    bitmap_bytes = (n + 7) // 8
    if gap_bytes <= bitmap_bytes:
        form, index_bytes = FORM_GAPS, _varints(gaps)
    else:
        bits = np.zeros(bitmap_bytes * 8, dtype=np.uint8)
        bits[indices] = 1
        form, index_bytes = FORM_BITMAP, np.packbits(bits, bitorder="little").tobytes()
    padded = np.zeros(4 * ((k + 3) // 4), dtype=np.uint8)
    padded[:k] = codes
    packed = padded.reshape(-1, 4) << np.array([0, 2, 4, 6], dtype=np.uint8)
    code_bytes: bytes = np.bitwise_or.reduce(packed, axis=1).astype(np.uint8).tobytes()
    header = bytes([form]) + _varint(n) + _varint(k) + _FLOAT.pack(step)
    return header + index_bytes + code_bytes


def _read_varint(data: npt.NDArray[np.uint8], position: int, what: str) -> tuple[int, int]:
    value = 0
    for size in range(_MAX_VARINT_BYTES):
        if position + size >= data.size:
            raise SparseWireError(f"the payload ends inside {what} ({data.size} bytes)")
        byte = int(data[position + size])
        value |= (byte & 0x7F) << (7 * size)
        if byte < 0x80:
            return value, position + size + 1
    raise SparseWireError(f"{what} runs past {_MAX_VARINT_BYTES} bytes")


def claimed_length(payload: bytes | memoryview) -> int:
    """The element count n a sparse payload claims (checked against the grid by the caller).

    Raises:
        SparseWireError: the payload is too short to hold its header, or the form is unknown.
    """
    data = np.frombuffer(payload, dtype=np.uint8)
    if data.size < 1 or int(data[0]) not in (FORM_GAPS, FORM_BITMAP):
        form = "no byte" if data.size < 1 else f"form {int(data[0])}"
        raise SparseWireError(f"a sparse chunk starts with its index form 0 or 1, got {form}")
    n, _ = _read_varint(data, 1, "the element count")
    return n


def decode(payload: bytes | memoryview, n: int) -> SparseChunk:
    """Decode and check a sparse chunk of `n` elements (the grid's, not the claim's).

    Raises:
        SparseWireError: any departure from the rule, saying what and both values.
    """
    data = np.frombuffer(payload, dtype=np.uint8)
    claimed = claimed_length(payload)
    if claimed != n:
        raise SparseWireError(f"the chunk claims {claimed} elements, the grid says {n}")
    form = int(data[0])
    _, position = _read_varint(data, 1, "the element count")
    k, position = _read_varint(data, position, "the selected count")
    if k > n:
        raise SparseWireError(f"the chunk selects {k} elements of its {n}")
    if position + 4 > data.size:
        raise SparseWireError(f"the payload ends inside the step ({data.size} bytes)")
    (step,) = _FLOAT.unpack(data[position : position + 4].tobytes())
    position += 4
    if step < 0:
        raise SparseWireError(f"the step is negative ({step!r}); a step is max|x| / 3")
    if k and not (math.isfinite(step) and step > 0):
        raise SparseWireError(f"{k} elements are sent with the step {step!r}")
    if form == FORM_GAPS:
        indices, position = _gap_indices(data, position, k, n)
    else:
        indices, position = _bitmap_indices(data, position, k, n)
    code_bytes = (k + 3) // 4
    if data.size != position + code_bytes:
        raise SparseWireError(
            f"the payload has {data.size} bytes, its {k} elements need {position + code_bytes}"
        )
    codes = np.unpackbits(data[position:], bitorder="little").reshape(-1, 2)
    levels = (codes[:, 0] | (codes[:, 1] << 1)).astype(np.int8)
    if levels[k:].any():
        raise SparseWireError("the padding bits after the last code are not 0")
    q = np.zeros(n, dtype=np.int8)
    q[indices] = levels[:k] * 2 - 3
    return SparseChunk(q, step, k)


def _gap_indices(
    data: npt.NDArray[np.uint8], position: int, k: int, n: int
) -> tuple[npt.NDArray[np.int64], int]:
    if k == 0:
        return np.zeros(0, np.int64), position
    rest = data[position:]
    ends = np.flatnonzero(rest < 0x80)
    if ends.size < k:
        raise SparseWireError(f"the payload holds {ends.size} index varints, the chunk says {k}")
    region = rest[: int(ends[k - 1]) + 1]
    starts = np.concatenate([[0], ends[: k - 1] + 1])
    sizes = ends[:k] + 1 - starts
    if int(sizes.max()) > _MAX_VARINT_BYTES:
        raise SparseWireError(f"an index gap runs past {_MAX_VARINT_BYTES} bytes")
    places = np.arange(region.size) - np.repeat(starts, sizes)
    parts = (region.astype(np.int64) & 0x7F) << (7 * places)
    gaps = np.add.reduceat(parts, starts)
    indices = np.cumsum(gaps + 1) - 1
    if int(indices[-1]) >= n:
        raise SparseWireError(f"an index reaches {int(indices[-1])}, the chunk has {n} elements")
    return indices, position + region.size


def _bitmap_indices(
    data: npt.NDArray[np.uint8], position: int, k: int, n: int
) -> tuple[npt.NDArray[np.int64], int]:
    size = (n + 7) // 8
    if position + size > data.size:
        raise SparseWireError(f"the payload ends inside the bitmap of {size} bytes")
    bits = np.unpackbits(data[position : position + size], bitorder="little")
    if bits[n:].any():
        raise SparseWireError(f"the bitmap sets a bit at or past the chunk's {n} elements")
    indices = np.flatnonzero(bits).astype(np.int64)
    if indices.size != k:
        raise SparseWireError(f"the bitmap sets {indices.size} bits, the chunk says {k}")
    return indices, position + size
