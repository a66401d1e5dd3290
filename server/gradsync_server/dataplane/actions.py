"""What the job state machine asks the servicer to do, and who the members are.

`Job` methods return lists of actions instead of touching sockets, so the
protocol logic stays testable without gRPC: `Send` a message to ranks,
`Terminate` their streams with a status (and the reason why), `Persist` a checkpoint,
or `PersistOuter`: save a plane's DiLoCo outer state before the actions after it.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

from gradsync_proto.blobs import blob_chunks
from gradsync_proto.codec import ChunkHeader, encode_gradient
from gradsync_proto.codes import Code
from gradsync_proto.v1 import gradsync_pb2 as pb

from gradsync_server.dataplane.outer_snapshot import OuterSnapshot


@dataclass
class SegmentAverage:
    """An averaged chunk for ranks whose upload of it came from their same-host segment.

    The servicer writes `payload` where the upload lay and sends the header only,
    so the bytes are never put into a message; `encoded` serializes the whole
    chunk, once, for a rank whose segment cannot take it after all.
    """

    header: ChunkHeader
    payload: memoryview
    _encoded: bytes | None = field(default=None, repr=False)

    def encoded(self) -> bytes:
        """The chunk as a whole CoordinatorMessage (serialized on first use)."""
        if self._encoded is None:
            self._encoded = encode_gradient(self.header, self.payload)
        return self._encoded


@dataclass(frozen=True)
class ResumeBlob:
    """A state blob (a checkpoint, or a live rank's state for a rank it heals) to send as
    resume chunks, each encoded only when the stream's writer gets to it.

    Queued whole, a state of a few hundred MB would pass any bound on what may wait for
    one worker and drop the very rank it is meant to restore; sent this way, at most one
    chunk per receiving stream exists beside the blob, which the job holds once (bounded
    by --max-checkpoint-mb) for all its receivers.
    """

    step: int
    blob: bytes
    chunk_bytes: int

    def messages(self) -> Iterator[bytes]:
        """The serialized CoordinatorMessages, in order."""
        for offset, payload in blob_chunks(self.blob, self.chunk_bytes):
            chunk = pb.CheckpointChunk(
                step=self.step, offset=offset, total_bytes=len(self.blob), payload=payload
            )
            yield pb.CoordinatorMessage(resume=chunk).SerializeToString()


@dataclass(frozen=True)
class Send:
    """Deliver `message` (a CoordinatorMessage, its serialized bytes, an average for
    same-host segments, or a state blob sent chunk by chunk) to each of `ranks`."""

    ranks: tuple[int, ...]
    message: pb.CoordinatorMessage | bytes | SegmentAverage | ResumeBlob


@dataclass(frozen=True)
class Terminate:
    """End the streams of `ranks` with status `code` and `details`.

    `reason` travels in the StreamEnd sent just before the status, so the
    worker can tell causes apart that share a status code.
    """

    ranks: tuple[int, ...]
    code: Code
    details: str
    reason: pb.EndReason = pb.END_REASON_UNSPECIFIED


@dataclass
class Member:
    """One admitted rank: who it is and where it connects from (liveness is kept apart).

    `session` is the secret issued to this admission (Welcome.session): the
    incarnation is public (Status shows it), so only the session admits the
    rank's data streams to coordinator shards. Never logged or shown.
    """

    rank: int
    incarnation: str
    signature: pb.ModelSignature
    joined_at: float
    peer: str = ""
    session: bytes = field(default=b"", repr=False)
    #: Join.host_id (ranks with the same one form a local group; "" = flat).
    host_id: str = ""
    #: Join.local_world_size (LOCAL_WORLD_SIZE as the launcher told it; 0 = not told).
    local_world_size: int = 0
    #: Join.position: where a live rank rejoining a restarted coordinator stands.
    position: pb.Position | None = None
    #: Join.collective_resume: the collective a process group's rank resumes from.
    collective_resume: int | None = None


@dataclass(frozen=True)
class Persist:
    """Store `blob` as the checkpoint of `step`, then acknowledge to rank 0."""

    step: int
    blob: bytes


@dataclass(frozen=True)
class PersistOuter:
    """Save `snapshot` (plane `shard_index`'s outer state) to the store first.

    The step's last answers are in the same list: they go out only once the save
    returned, so a rank that holds a step's whole answer implies a stored state
    at least that new (what a restarted coordinator's replay relies on).
    """

    snapshot: OuterSnapshot
    shard_index: int


Action = Send | Terminate | Persist | PersistOuter
