"""The reply of `Coordinator.Status` (what `gradsync status` shows), built from the jobs.

Status reads every component of a job (membership, liveness, the open step,
persistence) and the straggler statistics of the metrics, so building it
belongs to none of them and not to the servicer, which only answers the RPC
with what this returns. Jobs that ended stay in the reply for a while
(`EndedJobs`: the last 32, for 10 minutes), so that `gradsync status` run
after a job can still say how it ended. Pure logic, no gRPC, no asyncio.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable

from gradsync_proto.v1 import gradsync_pb2 as pb

from gradsync_server import defaults
from gradsync_server.control.job import Job
from gradsync_server.dataplane.observer import LagTracker


def job_status(job: Job, lag_tracker: LagTracker | None = None) -> pb.JobStatus:
    """A snapshot of `job`: state, members, late ranks, progress, checkpoints, NaN/Inf seen."""
    late = job.late_ranks()
    progress = job.in_flight.progress
    outer = job.in_flight.outer
    screen = job.in_flight.screen
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
        nonfinite_contributions=job.in_flight.nonfinite.count,
        last_nonfinite=job.in_flight.nonfinite.last,
        screen=screen.policy.value if screen is not None else "",
        screened_contributions=screen.count if screen is not None else 0,
        last_screened=screen.last if screen is not None else "",
        outer=outer.active,
        outer_rounds=outer.rounds,
        outer_state_bytes=outer.held_bytes(),
        outer_state=job.outer_state,
        restart=job.restart_line,
        steps_recomputed=job.steps_recomputed,
    )


class EndedJobs:
    """The last outcomes of jobs that ended, kept for a while.

    Args:
        clock: monotonic time source (injectable for tests).
        keep: how many ended jobs to keep (the oldest go first).
        keep_s: how long to keep each.
    """

    def __init__(
        self,
        clock: Callable[[], float],
        keep: int = defaults.ENDED_JOBS_KEPT,
        keep_s: float = defaults.ENDED_JOBS_KEPT_S,
    ) -> None:
        self._clock = clock
        self._keep_s = keep_s
        self._ended: deque[tuple[float, pb.JobStatus]] = deque(maxlen=keep)

    def record(self, job: Job, lag_tracker: LagTracker | None = None) -> pb.JobStatus:
        """Remember how `job` ended (its last snapshot, state = outcome); return it."""
        state, outcome = job.outcome()
        snapshot = job_status(job, lag_tracker)
        snapshot.state, snapshot.ended, snapshot.outcome = state, True, outcome
        del snapshot.late[:]
        snapshot.step_age_s = 0.0
        self._ended.append((self._clock(), snapshot))
        return snapshot

    def snapshots(self) -> list[pb.JobStatus]:
        """The ended jobs still kept, newest first, with their age filled in."""
        now = self._clock()
        while self._ended and now - self._ended[0][0] > self._keep_s:
            self._ended.popleft()
        kept = []
        for ended_at, snapshot in reversed(self._ended):
            copy = pb.JobStatus()
            copy.CopyFrom(snapshot)
            copy.ended_s_ago = now - ended_at
            kept.append(copy)
        return kept


def status_reply(
    jobs: Iterable[Job],
    job_id: str,
    heartbeat_timeout_s: float,
    lag_tracker: LagTracker | None = None,
    ended: Iterable[pb.JobStatus] = (),
) -> pb.StatusReply:
    """Every live job (or only `job_id` when not empty), sorted by id, then the ended ones."""
    selected = sorted(
        (job for job in jobs if not job_id or job.job_id == job_id), key=lambda job: job.job_id
    )
    return pb.StatusReply(
        jobs=[job_status(job, lag_tracker) for job in selected]
        + [status for status in ended if not job_id or status.job_id == job_id],
        heartbeat_timeout_s=heartbeat_timeout_s,
    )
