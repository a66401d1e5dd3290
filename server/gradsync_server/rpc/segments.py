"""The same-host payload path, coordinator side: registered segments, read and written by offset.

A local leader on the coordinator's own host (same host id, so same network
namespace) registers its group's shared-memory segment once (by descriptor,
on the abstract socket of `gradsync_server.rpc.payload_socket`); from then on its
gradient chunks arrive as header-only messages (`GradientChunk.in_segment`)
naming where their bytes lie in the segment, and the averages go back the
same way. gRPC stays the control channel: ordering, validation, aborts and
faults are exactly those of the TCP path, and the bytes read here are handed
to the same validation and fold (`Job.on_gradient`), so they count against
the same budget.

The coordinator never maps a worker's file: the worker could truncate it,
and touching a mapped page past the end kills the coordinator with SIGBUS.
Chunks are read with `os.preadv` into coordinator-owned buffers (a short read
is the sender's INVALID_ARGUMENT, naming rank, step, bucket, offset and both
lengths) and averages written with `os.pwrite` (a failure ends that rank
alone). A registration is admitted only for a local leader of a running,
unsharded job presenting its session (compared in constant time), and only
for a regular file without a name and open for reading and writing, so that
a read can neither block (a pipe, a FUSE file) nor go to a file other
processes see; each descriptor is closed when its rank leaves or is dropped,
when its job ends, when it is replaced, and when the coordinator stops.
Pure logic on descriptors: no gRPC, no asyncio.
"""

from __future__ import annotations

import dataclasses
import fcntl
import hmac
import logging
import os
import stat
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt
from gradsync_proto import dtypes
from gradsync_proto.codec import ChunkHeader, encode_gradient
from gradsync_proto.codes import Code
from gradsync_proto.payload_socket import Registration
from gradsync_proto.v1 import gradsync_pb2 as pb

from gradsync_server.control.job import Job, JobState
from gradsync_server.errors import RejectedMessage
from gradsync_server.metrics import CoordinatorMetrics

log = logging.getLogger("gradsync.server")

#: Read buffers start on a cache line (and numpy's float views are aligned).
_ALIGN_BYTES = 64


@dataclass
class _Segment:
    """One registered segment: its descriptor and where this step's uploads came from."""

    fd: int
    session: bytes
    #: The step `uploads` belong to (steps are lock-step: older ones are over).
    step: int = -1
    #: (bucket, offset) -> (segment offset, length) of each chunk read this step.
    uploads: dict[tuple[int, int], tuple[int, int]] = field(default_factory=dict)


class SegmentRegistry:
    """The segments registered with this coordinator, by (job id, rank).

    Args:
        max_segments: registrations held at once; beyond it new ones are refused.
        chunk_bytes: the coordinator's chunk size (how long an in-segment chunk is).
        metrics: where the bytes moved through segments are counted.
    """

    def __init__(
        self, max_segments: int, chunk_bytes: int, metrics: CoordinatorMetrics | None = None
    ) -> None:
        self.max_segments = max_segments
        self.chunk_bytes = chunk_bytes
        self._metrics = metrics
        self._segments: dict[tuple[str, int], _Segment] = {}

    def __len__(self) -> int:
        return len(self._segments)

    # ------------------------------------------------------------ registering
    def register(self, registration: Registration, fd: int, expected_session: bytes) -> str | None:
        """Take `fd` for `registration`; return None, or why it is refused (then `fd` is closed).

        Args:
            expected_session: the session the job issued to that rank as its
                local leader (b"" when it is none: refused).

        The descriptor is owned here from this call on, whatever the outcome.
        """
        problem = self._problem(registration, fd, expected_session)
        if problem is not None:
            os.close(fd)
            return problem
        key = (registration.job_id, registration.rank)
        old = self._segments.pop(key, None)
        if old is not None:
            os.close(old.fd)
        self._segments[key] = _Segment(fd, registration.session)
        log.info(
            "job '%s': rank %d moves its gradient payloads through its shared-memory segment",
            registration.job_id,
            registration.rank,
        )
        return None

    def _problem(self, registration: Registration, fd: int, expected: bytes) -> str | None:
        who = f"rank {registration.rank} of job '{registration.job_id}'"
        if not expected or not hmac.compare_digest(registration.session, expected):
            return (
                f"{who} is not a local leader of a running, unsharded job on this coordinator, "
                "or its session does not match"
            )
        key = (registration.job_id, registration.rank)
        if key not in self._segments and len(self._segments) >= self.max_segments:
            return f"{len(self._segments)} segments are registered already (the limit)"
        try:
            info = os.fstat(fd)
            access = fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE
        except OSError as exc:
            return f"{who} sent a descriptor that cannot be examined: {exc}"
        if not stat.S_ISREG(info.st_mode) or info.st_nlink != 0:
            return f"{who} sent a descriptor that is not an unnamed regular file"
        if access != os.O_RDWR:
            return f"{who} sent a descriptor not open for reading and writing"
        return None

    # ------------------------------------------------------------ forgetting
    def forget(self, job_id: str, rank: int, session: bytes) -> None:
        """`rank` (of that session) left or was dropped: close its segment.

        The session tells a rank of an ended job from the same rank of a new
        job with the same id, whose segment must stay.
        """
        segment = self._segments.get((job_id, rank))
        if segment is not None and (not session or segment.session == session):
            del self._segments[(job_id, rank)]
            os.close(segment.fd)

    def forget_job(self, job_id: str) -> None:
        """The job ended: close all of its segments."""
        for key in [key for key in self._segments if key[0] == job_id]:
            os.close(self._segments.pop(key).fd)

    def close(self) -> None:
        """The coordinator stops: close every segment."""
        for segment in self._segments.values():
            os.close(segment.fd)
        self._segments.clear()

    # ------------------------------------------------------------ the data path
    def read_for(self, job: Job, rank: int, chunk: ChunkHeader) -> memoryview | None:
        """`read_chunk` for `rank` of `job`; None for the rest of an aborted step (not read).

        Raises:
            RejectedMessage: as `read_chunk`.
        """
        if chunk.step < job.open_step and job.in_flight.was_aborted(chunk.step):
            return None
        signature = job.membership.signature
        return self.read_chunk(
            job.job_id,
            rank,
            job.membership.session_of(rank),
            chunk,
            signature.buckets if signature is not None else (),
        )

    def read_chunk(
        self,
        job_id: str,
        rank: int,
        session: bytes,
        chunk: ChunkHeader,
        signature_buckets: Sequence[pb.BucketSpec],
    ) -> memoryview:
        """The payload of an in-segment chunk, read into a fresh coordinator-owned buffer.

        Its length is what the chunk grid says (the bucket's bytes in the
        chunk's dtype from its offset, at most one chunk); a chunk that names
        no valid bucket, dtype or offset gets an empty payload, which the
        usual validation then refuses with its usual message.

        Args:
            signature_buckets: the job's `ModelSignature.buckets` (sizes, dtypes).

        Raises:
            RejectedMessage: INVALID_ARGUMENT: no segment is registered for this
                session, or the read came up short (the segment was truncated).
        """
        step, bucket = chunk.step, chunk.bucket_index
        segment = self._segments.get((job_id, rank))
        if segment is None or not hmac.compare_digest(segment.session, session):
            raise RejectedMessage(
                Code.INVALID_ARGUMENT,
                f"rank {rank} sent step {step} bucket {bucket} offset {chunk.offset} as in its "
                "shared-memory segment, but registered no segment with this session",
                step=step,
                bucket_index=bucket,
            )
        length = _grid_length(chunk, signature_buckets, self.chunk_bytes)
        buffer = _aligned(length).data
        try:
            got = os.preadv(segment.fd, [buffer], chunk.segment_offset) if length else 0
        except (OSError, OverflowError) as exc:
            got, reason = 0, f" ({exc})"
        else:
            reason = ""
        if got != length:
            raise RejectedMessage(
                Code.INVALID_ARGUMENT,
                f"rank {rank} sent step {step} bucket {bucket} offset {chunk.offset}: its segment "
                f"at {chunk.segment_offset} held {got} bytes, expected {length}{reason} (was the "
                "segment truncated?)",
                step=step,
                bucket_index=bucket,
            )
        if segment.step != step:
            segment.step, segment.uploads = step, {}
        segment.uploads[(bucket, chunk.offset)] = (chunk.segment_offset, length)
        if self._metrics is not None:
            self._metrics.observe_segment_bytes("read", length)
        return buffer

    def reply(
        self, job_id: str, rank: int, header: ChunkHeader, payload: memoryview
    ) -> bytes | None:
        """An averaged chunk for `rank`: written into its segment, if its upload came from there.

        Returns:
            The header-only message to send instead of the chunk (in_segment set,
            segment_offset where the average now lies), or None: send the whole
            chunk (no segment, or not an upload read from it).

        Raises:
            OSError: the write failed (the caller ends that rank's stream).
        """
        segment = self._segments.get((job_id, rank))
        if segment is None or not segment.uploads:
            return None
        if header.step != segment.step:
            return None
        place = segment.uploads.get((header.bucket_index, header.offset))
        if place is None or place[1] != len(payload):
            return None  # e.g. a float32 answer to a 16-bit upload: not on the upload's grid
        written = os.pwrite(segment.fd, payload, place[0])
        if written != len(payload):
            raise OSError(f"wrote {written} of {len(payload)} bytes")
        del segment.uploads[(header.bucket_index, header.offset)]
        if self._metrics is not None:
            self._metrics.observe_segment_bytes("written", written)
        reply = dataclasses.replace(header, in_segment=True, segment_offset=place[0])
        return encode_gradient(reply, b"")


def leader_session(job: Job, rank: int) -> bytes:
    """`rank`'s session if it may register a segment (a local leader of a running,
    unsharded job), else b"" (nothing matches it)."""
    if job.state is not JobState.RUNNING or job.shards:
        return b""
    local_ranks, _ = job.membership.local_group_of(rank)
    if not local_ranks or local_ranks[0] != rank:
        return b""
    return job.membership.session_of(rank)


def _grid_length(chunk: ChunkHeader, buckets: Sequence[pb.BucketSpec], chunk_bytes: int) -> int:
    """The payload length the chunk grid gives an unsharded chunk (0 if it names nothing valid)."""
    if not 0 <= chunk.bucket_index < len(buckets) or chunk_bytes <= 0:
        return 0
    try:
        wire_bytes = buckets[chunk.bucket_index].num_elements * dtypes.itemsize(chunk.dtype)
    except ValueError:
        return 0
    if chunk.offset >= wire_bytes or chunk.offset % chunk_bytes:
        return 0
    return min(chunk_bytes, wire_bytes - chunk.offset)


def _aligned(length: int) -> npt.NDArray[np.uint8]:
    """A fresh writable buffer of `length` bytes starting on a cache line."""
    raw = np.empty(length + _ALIGN_BYTES, dtype=np.uint8)
    start = -raw.ctypes.data % _ALIGN_BYTES
    return raw[start : start + length]
