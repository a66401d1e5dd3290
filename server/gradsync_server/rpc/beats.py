"""`Coordinator.Beat`: a worker's heartbeat on a connection that carries no bulk data.

A worker whose Sync stream runs on the frame port keeps a gRPC channel to the
coordinator open beside it (for keepalive pings, `gradsync_proto.net.frame_stream`)
and sends its heartbeats there too, as unary `Beat` calls. Gradient bytes never
travel on that connection, so a beat does not wait behind the megabytes a slow
link holds in the frame socket's send queue, and a busy rank is not declared
dead for a full upload.

A beat is only a sign of life when it proves the rank's session: its `proof`
is a MAC keyed with the session secret the leader issued at the Join
(`gradsync_proto.auth.beat_proof`), and its sequence must exceed every one
accepted from that session, so a beat seen on the wire cannot keep a rank alive
after its worker is gone. A refused beat changes nothing and is answered with
the reason (NOT_FOUND, PERMISSION_DENIED, FAILED_PRECONDITION).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

import grpc
from gradsync_proto import auth
from gradsync_proto.v1 import gradsync_pb2 as pb

from gradsync_server.control.job import Job

log = logging.getLogger("gradsync.server")

__all__ = ["BeatRefused", "serve_beat", "take_beat"]


class BeatRefused(Exception):
    """A beat that does not count; `code` and `details` are its answer."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code = code
        self.details = details


def take_beat(jobs: Mapping[str, Job], request: pb.BeatRequest) -> pb.BeatReply:
    """Count `request` as a sign of life of its rank, or raise BeatRefused saying why."""
    job = jobs.get(request.job_id)
    where = f"rank {request.rank} of job '{request.job_id}', beat {request.sequence}"
    if job is None:
        raise BeatRefused(grpc.StatusCode.NOT_FOUND, f"{where}: no such job here")
    last = job.liveness.last_beat_sequence(request.rank)
    session = job.membership.session_of(request.rank)
    if last is None or not session:
        raise BeatRefused(grpc.StatusCode.NOT_FOUND, f"{where}: the rank is not in the job")
    if not auth.beat_matches(
        session, request.job_id, request.rank, request.sequence, request.step, request.proof
    ):
        raise BeatRefused(
            grpc.StatusCode.PERMISSION_DENIED,
            f"{where}: the proof does not match the rank's session "
            "(a beat from an earlier incarnation, or not from the worker)",
        )
    if request.sequence <= last:
        raise BeatRefused(
            grpc.StatusCode.FAILED_PRECONDITION,
            f"{where}: sequence {request.sequence} is not above {last}, the last accepted",
        )
    job.liveness.beat(request.rank, request.sequence, request.step)
    return pb.BeatReply(member=request.rank in job.membership.members)


async def serve_beat(
    jobs: Mapping[str, Job], raw: bytes, context: grpc.aio.ServicerContext
) -> pb.BeatReply:
    """The `Beat` RPC (raw request bytes: one that does not parse is INVALID_ARGUMENT,
    by `servicer.guarded`)."""
    request = pb.BeatRequest.FromString(raw)
    try:
        return take_beat(jobs, request)
    except BeatRefused as refused:
        log.debug("beat refused from %s: %s", context.peer(), refused.details)
        await context.abort(refused.code, refused.details)
        raise  # not reached: abort raises
