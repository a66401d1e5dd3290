"""An int8 chunk becomes float32 the moment it is accepted, with its own scale (pure).

An int8 payload (DiLoCo's pseudo-gradients of a float32 bucket) means
nothing without its chunk's `scale`, so it is dequantized here, once the
chunk's offset and length are known to be right and before it is classified,
budgeted or summed (`OpenStep._fold`): from then on it is a float32
contribution like any other. The non-finite check sees the values the sum
will see (a NaN or Inf scale gives NaN, and the `--nonfinite` policy reports
or aborts on it, naming the rank, as for a float32 NaN; a huge finite scale
that overflows is caught the same way), the byte budget holds what is really
held (four bytes per element), and the reduction needs no notion of scales.

Only an int8 payload may carry a scale: a scale on any other chunk is a
malformed message, as is a negative one (`gradsync_proto.int8_wire.scale_problem`).
"""

from __future__ import annotations

from gradsync_proto import dtypes, int8_wire
from gradsync_proto.codec import ChunkHeader
from gradsync_proto.codes import Code
from gradsync_proto.v1 import gradsync_pb2 as pb

from gradsync_server.errors import RejectedMessage

__all__ = ["contribution_of"]


def contribution_of(
    rank: int, chunk: ChunkHeader, payload: memoryview, wire_dtype: int
) -> tuple[memoryview, int]:
    """The chunk's payload as it is to be summed, and its dtype.

    Args:
        payload: the chunk's bytes, already checked against the chunk grid.
        wire_dtype: the dtype it was sent in (checked by `check_wire_dtype`).

    Returns:
        (payload, wire_dtype) as they are, or for int8 the float32 values
        (`int8_wire.dequantize`, a fresh array) and DTYPE_FLOAT32.

    Raises:
        RejectedMessage: INVALID_ARGUMENT for a scale on a chunk that is not int8,
            or a negative scale, naming rank, step, bucket and offset.
    """
    where = f"bucket {chunk.bucket_index} of step {chunk.step} at offset {chunk.offset}"
    if wire_dtype != pb.DTYPE_INT8:
        if chunk.scale != 0:  # NaN included
            raise _refused(
                chunk,
                f"rank {rank} sent {where} as {dtypes.dtype_name(wire_dtype)} with a scale "
                f"({chunk.scale!r}); only an int8 payload carries one",
            )
        return payload, wire_dtype
    problem = int8_wire.scale_problem(chunk.scale)
    if problem is not None:
        raise _refused(chunk, f"rank {rank} sent {where} as int8 with {problem}")
    values = int8_wire.dequantize(payload, chunk.scale)
    return values.data.cast("B"), pb.DTYPE_FLOAT32


def _refused(chunk: ChunkHeader, message: str) -> RejectedMessage:
    return RejectedMessage(
        Code.INVALID_ARGUMENT, message, step=chunk.step, bucket_index=chunk.bucket_index
    )
