"""The reply of `Coordinator.Status` (what `gradsync status` shows), built from the jobs.

Status reads every component of a job (membership, liveness, the open step,
persistence) and the straggler statistics of the metrics, so building it
belongs to none of them and not to the servicer, which only answers the RPC
with what this returns. Pure logic, no gRPC, no asyncio.
"""

from __future__ import annotations

from collections.abc import Iterable

from gradsync.server.job import Job
from gradsync.server.metrics import LagTracker
from gradsync.v1 import gradsync_pb2 as pb


def job_status(job: Job, lag_tracker: LagTracker | None = None) -> pb.JobStatus:
    """A snapshot of `job`: state, members, late ranks, progress and checkpoints."""
    late = job.late_ranks()
    progress = job.progress
    return pb.JobStatus(
        job_id=job.job_id,
        state=job.state.value,
        world_size=job.world_size,
        membership_epoch=job.membership_epoch,
        open_step=job.open_step,
        steps_completed=job.steps_completed,
        members=[
            pb.MemberStatus(
                rank=member.rank,
                incarnation=member.incarnation,
                peer=member.peer,
                last_seen_s=job.liveness.seconds_since_seen(member.rank),
                reported_step=job.liveness.reported_step(member.rank),
                mean_lag_s=(lag_tracker.mean_lag(member.rank) or 0.0) if lag_tracker else 0.0,
            )
            for _, member in sorted(job.members.items())
        ],
        late=[pb.LateRank(rank=r, bucket_indices=b) for r, b in sorted(late.items())],
        step_age_s=progress.age() if progress is not None else 0.0,
        last_checkpoint_step=job.persistence.last_checkpoint_step,
    )


def status_reply(
    jobs: Iterable[Job],
    job_id: str,
    heartbeat_timeout_s: float,
    lag_tracker: LagTracker | None = None,
) -> pb.StatusReply:
    """Every job (or only `job_id` when it is not empty), sorted by job id."""
    selected = sorted((job for job in jobs if not job_id or job.job_id == job_id), key=_job_id)
    return pb.StatusReply(
        jobs=[job_status(job, lag_tracker) for job in selected],
        heartbeat_timeout_s=heartbeat_timeout_s,
    )


def _job_id(job: Job) -> str:
    return job.job_id
