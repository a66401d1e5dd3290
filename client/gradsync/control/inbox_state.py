"""What the coordinator has told one worker so far, and how streamed parts extend it.

`gradsync.control.inbox.Inbox` keeps one `InboxState` under its condition variable:
the I/O thread writes it as messages arrive and the training thread's waits
read it. The parts that arrive in pieces (rank 0's state, the checkpoint to
resume from) are reassembled by the shared `gradsync_proto.blobs.BlobAssembly`
(in order, on the chunk grid, within the size the Welcome announced, the
buffer growing with what arrives), and each append says what was wrong
instead of raising, so that the inbox records it as the coordinator's
protocol fault. Split from `inbox`
so that this state and its invariants read apart from the waits on it. Pure
data, no locking of its own: every call happens under the inbox's condition.

The Welcome is checked before it is trusted (`welcome_problem`): a worker sizes
buffers, timers and its shard connections from it, so a wrong or hostile one
must fail fast with an error naming the field and its value, not allocate 2 GiB
(`state_bytes`), spin (`heartbeat_interval_s` of 0 or NaN) or dial a garbage
address. The worker knows its own model: `state_bytes` must equal the size of
its parameters and buffers, and `world_size` and `job_id` what it joined with.
"""

from __future__ import annotations

import collections
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field

from gradsync_proto import chunking, dtypes
from gradsync_proto.blobs import BadChunk, BlobAssembly
from gradsync_proto.codes import Code
from gradsync_proto.net.address import parse_address
from gradsync_proto.net.stream_client import EndKind, StreamEnded
from gradsync_proto.v1 import gradsync_pb2 as pb

from gradsync.errors import (
    ClosedError,
    CoordinatorUnavailableError,
    GradSyncError,
    error_from_status,
)
from gradsync.path.shard_streams import ShardFault

log = logging.getLogger("gradsync.client")

#: JoinProgress messages kept for `wait_join_progress`: one arrives per step
#: while this rank waits, so a short queue only ever drops stale ones.
_JOIN_PROGRESS_KEPT = 64
#: Smallest and largest chunk a worker believes. The coordinator's own config allows
#: 4 KiB..64 MiB; the worker refuses only what it cannot work with (0 means the default).
MIN_CHUNK_BYTES = 1
MAX_CHUNK_BYTES = 64 << 20
#: Room beyond one chunk that a message limit may add (the coordinator adds 64 KiB).
MAX_MESSAGE_SLACK_BYTES = 16 << 20
#: Longest heartbeat interval believed (the coordinator's defaults are 0.5 s of 5 s).
MAX_HEARTBEAT_INTERVAL_S = 600.0
#: Counters (steps, epochs, collective numbers) beyond this are not believed.
MAX_COUNTER = 1 << 53
#: Longest session secret believed (the coordinator issues 32 bytes).
MAX_SESSION_BYTES = 256
#: Most shards believed.
MAX_SHARDS = 1024
#: A resume blob (module + optimizer state, pickled) may be this many times the model's
#: state size, plus `RESUME_SLACK_BYTES`; beyond that it is not a checkpoint of this model.
RESUME_STATE_FACTOR = 8
RESUME_SLACK_BYTES = 256 << 20


@dataclass
class InboxState:
    """State written by the I/O thread and read by waiters (under the inbox's condition)."""

    welcome: pb.Welcome | None = None
    #: Rank 0's state as it arrives (from the Welcome on: it may come before anyone waits).
    state: BlobAssembly | None = None
    fatal: GradSyncError | None = None
    #: The checkpoint to resume from as it arrives (when the Welcome announced one).
    resume: BlobAssembly | None = None
    checkpoint_acks: dict[int, pb.CheckpointSaved] = field(default_factory=dict)
    membership_epoch: int = 0
    #: The live ranks of the latest MembershipChanged (None before any).
    live_ranks: tuple[int, ...] | None = None
    #: A live rank asked to donate its state to a rejoining rank (elastic).
    heal_requested: bool = False
    #: ... asking for the state itself through the coordinator (StateRequest.relay).
    heal_relay: bool = False
    #: The membership epoch in which this rank took the latest such request (its state
    #: went out in it): the coordinator's answer is a change past it (`wait_heal_answer`).
    heal_epoch: int | None = None
    #: The coordinator's announcement of why it is about to end the stream.
    stream_end: pb.StreamEnd | None = None
    #: The coordinator's latest StepReport (only the lowest rank gets them).
    step_report: pb.StepReport | None = None
    #: The latest AssemblyProgress, and how many have arrived (waiters compare counts).
    assembly: pb.AssemblyProgress | None = None
    assembly_count: int = 0
    #: The heartbeat interval the coordinator asked for (AssemblyProgress or Welcome).
    heartbeat_interval_s: float | None = None
    #: JoinProgress messages not yet taken by `wait_join_progress`, oldest first.
    join_progress: collections.deque[pb.JoinProgress] = field(
        default_factory=lambda: collections.deque(maxlen=_JOIN_PROGRESS_KEPT)
    )
    #: The first shard stream that failed, raised by waits after its grace.
    shard_fault: ShardFault = field(default_factory=ShardFault)

    def record_assembly(self, progress: pb.AssemblyProgress, rank: int) -> None:
        """Keep the latest AssemblyProgress (and its heartbeat interval, until the Welcome's)."""
        self.assembly = progress
        self.assembly_count += 1
        if self.heartbeat_interval_s is None and progress.heartbeat_interval_s > 0:
            self.heartbeat_interval_s = progress.heartbeat_interval_s
        if progress.refused:
            log.warning(
                "rank %d: the coordinator refused a rank of this job: %s",
                rank,
                progress.refused,
            )

    def record_welcome(self, welcome: pb.Welcome) -> None:
        """Keep the Welcome and get ready for the blobs it announces.

        Neither buffer is sized by what the Welcome says: each
        grows as its chunks arrive, checked against the announced size.
        """
        self.welcome = welcome
        self.membership_epoch = welcome.membership_epoch
        chunk_bytes = welcome.chunk_bytes or chunking.DEFAULT_CHUNK_BYTES
        announced = f"{welcome.state_bytes} bytes announced in Welcome.state_bytes"
        self.state = BlobAssembly(
            f"rank 0's state ({announced})", welcome.state_bytes, chunk_bytes, empty_chunk=False
        )
        self.resume = None
        if welcome.resume_bytes:
            announced = f"{welcome.resume_bytes} bytes announced in Welcome.resume_bytes"
            self.resume = BlobAssembly(
                f"the checkpoint to resume from ({announced})", welcome.resume_bytes, chunk_bytes
            )

    def append_resume(self, chunk: pb.CheckpointChunk) -> str | None:
        """Append one resume chunk: in order, within the size the Welcome announced.

        Returns:
            What is wrong with the chunk (nothing is appended then), or None.
        """
        resume = self.resume
        if resume is None:
            announced = "no Welcome yet" if self.welcome is None else "Welcome.resume_bytes is 0"
            return f"a resume chunk at offset {chunk.offset} arrived, but {announced}"
        return _append(resume, chunk.offset, chunk.payload, chunk.total_bytes)

    def append_state(self, chunk: pb.StateChunk) -> str | None:
        """Append one chunk of rank 0's state: in order, within Welcome.state_bytes.

        Returns:
            What is wrong with the chunk (nothing is appended then), or None.
        """
        if self.state is None:
            return f"a state chunk at offset {chunk.offset} arrived before the Welcome"
        return _append(self.state, chunk.offset, chunk.payload)


def _append(
    blob: BlobAssembly, offset: int, payload: bytes, claimed_total: int | None = None
) -> str | None:
    """Add one chunk to `blob`; what is wrong with it, or None."""
    try:
        blob.add(offset, payload, claimed_total)
    except BadChunk as bad:
        return bad.message
    return None


def end_reason_name(reason: int) -> str:
    """The EndReason's name, or its number if this client predates it."""
    try:
        return str(pb.EndReason.Name(reason))
    except ValueError:
        return str(reason)


def ended_stream_error(
    end: pb.StreamEnd | None, code: int | None, details: str, target: str, rank: int
) -> GradSyncError:
    """The error for a stream that ended with status `code` (None: ended without one).

    A `StreamEnd` received before the status says why the stream ended, and
    decides the exception and its message: the coordinator's own words win over
    the status that follows, which the transport can replace (gRPC has reported
    "INTERNAL: Internal error from Core" for a stream the coordinator ended
    cleanly). Without one, a status code is translated as is, and an end without
    any status means the coordinator went away.
    """
    if end is not None:
        return error_from_status(end.code, end.message, reason=end.reason, rank=rank)
    if code is None:
        return CoordinatorUnavailableError(
            f"the coordinator at {target} ended the stream", rank=rank
        )
    return error_from_status(code, details, rank=rank)


def stream_end_failure(
    ended: StreamEnded,
    closed: bool,
    rank: int,
    failure_of: Callable[[int | None, str], GradSyncError],
) -> GradSyncError | None:
    """The error every later wait raises after the Sync stream ended (None: none).

    Args:
        ended: how the stream ended.
        closed: this worker had begun closing its transport.
        rank: for the messages.
        failure_of: the error of a status (None: ended without one), `Inbox.stream_failure`.
    """
    if ended.kind is EndKind.CLOSED:
        return ClosedError("the transport was closed", rank=rank)
    if ended.kind is EndKind.FAULT:
        return GradSyncError(f"unexpected error in the transport: {ended.cause!r}", rank=rank)
    if ended.clean:
        return None if closed else failure_of(None, "")
    if closed and ended.code == Code.CANCELLED:
        return None
    failure = failure_of(ended.code, ended.details)
    failure.__cause__ = ended.cause
    return failure


def state_bytes(signature: pb.ModelSignature) -> int:
    """Bytes of rank 0's state broadcast for this signature: every parameter, then buffers."""
    specs = (*signature.parameters, *signature.buffers)
    return sum(math.prod(spec.shape) * dtypes.itemsize(spec.dtype) for spec in specs)


@dataclass(frozen=True)
class Expected:
    """What this worker knows the Welcome must say (from its own Join)."""

    job_id: str
    world_size: int
    state_bytes: int

    @classmethod
    def of(cls, join: pb.Join) -> Expected:
        return cls(join.job_id, join.world_size, state_bytes(join.signature))

    @property
    def max_resume_bytes(self) -> int:
        """The largest resume blob believed for this model."""
        return RESUME_STATE_FACTOR * self.state_bytes + RESUME_SLACK_BYTES


def welcome_problem(welcome: pb.Welcome, expected: Expected) -> str | None:
    """The first field of `welcome` that cannot be right, as "Welcome.FIELD = VALUE: why"."""

    def bad(name: str, value: object, why: str) -> str:
        return f"Welcome.{name} = {value!r}: {why}"

    if welcome.job_id and welcome.job_id != expected.job_id:
        return bad("job_id", welcome.job_id, f"this worker joined job {expected.job_id!r}")
    if welcome.world_size != expected.world_size:
        return bad(
            "world_size", welcome.world_size, f"this worker joined with {expected.world_size}"
        )
    chunk = welcome.chunk_bytes
    if chunk and not MIN_CHUNK_BYTES <= chunk <= MAX_CHUNK_BYTES:
        return bad("chunk_bytes", chunk, f"must be in {MIN_CHUNK_BYTES}..{MAX_CHUNK_BYTES}")
    limit = welcome.max_message_bytes
    if limit and not (chunk or MIN_CHUNK_BYTES) <= limit <= (chunk or MAX_CHUNK_BYTES) + (
        MAX_MESSAGE_SLACK_BYTES
    ):
        return bad("max_message_bytes", limit, f"must hold one chunk ({chunk}) plus headers")
    interval = welcome.heartbeat_interval_s
    if not math.isfinite(interval) or not 0 <= interval <= MAX_HEARTBEAT_INTERVAL_S:
        return bad(
            "heartbeat_interval_s", interval, f"must be finite, in 0..{MAX_HEARTBEAT_INTERVAL_S:g}"
        )
    for name in ("start_step", "membership_epoch", "next_collective", "checkpoint_every_steps"):
        value = getattr(welcome, name)
        if value > MAX_COUNTER:
            return bad(name, value, f"must be at most {MAX_COUNTER}")
    if welcome.state_bytes and welcome.state_bytes != expected.state_bytes:
        return bad(
            "state_bytes",
            welcome.state_bytes,
            f"this worker's parameters and buffers hold {expected.state_bytes} bytes",
        )
    if welcome.resume_bytes > expected.max_resume_bytes:
        return bad(
            "resume_bytes",
            welcome.resume_bytes,
            f"a checkpoint of this model ({expected.state_bytes} bytes of state) is at most "
            f"{expected.max_resume_bytes} bytes",
        )
    session = getattr(welcome, "session", b"")
    if len(session) > MAX_SESSION_BYTES:
        return bad("session", f"<{len(session)} bytes>", f"at most {MAX_SESSION_BYTES} bytes")
    if len(welcome.shards) > MAX_SHARDS:
        return bad("shards", f"<{len(welcome.shards)} entries>", f"at most {MAX_SHARDS}")
    for shard in welcome.shards:
        if shard.index >= max(len(welcome.shards), 1):
            return bad("shards.index", shard.index, f"{len(welcome.shards)} shards are listed")
        address = shard.address
        if not address:
            continue
        try:
            parse_address(f"localhost{address}" if address.startswith(":") else address)
        except ValueError as exc:
            return bad("shards.address", address[:200], f"not a host:port ({exc})")
    return None
