"""One job's data plane for one byte range, driven by the control plane's events.

Every coordinator process runs one `JobPlane` per job: the leader for byte
range 0 (the whole bucket when unsharded), shard i for range i. The plane
holds the open step (`OpenStep`: aggregation, step checks, budget, replies)
and the little it must know of the membership to judge a chunk: the members'
ranks, incarnations and sessions, the epoch, the local groups and the ranks
out of inputs. It never decides any of that. The control plane (`Job`, at
the leader only) decides, and says so with three events, which are also the
messages a leader sends its shards (`LeaderMessage`):

- `ShardJobView`: the job started (bucket layout, chunking, start step) or its
  membership changed; it always carries the whole (small) membership;
- `ShardAbort`: a step was aborted;
- `ShardJobEnd`: the job ended.

The leader applies each event to its own plane in-process, at the moment it
decides, and queues the same event for its shards; a shard applies what it
receives. Because both run this class and the same `OpenStep`, and every
element is summed in ascending rank order, the bytes a shard returns are
those the leader alone would have returned (architecture invariant 9).

How a membership event lands: the members change first, then the step
follows, as the control plane decided. A rank gone in a new epoch (the
elastic policy) is dropped from the step, so what it never contributed to
completes over the live ranks; a rank gone without a new epoch belongs to a
job that is breaking, whose step the control plane aborts or ends. A rank
that rejoins is added to the step's reductions; if higher ranks' chunks were
already summed it cannot be, and the event's outcome names the step to
abort. (That does not happen when the donor keeps to the protocol: it
uploads the step only once it heard of the new epoch, and a shard holds a
chunk of an epoch it has not heard of until the view arrives, see
`control.elastic`.) A rank out of inputs stops being waited for.

A shard never aborts a step itself: a chunk it refuses becomes a
`ShardRejected` for the leader (`report`), once per step, and non-finite
contributions under `--nonfinite report` a `ShardNonFinite`. Pure logic, no
gRPC, no asyncio.
"""

from __future__ import annotations

import hmac
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from gradsync_proto.codec import ChunkHeader
from gradsync_proto.codes import Code
from gradsync_proto.v1 import gradsync_pb2 as pb

from gradsync_server import defaults
from gradsync_server.dataplane.actions import Action, PersistOuter, ResumeBlob, SegmentAverage, Send
from gradsync_server.dataplane.budget import ByteBudget, OwnerBudget
from gradsync_server.dataplane.nonfinite import NonFiniteContribution, NonFiniteRejection
from gradsync_server.dataplane.observer import StepObserver
from gradsync_server.dataplane.open_step import MembershipView, OpenStep, PlaneMember
from gradsync_server.errors import RejectedMessage

__all__ = ["JobPlane", "MembershipView", "PlaneMember", "ShardOutcome", "check_view"]

#: Steps for which a rejection was already reported (one report per step is enough:
#: the leader aborts the whole step).
_REPORTED_STEPS_REMEMBERED = 64


@dataclass(frozen=True)
class ShardOutcome:
    """What a shard does after an event: averaged chunks to send, a rejection to report,
    non-finite contributions to report (--nonfinite report)."""

    sends: list[Send] = field(default_factory=list)
    rejected: pb.ShardRejected | None = None
    nonfinite: list[pb.ShardNonFinite] = field(default_factory=list)
    #: The outer state to save before `sends` go out (a DiLoCo step committed here).
    saves: list[PersistOuter] = field(default_factory=list)


@dataclass(frozen=True)
class Followed:
    """What applying a membership event produced: the averages a dropped rank or a rank
    out of inputs completed, and the rank whose rejoin broke the step's rank order
    (with the rejection naming it), if any."""

    actions: list[Action]
    refused: tuple[int, RejectedMessage] | None = None


def _outcome(
    actions: list[Action],
    rejected: pb.ShardRejected | None = None,
    nonfinite: list[pb.ShardNonFinite] | None = None,
) -> ShardOutcome:
    """A shard's outcome of `actions`: only the averaged chunks (a shard sends no StepReport
    or StepAborted) and the outer-state saves (they go before the step's last answers)."""
    sends = []
    saves = []
    for action in actions:
        if isinstance(action, PersistOuter):
            saves.append(action)
        if not isinstance(action, Send) or isinstance(action.message, ResumeBlob):
            continue
        message = action.message
        if isinstance(message, bytes | SegmentAverage) or message.WhichOneof("kind") == "gradient":
            sends.append(action)
    return ShardOutcome(sends, rejected, nonfinite or [], saves)


def check_view(view: pb.ShardJobView, shard_index: int) -> str | None:
    """Why a first `ShardJobView` cannot start a job at shard `shard_index`, or None."""
    if not view.job_id:
        return "a job view without a job id"
    if not 0 <= shard_index < view.shard_count:
        return (
            f"job '{view.job_id}' is cut into {view.shard_count} shards, but this is shard "
            f"{shard_index}"
        )
    if view.chunk_bytes < 1:
        return f"job '{view.job_id}' has chunk size {view.chunk_bytes}"
    # A job without buckets is a process group's (collectives only): a shard follows
    # it for its ranges of the group's all-reduces (`rpc.shard_collectives`).
    return None


class JobPlane:
    """One job's data plane for one byte range: the announced membership and the open step.

    Args:
        job_id: the job's name; the others are the open step's (`OpenStep`; `observer`
            is its `metrics`, `shard_name` e.g. "shard 2 at 10.0.0.5:50051", `nonfinite`
            the leader's policy at a shard).

    Raises:
        ValueError: as `OpenStep`.
    """

    def __init__(
        self,
        job_id: str,
        chunk_bytes: int,
        shard_count: int,
        budget: ByteBudget | OwnerBudget,
        clock: Callable[[], float],
        observer: StepObserver | None = None,
        shard_index: int = 0,
        shard_name: str | None = None,
        nonfinite: str = defaults.NONFINITE,
    ) -> None:
        self.job_id = job_id
        self.shard_name = shard_name or f"shard {shard_index}"
        self.membership = MembershipView(job_id)
        self._nonfinite: list[pb.ShardNonFinite] = []
        self.step = OpenStep(
            self.membership,
            chunk_bytes,
            budget,
            clock,
            observer,
            shard_index=shard_index,
            shard_count=shard_count,
            nonfinite=nonfinite,
            shard_name=self.shard_name,
            on_nonfinite=self._forward_nonfinite if shard_index else None,
        )
        self._reported: deque[int] = deque(maxlen=_REPORTED_STEPS_REMEMBERED)

    @classmethod
    def for_shard(
        cls,
        view: pb.ShardJobView,
        shard_index: int,
        shard_name: str,
        budget: ByteBudget,
        clock: Callable[[], float],
        observer: StepObserver | None = None,
        nonfinite: str = defaults.NONFINITE,
    ) -> JobPlane:
        """A shard's plane for the job its leader announced with `view` (started at once).

        Raises:
            ValueError: the view cannot start a job at this shard (see `check_view`).
        """
        problem = check_view(view, shard_index)
        if problem is None and shard_index == 0:
            problem = f"job '{view.job_id}': shard 0 is the leader's own range"
        if problem is not None:
            raise ValueError(problem)
        plane = cls(
            view.job_id,
            view.chunk_bytes,
            view.shard_count,
            budget,
            clock,
            observer,
            shard_index=shard_index,
            shard_name=shard_name,
            nonfinite=nonfinite,
        )
        plane.start(view)
        return plane

    # ------------------------------------------------------------ control events
    def start(self, view: pb.ShardJobView) -> None:
        """The job started: its members, then its bucket layout and first step."""
        self.follow(view)  # the step holds nothing yet: members, epoch and groups only
        outer = view.outer if view.HasField("outer") else None
        signature = pb.ModelSignature(buckets=view.buckets, outer=outer, screen=view.screen)
        self.step.configure(signature, view.start_step)

    def follow(self, view: pb.ShardJobView) -> Followed:
        """The membership changed: members and epoch first, then the step follows."""
        membership, step = self.membership, self.step
        new = {m.rank: PlaneMember(m.rank, m.incarnation, m.session) for m in view.members}
        old = membership.members
        removed = [r for r in sorted(old) if r not in new or new[r] != old[r]]
        added = [r for r in sorted(new) if r not in old or new[r] != old[r]]
        shrinks = view.membership_epoch != membership.epoch
        membership.epoch = view.membership_epoch
        membership.groups.replace(group.ranks for group in view.local_groups)
        for rank in removed:
            del membership.members[rank]
            step.out_of_inputs.discard(rank)
        actions: list[Action] = []
        for rank in removed if shrinks else ():
            actions += step.drop_rank(rank)
        refused = None
        for rank in added:
            membership.members[rank] = new[rank]
            try:
                step.add_rank(rank)
            except ValueError:
                refused = (
                    rank,
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
        return Followed(actions, refused)

    def abort(self, step: int) -> None:
        """`step` was aborted: drop what the plane holds of it, if it is the open one.

        A later step is remembered too, so that the plane skips it once it gets
        there and late chunks for it are dropped quietly.
        """
        if step < self.step.step:
            return
        self.step.remember_aborted(step)
        self._skip_aborted()

    def _skip_aborted(self) -> None:
        while self.step.was_aborted(self.step.step):
            self.step.drop_step()

    # ------------------------------------------------------------ a shard's view
    def apply(self, view: pb.ShardJobView) -> ShardOutcome:
        """At a shard: follow the leader's view; averages to send, or the rejection to report."""
        followed = self.follow(view)
        rejected = None if followed.refused is None else self.report(*followed.refused)
        return _outcome(followed.actions, rejected)

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
            f"rank {rank} of job '{self.job_id}' presented {presented} the leader derived for "
            f"{self.shard_name} from that rank's session at its Join; a data stream acts for a "
            "rank only on its own session"
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
        return chunk.membership_epoch > self.membership.epoch or chunk.step > self.step.step

    # ---------------------------------------------------------------- gradients
    def accept(self, rank: int, chunk: ChunkHeader, payload: memoryview) -> list[Action]:
        """Fold one chunk in; return the averaged chunks (and, at the end, the StepReport).

        Raises:
            RejectedMessage: the chunk does not belong to this step or is malformed.
        """
        step = self.step
        if chunk.step < step.step and step.was_aborted(chunk.step):
            return []  # late upload for a step everyone was already told is aborted
        open_step = step.step
        actions = step.accept(rank, chunk, payload)
        if step.step != open_step:
            self._skip_aborted()  # the step completed: the next may have been aborted already
        return actions

    def on_gradient(self, rank: int, chunk: ChunkHeader, payload: memoryview) -> ShardOutcome:
        """At a shard: fold one chunk in; the averaged chunks, or the rejection to report."""
        try:
            actions = self.accept(rank, chunk, payload)
        except RejectedMessage as rejection:
            return ShardOutcome([], self.report(rank, rejection, chunk.step))
        nonfinite, self._nonfinite = self._nonfinite, []
        return _outcome(actions, nonfinite=nonfinite)

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

    def report(
        self, rank: int, rejection: RejectedMessage, step: int | None = None
    ) -> pb.ShardRejected | None:
        """The ShardRejected for the leader, once per step (None: that step was reported).

        Args:
            step: the step the refused message was for, when `rejection` does not say
                (default: the open step).
        """
        failed = rejection.step if rejection.step is not None else step
        failed = self.step.step if failed is None else failed
        culprit = rejection.rank if isinstance(rejection, NonFiniteRejection) else -1
        if failed in self._reported:
            return None  # the leader aborts the whole step for the first one
        self._reported.append(failed)
        message = rejection.message
        if self.shard_name not in message:
            message += f" ({self.shard_name})"
        return pb.ShardRejected(
            job_id=self.job_id,
            # A non-finite sum of a local group: the member it names, not its leader (an
            # outer average of finite contributions names none: the rank that completed it).
            rank=culprit if culprit >= 0 else rank,
            via_local_leader=culprit >= 0 and culprit != rank,
            step=failed,
            bucket_index=rejection.bucket_index,
            code=int(rejection.code),
            message=message,
            reason=(
                pb.ABORT_REASON_NONFINITE
                if isinstance(rejection, NonFiniteRejection)
                else pb.ABORT_REASON_MESSAGE_REJECTED
            ),
        )
