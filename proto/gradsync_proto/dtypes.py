"""Wire dtypes: which tensor element types travel, and how many bytes each takes.

Both ends name dtypes by the contract's `DType` enum, so a coordinator that
has never imported torch can size, check and describe every buffer. Only
floating types may be reduced; integer and bool types travel in broadcasts
(buffers such as BatchNorm's `num_batches_tracked`).
"""

from __future__ import annotations

from gradsync_proto.v1 import gradsync_pb2 as pb

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
