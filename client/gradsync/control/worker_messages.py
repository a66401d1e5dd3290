"""What the worker's Sync stream sends: queued uploads cut into serialized WorkerMessages.

The transport's outgoing queue holds whole uploads (a checkpoint, rank 0's
state blob, a collective's input, a bucket's byte range) or ready protobuf
messages; `upload_messages` turns one into the chunks that go on the wire,
sized by the Welcome's chunk size. The three blob uploads are cut by the one
`gradsync_proto.blobs.blob_chunks` (the coordinator cuts its resume and
collective-result blobs with it too); each says only how one chunk is
wrapped. Kept apart from `gradsync.control.transport`
(the stream's lifecycle on its event loop) because this is pure, grpc-free
message building that unit tests check on its own, like
`gradsync.path.bucket_uploads`, which cuts the bucket ranges it dispatches to.
Everything here runs on the transport's loop thread, and imports neither
grpc nor asyncio.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import numpy.typing as npt
from gradsync_proto.blobs import blob_chunks
from gradsync_proto.v1 import gradsync_pb2 as pb

from gradsync.path.bucket_uploads import RangeUpload, UploadEvent, range_messages


@dataclass
class StateUpload:
    """Rank 0's state blob, broadcast to every rank at start (or after a rejoin)."""

    blob: npt.NDArray[np.uint8]
    #: An empty state is no chunk at all (the coordinator expects none).
    empty_chunk: ClassVar[bool] = False

    def data(self) -> memoryview:
        return memoryview(self.blob.data)

    def message(self, offset: int, payload: bytes) -> pb.WorkerMessage:
        return pb.WorkerMessage(state=pb.StateChunk(offset=offset, payload=payload))


@dataclass
class CheckpointUpload:
    """A checkpoint of `step` for the store, or (`heal`) this rank's state for a rejoining rank."""

    step: int
    blob: bytes | bytearray
    heal: bool = False
    empty_chunk: ClassVar[bool] = False

    def data(self) -> memoryview:
        return memoryview(self.blob)

    def message(self, offset: int, payload: bytes) -> pb.WorkerMessage:
        piece = pb.CheckpointChunk(
            step=self.step,
            offset=offset,
            total_bytes=len(self.blob),
            payload=payload,
            heal=self.heal,
        )
        return pb.WorkerMessage(checkpoint=piece)


@dataclass
class CollectiveUpload:
    """One rank's input to collective number `sequence` of the job."""

    sequence: int
    op: int
    dtype: int
    root: int
    payload: npt.NDArray[np.uint8]
    #: Further fields every chunk carries (reduce op, all-to-all splits), or None.
    template: pb.CollectiveChunk | None = None
    #: An empty input is one empty chunk: the coordinator counts every rank's input.
    empty_chunk: ClassVar[bool] = True

    def data(self) -> memoryview:
        return memoryview(self.payload.data)

    def message(self, offset: int, payload: bytes) -> pb.WorkerMessage:
        piece = pb.CollectiveChunk(
            sequence=self.sequence,
            op=self.op,  # type: ignore[arg-type]  # an int checked against CollectiveOp
            dtype=self.dtype,  # type: ignore[arg-type]  # a DType value
            total_bytes=self.payload.nbytes,
            offset=offset,
            payload=payload,
            root=self.root,
        )
        if self.template is not None:
            piece.MergeFrom(self.template)
        return pb.WorkerMessage(collective=piece)


#: An upload of one byte blob, cut by `blob_messages`.
BlobUpload = StateUpload | CheckpointUpload | CollectiveUpload
#: What the outgoing queue carries besides the transport's own markers.
Upload = BlobUpload | RangeUpload | pb.WorkerMessage


def blob_messages(upload: BlobUpload, chunk_bytes: int) -> Iterator[bytes]:
    """A blob upload as serialized WorkerMessages, in order, cut by the wire rule."""
    for offset, payload in blob_chunks(upload.data(), chunk_bytes, empty_chunk=upload.empty_chunk):
        yield upload.message(offset, payload).SerializeToString()


def upload_messages(
    item: Upload, chunk_bytes: int, epoch: int, on_event: UploadEvent
) -> Iterator[bytes]:
    """The serialized WorkerMessages that carry `item`, chunk by chunk.

    Args:
        item: one entry of the outgoing queue.
        chunk_bytes: the most payload bytes per chunk (the Welcome's).
        epoch: the membership epoch bucket chunks are stamped with.
        on_event: bucket "upload_start" / "upload_end" events (see `range_messages`);
            a collective's "collective_upload_start" before its first chunk is handed
            over and "collective_upload_end" once its last one was taken (with the
            collective's number in place of the step, and bucket -1).
    """
    if isinstance(item, CollectiveUpload):
        on_event("collective_upload_start", item.sequence, -1)
        yield from blob_messages(item, chunk_bytes)
        on_event("collective_upload_end", item.sequence, -1)
    elif isinstance(item, StateUpload | CheckpointUpload):
        yield from blob_messages(item, chunk_bytes)
    elif isinstance(item, RangeUpload):
        yield from range_messages(item, chunk_bytes, epoch, on_event)
    else:
        yield item.SerializeToString()


#: Items up to this many payload bytes are written by the thread that sends them
#: (on a plain frame connection): a step of a small model crosses no thread on its
#: way out. Larger ones go to the socket's writer thread, so that a hook never
#: spends backward's time copying a large bucket into the kernel.
INLINE_BYTES = 1 << 20


def written_inline(item: object) -> bool:
    """Whether the sending thread writes `item` itself (`FrameDiscovery`'s `inline`)."""
    if isinstance(item, RangeUpload):
        return item.hi - item.lo <= INLINE_BYTES
    if isinstance(item, CollectiveUpload):
        return int(item.payload.nbytes) <= INLINE_BYTES
    return not isinstance(item, StateUpload | CheckpointUpload)


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
