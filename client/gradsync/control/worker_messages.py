"""What the worker's Sync stream sends: queued uploads cut into serialized WorkerMessages.

The transport's outgoing queue holds whole uploads (a checkpoint, rank 0's
state blob, a collective's input, a bucket's byte range) or ready protobuf
messages; `upload_messages` turns one into the chunks that go on the wire,
sized by the Welcome's chunk size. Kept apart from `gradsync.path.transport`
(the stream's lifecycle on its event loop) because this is pure, grpc-free
message building that unit tests check on its own, like
`gradsync.path.bucket_uploads`, which cuts the bucket ranges it dispatches to.
Everything here runs on the transport's loop thread, and imports neither
grpc nor asyncio.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
from gradsync_proto import chunking
from gradsync_proto.v1 import gradsync_pb2 as pb

from gradsync.path.bucket_uploads import RangeUpload, UploadEvent, range_messages


@dataclass
class StateUpload:
    """Rank 0's state blob, broadcast to every rank at start (or after a rejoin)."""

    blob: npt.NDArray[np.uint8]


@dataclass
class CheckpointUpload:
    """A checkpoint of `step` for the store, or (`heal`) this rank's state for a rejoining rank."""

    step: int
    blob: bytes
    heal: bool = False


@dataclass
class CollectiveUpload:
    """One rank's input to collective number `sequence` of the job."""

    sequence: int
    op: int
    dtype: int
    root: int
    payload: npt.NDArray[np.uint8]


#: What the outgoing queue carries besides the transport's own markers.
Upload = StateUpload | CheckpointUpload | CollectiveUpload | RangeUpload | pb.WorkerMessage


def upload_messages(
    item: Upload, chunk_bytes: int, epoch: int, on_event: UploadEvent
) -> Iterator[bytes]:
    """The serialized WorkerMessages that carry `item`, chunk by chunk.

    Args:
        item: one entry of the outgoing queue.
        chunk_bytes: the most payload bytes per chunk (the Welcome's).
        epoch: the membership epoch bucket chunks are stamped with.
        on_event: bucket "upload_start" / "upload_end" events (see `range_messages`).
    """
    if isinstance(item, CheckpointUpload):
        view = memoryview(item.blob)
        for offset, length in chunking.chunk_spans(len(view), chunk_bytes):
            piece = pb.CheckpointChunk(
                step=item.step,
                offset=offset,
                total_bytes=len(view),
                payload=bytes(view[offset : offset + length]),
                heal=item.heal,
            )
            yield pb.WorkerMessage(checkpoint=piece).SerializeToString()
    elif isinstance(item, StateUpload):
        view = memoryview(item.blob.data)
        for offset, length in chunking.chunk_spans(len(view), chunk_bytes):
            payload = view[offset : offset + length].tobytes()
            chunk = pb.StateChunk(offset=offset, payload=payload)
            yield pb.WorkerMessage(state=chunk).SerializeToString()
    elif isinstance(item, CollectiveUpload):
        yield from collective_chunks(item, chunk_bytes)
    elif isinstance(item, RangeUpload):
        yield from range_messages(item, chunk_bytes, epoch, on_event)
    else:
        yield item.SerializeToString()


def check_collective_input(op: int, payload: npt.NDArray[np.uint8]) -> None:
    """Check a collective's op and input before it is numbered and queued.

    Raises:
        ValueError: `op` is not a CollectiveOp, or `payload` is not a 1-D uint8 array.
    """
    if op not in pb.CollectiveOp.values() or op == pb.COLLECTIVE_OP_UNSPECIFIED:
        raise ValueError(f"unknown collective op {op}")
    if payload.dtype != np.uint8 or payload.ndim != 1:
        raise ValueError(
            f"a collective's payload must be a 1-D uint8 array, got {payload.dtype} "
            f"with shape {payload.shape}"
        )


def collective_chunks(upload: CollectiveUpload, chunk_bytes: int) -> list[bytes]:
    """A collective's input as serialized WorkerMessages; an empty input is one empty chunk."""
    view = memoryview(upload.payload.data)
    total = len(view)
    spans = list(chunking.chunk_spans(total, chunk_bytes)) or [(0, 0)]
    return [
        pb.WorkerMessage(
            collective=pb.CollectiveChunk(
                sequence=upload.sequence,
                op=upload.op,  # type: ignore[arg-type]  # an int checked against CollectiveOp
                dtype=upload.dtype,  # type: ignore[arg-type]  # a DType value
                total_bytes=total,
                offset=offset,
                payload=view[offset : offset + length].tobytes(),
                root=upload.root,
            )
        ).SerializeToString()
        for offset, length in spans
    ]
