"""Wire bytes <-> accumulation arrays for the coordinator's averaging (pure numpy).

A chunk is summed in float32 (float64 for a float64 bucket) whatever dtype it
travels in (`aggregation`). These helpers decode a payload into that
accumulation dtype and encode an accumulator back into a wire dtype, with as
few passes over the bytes as numpy allows: a float32/float64 payload is read
in place, an average that needs no cast is handed out as a view, and the
average's divide writes straight into a float16 reply.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
from gradsync_proto.dtypes import dtype_name
from gradsync_proto.v1 import gradsync_pb2 as pb

__all__ = [
    "WIDE",
    "average_bytes",
    "decoded",
    "from_accumulator",
    "owned_accumulator",
    "scaled_accumulator",
    "to_accumulator",
]


#: Dtypes that are their own accumulation dtype (read in place), with their numpy spelling.
WIDE: dict[int, str] = {pb.DTYPE_FLOAT32: "<f4", pb.DTYPE_FLOAT64: "<f8"}


def to_accumulator(payload: bytes | memoryview, dtype: int) -> npt.NDArray[np.floating]:
    """Decode raw bytes into a fresh, writable accumulation array (fp32 or fp64)."""
    if dtype in WIDE:
        return np.frombuffer(payload, dtype=WIDE[dtype]).copy()
    if dtype == pb.DTYPE_FLOAT16:
        return np.frombuffer(payload, dtype="<f2").astype(np.float32)
    if dtype == pb.DTYPE_BFLOAT16:
        # bfloat16 is the upper half of a float32: shift the bits into place
        # (widened and shifted in one ufunc: no temporary).
        bits = np.frombuffer(payload, dtype="<u2")
        widened: npt.NDArray[np.uint32] = np.left_shift(bits, np.uint32(16), dtype=np.uint32)
        return widened.view(np.float32)
    raise ValueError(f"unsupported dtype {dtype_name(dtype)}")


def decoded(payload: bytes | memoryview, dtype: int) -> npt.NDArray[np.floating]:
    """The payload's values in the accumulation dtype, to be read only: a view of
    a float32/float64 payload (no copy), a fresh widened array for 16-bit."""
    if dtype in WIDE:
        return np.frombuffer(payload, dtype=WIDE[dtype])
    return to_accumulator(payload, dtype)


def _owned(payload: bytes | memoryview, dtype: int) -> bool:
    """Whether the payload is a float32/float64 buffer the coordinator may sum into."""
    return isinstance(payload, memoryview) and not payload.readonly and dtype in WIDE


def owned_accumulator(payload: bytes | memoryview, dtype: int) -> npt.NDArray[np.floating]:
    """A writable accumulation array of the payload's values, copying only if it must.

    The payload itself when the coordinator owns it writable (`aggregation.examine`'s
    aligned copy of a misaligned payload, an int8 chunk dequantized, a chunk read from a
    same-host segment into a fresh buffer, `gradsync_server.rpc.segments`), saving a copy
    of every byte; else a fresh decode (a payload off the wire is a read-only view
    into its message; a 16-bit one is widened into a new array anyway).
    """
    if _owned(payload, dtype):
        return decoded(payload, dtype)
    return to_accumulator(payload, dtype)


def scaled_accumulator(
    payload: bytes | memoryview, dtype: int, factor: float
) -> npt.NDArray[np.floating]:
    """`owned_accumulator(payload, dtype) * factor` (the factor rounded to the accumulation
    dtype), in one pass: a read-only float32/float64 payload is multiplied straight into
    a fresh array instead of being copied and then multiplied in place. The caller
    decides what overflow warns (`np.errstate`)."""
    if dtype in WIDE and not _owned(payload, dtype):
        values = decoded(payload, dtype)
        product: npt.NDArray[np.floating] = np.multiply(values, values.dtype.type(factor))
        return product
    values = owned_accumulator(payload, dtype)
    values *= values.dtype.type(factor)
    return values


def from_accumulator(values: npt.NDArray[np.floating], dtype: int) -> memoryview:
    """Raw bytes of the wire dtype for an accumulation array (a view when no cast is needed)."""
    if dtype in WIDE:
        return values.astype(WIDE[dtype], copy=False).data.cast("B")
    if dtype == pb.DTYPE_FLOAT16:
        return values.astype("<f2").data.cast("B")
    if dtype == pb.DTYPE_BFLOAT16:
        bits = values.astype(np.float32, copy=False).view(np.uint32)
        # Round to nearest, ties to even, as torch does when narrowing to bf16.
        rounding = ((bits >> 16) & 1) + np.uint32(0x7FFF)
        return ((bits + rounding) >> 16).astype("<u2").data.cast("B")
    raise ValueError(f"unsupported dtype {dtype_name(dtype)}")


def average_bytes(
    accumulator: npt.NDArray[np.floating], divisor: float | np.floating, dtype: int
) -> memoryview:
    """`from_accumulator(accumulator / divisor, dtype)`, bit for bit, consuming `accumulator`.

    The same float operations as dividing in place and then converting, in
    fewer passes: a float16 reply takes the quotient straight from the divide
    (numpy divides in the accumulator's dtype and rounds each quotient to
    float16, as `astype` would); a bfloat16 reply rounds the quotient's bits in
    the accumulator itself, which the caller hands over (its contents are
    undefined afterwards), and in the reply's array, instead of in five fresh
    temporaries.
    """
    # Fused only where numpy divides in the accumulator's dtype, as `/=` does: a
    # float64 divisor would promote the quotient (and round it twice in place).
    same_dtype = not isinstance(divisor, np.generic) or divisor.dtype == accumulator.dtype
    if dtype == pb.DTYPE_FLOAT16 and accumulator.dtype == np.float32 and same_dtype:
        reply = np.empty(len(accumulator), dtype="<f2")
        np.divide(accumulator, divisor, out=reply, dtype=accumulator.dtype, casting="same_kind")
        return reply.data.cast("B")
    accumulator /= divisor
    if dtype == pb.DTYPE_BFLOAT16 and accumulator.dtype == np.float32:
        bits = accumulator.view(np.uint32)
        # Round to nearest, ties to even, as `from_accumulator`: (bits + 0x7FFF + lsb) >> 16,
        # lsb the kept half's lowest bit. The rounding term (0x7FFF or 0x8000) fits 16
        # bits, so it is formed in the reply's own array, which then takes the result.
        reply = np.right_shift(
            bits, np.uint32(16), dtype=np.uint32, out=np.empty(len(bits), "<u2"), casting="unsafe"
        )
        reply &= np.uint16(1)
        reply += np.uint16(0x7FFF)
        bits += reply  # modulo 2**32, as the uint32 sum in `from_accumulator`
        bits >>= 16
        np.copyto(reply, bits, casting="unsafe")
        return reply.data.cast("B")
    return from_accumulator(accumulator, dtype)
