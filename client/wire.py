"""Wire-format helpers shared by the client and the coordinator.

Tensors travel as raw little-endian bytes cut into fixed-size chunks: chunk k
of a buffer covers bytes [k * chunk_bytes, min((k + 1) * chunk_bytes, size)).
Both ends derive chunk boundaries from the same rule, so the coordinator can
check every offset and length and reduce chunk by chunk as they complete.

Reductions accumulate in float32 (float64 for float64 buckets): 16-bit wire
types are widened before summing, as the protocol requires.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import numpy.typing as npt
from gradsync.v1 import gradsync_pb2 as pb

#: Default chunk size: 1-4 MiB messages move fastest through Python gRPC.
DEFAULT_CHUNK_BYTES = 1 << 20

#: Room for the non-payload fields of a message, added to the chunk size when
#: setting gRPC message size limits.
HEADER_SLACK_BYTES = 64 << 10

#: Floating types: the only ones a gradient bucket may have.
REDUCIBLE_DTYPES = frozenset(
    {pb.DTYPE_FLOAT32, pb.DTYPE_FLOAT64, pb.DTYPE_FLOAT16, pb.DTYPE_BFLOAT16}
)

_ITEMSIZE: dict[int, int] = {
    pb.DTYPE_FLOAT32: 4,
    pb.DTYPE_FLOAT64: 8,
    pb.DTYPE_FLOAT16: 2,
    pb.DTYPE_BFLOAT16: 2,
    pb.DTYPE_INT64: 8,
    pb.DTYPE_INT32: 4,
    pb.DTYPE_INT16: 2,
    pb.DTYPE_INT8: 1,
    pb.DTYPE_UINT8: 1,
    pb.DTYPE_BOOL: 1,
}


def dtype_name(dtype: int) -> str:
    """Short human name of a wire dtype ("float32"), for error messages."""
    if dtype in _ITEMSIZE:
        name: str = pb.DType.Name(dtype)
        return name.removeprefix("DTYPE_").lower()
    return f"<unknown dtype {dtype}>"


def is_supported_dtype(dtype: int) -> bool:
    """True when `dtype` is a DType value this version knows (parameters or buffers)."""
    return dtype in _ITEMSIZE


def itemsize(dtype: int) -> int:
    """Bytes per element of a wire dtype.

    Raises:
        ValueError: for an unknown or unspecified dtype.
    """
    try:
        return _ITEMSIZE[dtype]
    except KeyError:
        raise ValueError(f"unsupported dtype {dtype_name(dtype)}") from None


def chunk_spans(total_bytes: int, chunk_bytes: int) -> Iterator[tuple[int, int]]:
    """Yield (offset, length) of every chunk of a `total_bytes` buffer."""
    for offset in range(0, total_bytes, chunk_bytes):
        yield offset, min(chunk_bytes, total_bytes - offset)


def num_chunks(total_bytes: int, chunk_bytes: int) -> int:
    """How many chunks a `total_bytes` buffer is cut into."""
    return -(-total_bytes // chunk_bytes)


def expected_chunk_length(total_bytes: int, chunk_bytes: int, offset: int) -> int:
    """Length the chunk starting at `offset` must have (offset must be aligned)."""
    return min(chunk_bytes, total_bytes - offset)


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
