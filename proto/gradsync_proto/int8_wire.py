"""The int8 wire: symmetric quantization with one float32 scale per chunk, at both ends.

DiLoCo's pseudo-gradients may travel as int8, a quarter of float32's bytes.
Every chunk of a float32 bucket's int8 bytes (one byte per element, cut on
the usual grid: each shard's range chunked on its own, `chunking.range_chunk_spans`)
has its own scale,
for two reasons: one large value then costs precision only in its own chunk,
and the scale can travel in that chunk's header (`GradientChunk.scale`), so the
coordinator dequantizes each chunk the moment it arrives, as it widens a 16-bit
one, whatever order the chunks come in and whichever shard holds them.

The rule, which the workers and the coordinator share through this module:

- scale = max|x| / 127 over the chunk's elements, in float32 (one rounding);
- q = round(x / scale), float32 division, ties to even, clipped to [-127, 127]
  (a rounded scale can put the largest element a hair past 127);
- value = q * scale in float32 (one rounding): what the coordinator sums and
  what a worker's error feedback subtracts, so both see the same numbers;
- an all-zero chunk has scale 0 and q = 0, as does one whose max|x| / 127
  underflows to 0 (every |x| below ~2e-43): float32 cannot scale those, and
  error feedback carries them to the next round;
- a chunk holding NaN or Inf has a NaN or Inf scale and q = 0: it dequantizes
  to NaN everywhere, a non-finite contribution for the coordinator's
  `--nonfinite` policy to report (or abort on), as a float32 NaN would be.

Pure numpy, no torch: the coordinator never imports torch.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import numpy as np
import numpy.typing as npt

__all__ = ["QMAX", "dequantize", "dequantize_bucket", "quantize", "quantize_chunk", "scale_problem"]

#: The largest |q|: symmetric, so -128 is never produced (and 0 stays exactly 0).
QMAX = 127
_QMAX32 = np.float32(QMAX)

Floats = npt.NDArray[np.float32]
Int8s = npt.NDArray[np.int8]


def quantize_chunk(values: Floats) -> tuple[Int8s, float]:
    """One chunk's int8 values and scale (see the module docstring for the rule).

    Args:
        values: the chunk's float32 elements (1-D).

    Returns:
        (q, scale): q as int8, the scale as a Python float holding a float32 value.
    """
    if values.size == 0:
        return np.zeros(0, dtype=np.int8), 0.0
    with np.errstate(invalid="ignore"):
        scale = np.float32(np.max(np.abs(values))) / _QMAX32
    if not np.isfinite(scale) or scale == 0:
        return np.zeros(values.size, dtype=np.int8), float(scale)
    steps = np.rint(values / scale)  # rint: round half to even, in float32
    return np.clip(steps, -_QMAX32, _QMAX32).astype(np.int8), float(scale)


def quantize(values: Floats, spans: Iterable[tuple[int, int]]) -> tuple[Int8s, dict[int, float]]:
    """A bucket's int8 values and the scale of each chunk.

    Args:
        values: the bucket's float32 elements (1-D).
        spans: (offset, length) of every chunk, in elements (= int8 bytes): the grid
            the transport cuts the bucket on; together they must cover `values`
            exactly.

    Returns:
        (q, {chunk offset: scale}).

    Raises:
        ValueError: the spans do not cover `values` exactly once.
    """
    q = np.empty(values.size, dtype=np.int8)
    scales: dict[int, float] = {}
    covered = 0
    for offset, length in spans:
        q[offset : offset + length], scales[offset] = quantize_chunk(
            values[offset : offset + length]
        )
        covered += length
    if covered != values.size:
        raise ValueError(f"the chunk grid covers {covered} of the bucket's {values.size} elements")
    return q, scales


def dequantize(payload: bytes | memoryview | Int8s, scale: float) -> Floats:
    """q * scale in float32: the values a chunk of int8 stands for (a fresh array).

    A NaN or Inf scale gives NaN (or Inf where q != 0), which the caller's
    non-finite check sees; a huge finite scale may overflow to Inf, as a sum would.
    """
    q = payload if isinstance(payload, np.ndarray) else np.frombuffer(payload, dtype=np.int8)
    with np.errstate(over="ignore", invalid="ignore"):
        return q.astype(np.float32) * np.float32(scale)


def dequantize_bucket(q: Int8s, scales: Mapping[int, float]) -> Floats:
    """A whole bucket's values, each chunk with its own scale (as `dequantize`, per chunk).

    Args:
        q: the bucket's int8 values.
        scales: {chunk offset: scale} as `quantize` returned them (the chunks tile
            the bucket from offset 0).
    """
    offsets = sorted(scales)
    lengths = np.diff([*offsets, q.size])
    per_element = np.repeat(np.array([scales[o] for o in offsets], dtype=np.float32), lengths)
    with np.errstate(over="ignore", invalid="ignore"):
        return q.astype(np.float32) * per_element


def scale_problem(scale: float) -> str | None:
    """Why `scale` cannot be an int8 chunk's scale, or None (NaN and Inf are allowed).

    A negative scale is no rank's max|x| / 127: it would flip the chunk's signs,
    so it is a malformed message. A non-finite one is data (a rank diverged):
    the coordinator's `--nonfinite` policy decides.
    """
    if scale < 0:
        return f"a negative scale ({scale!r}); a scale is max|x| / 127, never below 0"
    return None
