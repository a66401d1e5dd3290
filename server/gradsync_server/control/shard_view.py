"""A coordinator shard's replica of one job: the leader's view, and its own open step.

The leader is the only authority on membership, epochs, aborts and job ends;
a shard only aggregates its byte range of every bucket. It learns everything
else from the leader's `ShardJobView` messages (full state, sent after every
change) and mirrors each change on its `OpenStep` in the order the leader
made it: members and epoch first, then the step's reductions (a lost rank
under the elastic policy, whose view bumps the epoch, is dropped from the
step; a rank removed without a new epoch belongs to a job that is breaking,
whose step the leader aborts or ends). The local groups come with the view,
so a shard forms the same units, checks covers by the same rules and sends
averages to the same unit leaders. Because the same `OpenStep` and
`BucketReduction` code sums every element in ascending rank order, the bytes
a shard returns are those the leader alone would have returned.

A shard never aborts a step itself: a chunk it refuses becomes a
`ShardRejected` for the leader, which aborts the step for everyone and tells
the shard (`ShardAbort`). A NaN/Inf contribution is checked here as at the
leader, under the leader's `--nonfinite` policy: "abort" makes it a
`ShardRejected` with reason NONFINITE (the culprit's chunk is never summed,
so no average with it goes out), "report" a `ShardNonFinite` for the leader's
count and status, once per rank, step and bucket. Pure logic, no gRPC, no asyncio.
"""

from __future__ import annotations

import hmac
import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from gradsync_proto import defaults
from gradsync_proto.codec import ChunkHeader
from gradsync_proto.codes import Code
from gradsync_proto.v1 import gradsync_pb2 as pb

from gradsync_server.dataplane.actions import Action, SegmentAverage, Send
from gradsync_server.dataplane.budget import ByteBudget
from gradsync_server.dataplane.host_groups import LocalGroups
from gradsync_server.dataplane.nonfinite import (
    NonFiniteContribution,
    NonFiniteLog,
    NonFiniteRejection,
)
from gradsync_server.dataplane.observer import StepObserver
from gradsync_server.dataplane.open_step import OpenStep
from gradsync_server.errors import RejectedMessage

#: Steps for which a rejection was already reported (one report per step is enough:
#: the leader aborts the whole step).
_REPORTED_STEPS_REMEMBERED = 64


@dataclass(frozen=True)
class ShardMember:
    """A member as a shard knows it: its rank, incarnation, and the session that admits
    its data stream (the incarnation is public: Status shows it; the session is not)."""

    rank: int
    incarnation: str
    session: bytes = field(default=b"", repr=False)


@dataclass
class MembershipView:
    """The leader's membership of one job, as last announced (what `OpenStep` reads)."""

    job_id: str
    epoch: int = 0
    members: dict[int, ShardMember] = field(default_factory=dict)
    #: The leader's local groups (`ShardJobView.local_groups`): the same units as there.
    groups: LocalGroups = field(default_factory=LocalGroups)

    def ranks(self) -> tuple[int, ...]:
        """Members of the current epoch, ascending."""
        return tuple(sorted(self.members))


@dataclass(frozen=True)
class ShardOutcome:
    """What a shard does after an event: averaged chunks to send, a rejection to report,
    non-finite contributions to report (--nonfinite report)."""

    sends: list[Send] = field(default_factory=list)
    rejected: pb.ShardRejected | None = None
    nonfinite: list[pb.ShardNonFinite] = field(default_factory=list)


def _averages_only(actions: list[Action]) -> list[Send]:
    """The averaged chunks among `actions` (a shard sends no StepReport or StepAborted)."""
    sends = []
    for action in actions:
        if not isinstance(action, Send):
            continue
        message = action.message
        if isinstance(message, bytes | SegmentAverage) or message.WhichOneof("kind") == "gradient":
            sends.append(action)
    return sends


def check_view(view: pb.ShardJobView, shard_index: int) -> str | None:
    """Why a first `ShardJobView` cannot configure a job at shard `shard_index`, or None."""
    if not view.job_id:
        return "a job view without a job id"
    if not 0 < shard_index < view.shard_count:
        return (
            f"job '{view.job_id}' is cut into {view.shard_count} shards, but this is shard "
            f"{shard_index}"
        )
    if view.chunk_bytes < 1:
        return f"job '{view.job_id}' has chunk size {view.chunk_bytes}"
    if not view.buckets:
        return f"job '{view.job_id}' has no buckets"
    return None


class ShardJob:
    """One job at a shard: the leader's view of it and the shard's open step.

    Args:
        view: the leader's first view of the job (see `check_view`).
        shard_index: the shard's index (its byte range of every bucket).
        shard_name: how messages name the shard, e.g. "shard 2 at 10.0.0.5:50051".
        budget: the shard's cap on buffered gradient bytes.
        clock: monotonic time source (injectable for tests).
        metrics: where bucket and step latencies go, if anywhere.
        nonfinite: the leader's `--nonfinite` policy (`ShardAccepted.nonfinite`).

    Raises:
        ValueError: the view cannot configure a job at this shard.
    """

    def __init__(
        self,
        view: pb.ShardJobView,
        shard_index: int,
        shard_name: str,
        budget: ByteBudget,
        clock: Callable[[], float],
        metrics: StepObserver | None = None,
        nonfinite: str = defaults.NONFINITE,
    ) -> None:
        problem = check_view(view, shard_index)
        if problem is not None:
            raise ValueError(problem)
        self.job_id = view.job_id
        self.shard_name = shard_name
        self.membership = MembershipView(view.job_id)
        self.open_step = OpenStep(
            self.membership,
            view.chunk_bytes,
            budget,
            clock,
            metrics,
            shard_index=shard_index,
            shard_count=view.shard_count,
            nonfinite=nonfinite,
        )
        self.open_step.shard_name = shard_name
        # Logged here with the counts; the leader counts them for status and metrics.
        self.open_step.nonfinite = NonFiniteLog(clock, logging.getLogger("gradsync.shard"))
        self._nonfinite: list[pb.ShardNonFinite] = []
        self.open_step.on_nonfinite = self._forward_nonfinite
        self.open_step.configure(pb.ModelSignature(buckets=view.buckets), view.start_step)
        self._reported: deque[int] = deque(maxlen=_REPORTED_STEPS_REMEMBERED)
        self.apply(view)

    # ------------------------------------------------------------ the leader
    def apply(self, view: pb.ShardJobView) -> ShardOutcome:
        """Follow the leader's latest view of the job: members, epoch, out of inputs.

        Returns the averaged chunks that a dropped rank or a rank out of inputs
        completed, or a rejection when a rejoining rank can no longer be summed
        in rank order (the leader then aborts the step, which is retried).
        """
        membership, step = self.membership, self.open_step
        new = {m.rank: ShardMember(m.rank, m.incarnation, m.session) for m in view.members}
        old = membership.members
        removed = [r for r in sorted(old) if r not in new or new[r] != old[r]]
        added = [r for r in sorted(new) if r not in old or new[r] != old[r]]
        shrinks = view.membership_epoch != membership.epoch
        membership.epoch = view.membership_epoch
        membership.groups.replace(group.ranks for group in view.local_groups)
        actions: list[Action] = []
        # As the leader does: the members change first, then the step follows.
        for rank in removed:
            del membership.members[rank]
            step.out_of_inputs.discard(rank)
            if shrinks:
                actions += step.drop_rank(rank)
        outcome_rejected = None
        for rank in added:
            membership.members[rank] = new[rank]
            try:
                step.add_rank(rank)
            except ValueError:
                outcome_rejected = self._report(
                    rank,
                    step.step,
                    -1,
                    RejectedMessage(
                        Code.ABORTED,
                        f"rank {rank} rejoined job '{self.job_id}' (epoch {view.membership_epoch})"
                        f" after higher ranks' chunks of step {step.step} were summed at "
                        f"{self.shard_name}; step {step.step} cannot be averaged in rank order",
                        step=step.step,
                    ),
                )
        out = set(view.out_of_inputs)
        for rank in sorted(out - step.out_of_inputs):
            if rank in membership.members:
                actions += step.run_out_of_inputs(rank)
        step.out_of_inputs &= out  # every rank joined: all take part again
        self._skip_aborted()
        return ShardOutcome(_averages_only(actions), outcome_rejected)

    def abort(self, step: int) -> None:
        """The leader aborted `step`: drop what the shard holds of it, if it is the open one.

        A later step is remembered too, so that the shard skips it once it gets
        there and late chunks for it are dropped quietly.
        """
        if step < self.open_step.step:
            return
        self.open_step.remember_aborted(step)
        self._skip_aborted()

    def _skip_aborted(self) -> None:
        while self.open_step.was_aborted(self.open_step.step):
            self.open_step.drop_step()

    def release(self) -> None:
        """The job ended: free every buffer it holds."""
        self.open_step.release()

    # --------------------------------------------------------------- workers
    def hello_problem(self, rank: int, incarnation: str, session: bytes) -> str | None:
        """Why a data stream from (`rank`, `incarnation`, `session`) is not admitted, or None.

        See `session_refused` for a wrong session (told apart: it is final).
        """
        member = self.membership.members.get(rank)
        if member is None:
            return (
                f"rank {rank} is not a member of job '{self.job_id}' (epoch "
                f"{self.membership.epoch}, members {list(self.membership.ranks())}) at "
                f"{self.shard_name}"
            )
        if member.incarnation != incarnation:
            return (
                f"rank {rank} of job '{self.job_id}' says incarnation {incarnation!r}, but the "
                f"leader announced incarnation {member.incarnation!r} to {self.shard_name}"
            )
        return self.session_refused(rank, incarnation, session)

    def session_refused(self, rank: int, incarnation: str, session: bytes) -> str | None:
        """Why (`rank`, `incarnation`) as announced is refused for presenting `session`.

        None when the rank and incarnation are not (yet) the announced ones (that
        may change with the leader's next view) or the session matches. The
        comparison takes constant time, and the message never shows a secret.
        """
        member = self.membership.members.get(rank)
        if member is None or member.incarnation != incarnation:
            return None
        if hmac.compare_digest(member.session, session):
            return None
        presented = "no session" if not session else "a session that is not the one"
        return (
            f"rank {rank} of job '{self.job_id}' presented {presented} the leader issued to "
            f"that rank at its Join ({self.shard_name}); a data stream acts for a rank only on "
            "its own session"
        )

    def is_current(self, rank: int, incarnation: str, session: bytes) -> bool:
        """True while (`rank`, `incarnation`, `session`) is a member (its chunks are judged)."""
        return self.hello_problem(rank, incarnation, session) is None

    def awaits_leader(self, chunk: ChunkHeader) -> bool:
        """True if `chunk` may become valid once the leader's next view or abort arrives.

        Control and data travel on different connections, so a worker can be
        ahead of what the shard has heard: a newer epoch, or the step after
        one the leader aborted.
        """
        return chunk.membership_epoch > self.membership.epoch or chunk.step > self.open_step.step

    def on_gradient(self, rank: int, chunk: ChunkHeader, payload: memoryview) -> ShardOutcome:
        """Fold one chunk in; return the averaged chunks, or the rejection to report."""
        step = self.open_step
        if chunk.step < step.step and step.was_aborted(chunk.step):
            return ShardOutcome()  # late upload for a step the leader already aborted
        try:
            actions = step.accept(rank, chunk, payload)
        except RejectedMessage as rejection:
            failed = chunk.step if rejection.step is None else rejection.step
            return ShardOutcome([], self._report(rank, failed, rejection.bucket_index, rejection))
        self._skip_aborted()
        nonfinite, self._nonfinite = self._nonfinite, []
        return ShardOutcome(_averages_only(actions), nonfinite=nonfinite)

    def _forward_nonfinite(self, contribution: NonFiniteContribution) -> None:
        """A newly seen non-finite contribution, for the leader (--nonfinite report)."""
        self._nonfinite.append(
            pb.ShardNonFinite(
                job_id=self.job_id,
                rank=contribution.rank,
                step=contribution.step,
                bucket_index=contribution.bucket_index,
                message=contribution.describe(),
                via_local_leader=contribution.via >= 0,
            )
        )

    def report(self, rank: int, rejection: RejectedMessage) -> pb.ShardRejected | None:
        """The ShardRejected for a message refused outside a chunk (garbage bytes), or None."""
        step = self.open_step.step if rejection.step is None else rejection.step
        return self._report(rank, step, rejection.bucket_index, rejection)

    def _report(
        self, rank: int, step: int, bucket_index: int, rejection: RejectedMessage
    ) -> pb.ShardRejected | None:
        if step in self._reported:
            return None  # the leader aborts the whole step for the first one
        self._reported.append(step)
        message = rejection.message
        if self.shard_name not in message:
            message += f" ({self.shard_name})"
        return pb.ShardRejected(
            job_id=self.job_id,
            # A non-finite sum of a local group: the member it names, not its leader.
            rank=rejection.rank if isinstance(rejection, NonFiniteRejection) else rank,
            via_local_leader=isinstance(rejection, NonFiniteRejection) and rejection.rank != rank,
            step=step,
            bucket_index=bucket_index,
            code=int(rejection.code),
            message=message,
            reason=(
                pb.ABORT_REASON_NONFINITE
                if isinstance(rejection, NonFiniteRejection)
                else pb.ABORT_REASON_MESSAGE_REJECTED
            ),
        )
