"""`gradsync status`: ask a coordinator who is in which job, where, and who is late."""

from __future__ import annotations

import grpc

from gradsync.protocol import defaults
from gradsync.v1 import gradsync_pb2 as pb

STATUS_METHOD = "/gradsync.v1.Coordinator/Status"


def query_status(
    address: str, job_id: str = "", timeout_s: float = defaults.STATUS_TIMEOUT_S
) -> pb.StatusReply:
    """Call Coordinator.Status.

    Raises:
        ConnectionError: the coordinator could not be reached in time (with the cause).
    """
    with grpc.insecure_channel(address) as channel:
        call = channel.unary_unary(
            STATUS_METHOD,
            request_serializer=pb.StatusRequest.SerializeToString,
            response_deserializer=pb.StatusReply.FromString,
        )
        try:
            reply: pb.StatusReply = call(pb.StatusRequest(job_id=job_id), timeout=timeout_s)
        except grpc.RpcError as exc:
            raise ConnectionError(
                f"no status from {address} within {timeout_s:g}s: {exc.code().name}: "
                f"{exc.details()}"
            ) from exc
    return reply


def format_status(reply: pb.StatusReply) -> str:
    """A human-readable report of a StatusReply."""
    if not reply.jobs:
        return "no jobs"
    lines = []
    for job in reply.jobs:
        checkpoint = (
            f"last checkpoint step {job.last_checkpoint_step}"
            if job.last_checkpoint_step >= 0
            else "no checkpoint"
        )
        lines.append(
            f"job '{job.job_id}': {job.state}, {len(job.members)}/{job.world_size} workers, "
            f"epoch {job.membership_epoch}, step {job.open_step} "
            f"({job.steps_completed} completed), {checkpoint}"
        )
        for member in job.members:
            lines.append(
                f"  rank {member.rank}: {member.peer or '?'}, last heard {member.last_seen_s:.1f}s "
                f"ago, at step {member.reported_step}, mean lag {member.mean_lag_s * 1e3:.1f} ms"
            )
        lagging = sorted(job.members, key=lambda m: m.mean_lag_s, reverse=True)
        if lagging and lagging[0].mean_lag_s > 0:
            lines.append(
                "  slowest ranks (mean bucket lag): "
                + ", ".join(f"rank {m.rank} {m.mean_lag_s * 1e3:.1f} ms" for m in lagging[:3])
            )
        if job.late:
            waiting = ", ".join(
                f"rank {late.rank} (buckets {list(late.bucket_indices)})" for late in job.late
            )
            lines.append(
                f"  step {job.open_step} is {job.step_age_s:.1f}s old, waiting for {waiting}"
            )
    return "\n".join(lines)
