"""What a sharded leader tells its shards about each job, and how a lost shard ends jobs.

The leader is the only authority over a job; its shards replicate what they
need to aggregate their ranges (members and epoch, who ran out of inputs, the
bucket layout) from `ShardJobView`s, drop aborted steps on `ShardAbort`, and
end the job's data streams on `ShardJobEnd`. This module derives those
messages from the job and from the actions the job returned, so that the
glue (`shard_control`) never has to hook into the job's components: a view
is due whenever its `view_key` changed, an abort whenever a StepAborted is
about to be sent. Pure logic, no gRPC, no asyncio.
"""

from __future__ import annotations

from collections.abc import Iterable

from gradsync_proto.codes import Code
from gradsync_proto.v1 import gradsync_pb2 as pb

from gradsync_server.control.job import Job, JobState
from gradsync_server.dataplane.actions import Action, SegmentAverage, Send
from gradsync_server.dataplane.step_aborts import abort_actions
from gradsync_server.errors import RejectedMessage

#: What identifies a view: epoch, members (rank, incarnation, session), ranks out of
#: inputs, local groups.
ViewKey = tuple[
    int, tuple[tuple[int, str, bytes], ...], tuple[int, ...], tuple[tuple[int, ...], ...]
]


def view_key(job: Job) -> ViewKey | None:
    """The part of `job` its shards replicate, or None when they need no view (not running)."""
    if job.state is not JobState.RUNNING:
        return None
    members = tuple((rank, m.incarnation, m.session) for rank, m in sorted(job.members.items()))
    groups = tuple(job.membership.groups.groups())
    return job.membership_epoch, members, tuple(sorted(job.in_flight.out_of_inputs)), groups


def job_view(job: Job, shard_count: int) -> pb.ShardJobView:
    """The full ShardJobView of `job` as it stands (a shard replaces what it knew)."""
    signature = job.membership.signature
    buckets = list(signature.buckets) if signature is not None else []
    return pb.ShardJobView(
        job_id=job.job_id,
        world_size=job.world_size,
        membership_epoch=job.membership_epoch,
        members=[
            pb.ShardMember(rank=rank, incarnation=member.incarnation, session=member.session)
            for rank, member in sorted(job.members.items())
        ],
        out_of_inputs=sorted(job.in_flight.out_of_inputs),
        start_step=job.open_step,
        buckets=buckets,
        chunk_bytes=job.chunk_bytes,
        shard_count=shard_count,
        local_groups=[pb.LocalGroup(ranks=group) for group in job.membership.groups.groups()],
    )


def aborted_steps(actions: Iterable[Action]) -> list[int]:
    """Steps that `actions` tell workers are aborted, once each, in order."""
    steps: list[int] = []
    for action in actions:
        if not isinstance(action, Send) or isinstance(action.message, bytes | SegmentAverage):
            continue
        if action.message.WhichOneof("kind") == "step_aborted":
            step = action.message.step_aborted.step
            if step not in steps:
                steps.append(step)
    return steps


def reject_for_shard(job: Job, rank: int, rejection: RejectedMessage) -> list[Action] | None:
    """A shard refused `rank`'s message for `rejection.step`: abort that step for every rank.

    The leader's open step may already be the next one: its own range of the
    step completed while the shard's cannot, and the workers still wait for
    the shard's averages, so that step is aborted all the same (the leader
    keeps its own step). None when there is nothing to abort: the job is not
    running, the rank is not a member, or the step was aborted already.
    """
    step = rejection.step
    if job.state is not JobState.RUNNING or rank not in job.members or step is None:
        return None
    if step == job.open_step:
        return job.reject(rank, rejection)
    if step + 1 != job.open_step or job.in_flight.was_aborted(step):
        return None
    job.in_flight.remember_aborted(step)
    # Its range completed here (and was counted), but the step did not complete: status
    # says so. (The Prometheus counter of completed steps cannot be taken back.)
    job.in_flight.steps_completed -= 1
    return abort_actions(job.membership.ranks(), rank, step, rejection)


def job_end_code(job: Job) -> tuple[Code, str]:
    """The status a shard ends `job`'s data streams with once the leader forgets it."""
    state, outcome = job.outcome()
    if state in ("finished", "abandoned"):
        return Code.OK, outcome
    return Code.ABORTED, f"job '{job.job_id}' ended at the leader ({state}): {outcome}"


def shard_lost_message(index: int, address: str, why: str, job: Job) -> str:
    """What every rank of `job` is told when shard `index` at `address` was lost."""
    checkpoint = job.persistence.last_checkpoint_step
    if job.state is JobState.ASSEMBLING:
        then = f"job '{job.job_id}' starts once every shard is registered again"
    elif checkpoint >= 0:
        then = (
            f"job '{job.job_id}' stops at step {job.open_step} and resumes from its last "
            f"checkpoint (step {checkpoint}) once every shard is registered again"
        )
    else:
        then = (
            f"job '{job.job_id}' stops at step {job.open_step}; it has no checkpoint, so it "
            "starts again from the beginning once every shard is registered again"
        )
    return f"shard {index} at {address} was lost ({why}); {then}"


def end_for_shard_loss(job: Job, index: int, address: str, why: str) -> list[Action]:
    """End every stream of `job`: UNAVAILABLE, reason SHARD_LOST (workers reconnect)."""
    details = shard_lost_message(index, address, why, job)
    return job.end(Code.UNAVAILABLE, details, pb.END_REASON_SHARD_LOST)
