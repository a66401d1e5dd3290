"""What the coordinator has told one worker so far, and how streamed parts extend it.

`gradsync.path.inbox.Inbox` keeps one `InboxState` under its condition variable:
the I/O thread writes it as messages arrive and the training thread's waits
read it. The parts that arrive in pieces (rank 0's state, the checkpoint to
resume from) are appended here in order and within the size the Welcome
announced, and each append says what was wrong instead of raising, so that
the inbox records it as the coordinator's protocol fault. Split from `inbox`
so that this state and its invariants read apart from the waits on it. Pure
data, no locking of its own: every call happens under the inbox's condition.
"""

from __future__ import annotations

import collections
import logging
from dataclasses import dataclass, field

from gradsync_proto.v1 import gradsync_pb2 as pb

from gradsync.errors import GradSyncError
from gradsync.path.shard_faults import ShardFault

log = logging.getLogger("gradsync.client")

#: JoinProgress messages kept for `wait_join_progress`: one arrives per step
#: while this rank waits, so a short queue only ever drops stale ones.
_JOIN_PROGRESS_KEPT = 64


@dataclass
class InboxState:
    """State written by the I/O thread and read by waiters (under the inbox's condition)."""

    welcome: pb.Welcome | None = None
    state: bytearray | None = None
    state_received: int = 0
    fatal: GradSyncError | None = None
    resume: bytearray | None = None
    resume_received: int = 0
    checkpoint_acks: dict[int, pb.CheckpointSaved] = field(default_factory=dict)
    membership_epoch: int = 0
    #: The live ranks of the latest MembershipChanged (None before any).
    live_ranks: tuple[int, ...] | None = None
    #: A live rank asked to donate its state to a rejoining rank (elastic).
    heal_requested: bool = False
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

    def append_resume(self, chunk: pb.CheckpointChunk) -> str | None:
        """Append one resume chunk: in order, within the size the Welcome announced.

        Returns:
            What is wrong with the chunk (nothing is appended then), or None.
        """
        welcome = self.welcome
        if self.resume is None:
            self.resume = bytearray()
        declared = welcome.resume_bytes if welcome is not None else -1
        end = chunk.offset + len(chunk.payload)
        if chunk.total_bytes != declared or chunk.offset != len(self.resume) or end > declared:
            return (
                f"resume chunk [{chunk.offset}, {end}) of {chunk.total_bytes} bytes does not "
                f"follow the {len(self.resume)} bytes received of the {declared} announced "
                "in Welcome.resume_bytes"
            )
        self.resume += chunk.payload
        self.resume_received = len(self.resume)
        return None

    def append_state(self, chunk: pb.StateChunk) -> str | None:
        """Append one chunk of rank 0's state: in order, within Welcome.state_bytes.

        Returns:
            What is wrong with the chunk (nothing is appended then), or None.
        """
        state = self.state
        welcome = self.welcome
        declared = welcome.state_bytes if welcome is not None else 0
        end = chunk.offset + len(chunk.payload)
        if state is None or chunk.offset != len(state) or end > declared:
            received = -1 if state is None else len(state)
            return (
                f"state chunk [{chunk.offset}, {end}) does not follow the {received} bytes "
                f"received of the {declared} announced in Welcome.state_bytes"
            )
        state += chunk.payload
        self.state_received = len(state)
        return None


def end_reason_name(reason: int) -> str:
    """The EndReason's name, or its number if this client predates it."""
    try:
        return str(pb.EndReason.Name(reason))
    except ValueError:
        return str(reason)
