"""The coordinator servicer in the leader role: the control plane around the worker streams.

The leader admits a worker's `Sync` stream by its `Join` (checks in
`admission`), creates and retires jobs, and hands parsed messages to the
job's state machine (`gradsync_server.control.job`), whose actions
`delivery` carries out. Around that: liveness in `watchdog`, checkpoint
store I/O in `checkpointer`, the status reply in `status`, the shards'
control streams (`Coordinator.ShardLink`) in `shard_control`, same-host local
leaders' shared-memory segments in `segments` and `payload_socket`, the
workers' side-channel heartbeats in `serve_beat` here. The stream itself is
`servicer`'s, as at a shard.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Awaitable, Callable, Mapping

import grpc
from gradsync_proto import auth
from gradsync_proto.codec import ChunkHeader, header_of
from gradsync_proto.codes import Code
from gradsync_proto.payload_socket import Registration
from gradsync_proto.v1 import gradsync_pb2 as pb

from gradsync_server.config import CoordinatorConfig
from gradsync_server.control.admission import (
    SHUTTING_DOWN,
    first_message_problem,
    job_world_size,
    join_problem,
    new_job,
    too_many_jobs,
)
from gradsync_server.control.job import Job, JobState
from gradsync_server.control.outer_resume import OuterReading
from gradsync_server.control.status import EndedJobs, status_reply
from gradsync_server.dataplane.actions import Action
from gradsync_server.dataplane.budget import ByteBudget
from gradsync_server.errors import RejectedMessage
from gradsync_server.metrics import CoordinatorMetrics
from gradsync_server.rpc.checkpointer import Checkpointer
from gradsync_server.rpc.connection import Connection
from gradsync_server.rpc.delivery import Delivery
from gradsync_server.rpc.kv_store import KeyValueStore
from gradsync_server.rpc.segments import SegmentRegistry, leader_session
from gradsync_server.rpc.servicer import (
    SERVICE_NAME,
    SHUTDOWN_FLUSH_S,
    CoordinatorServicer,
    guarded,
)
from gradsync_server.rpc.shard_control import ShardControl
from gradsync_server.rpc.watchdog import Watchdog, log_rank_lost
from gradsync_server.store.checkpoint import CheckpointStore
from gradsync_server.text import MAX_REASON_CHARS, quoted

log = logging.getLogger("gradsync.server")

#: The `Job` method that handles each kind of worker message that only turns into
#: actions (looked up on the job at each call).
_JOB_HANDLERS: dict[str, Callable[[Job, int, pb.WorkerMessage], list[Action]]] = {
    "abandon": lambda job, rank, msg: job.on_abandon(rank, msg.abandon),
    "checkpoint": lambda job, rank, msg: job.on_checkpoint_chunk(rank, msg.checkpoint),
    "collective": lambda job, rank, msg: job.on_collective(rank, msg.collective),
    "local_posted": lambda job, rank, msg: job.on_local_posted(rank, msg.local_posted),
    "out_of_inputs": lambda job, rank, msg: job.on_out_of_inputs(rank, msg.out_of_inputs),
    "state": lambda job, rank, msg: job.on_state_chunk(rank, msg.state),
}


class LeaderRole(CoordinatorServicer):
    """The coordinator servicer of a leader: its jobs, worker streams and control plane."""

    service = SERVICE_NAME
    stream_method = "Sync"

    def __init__(
        self,
        config: CoordinatorConfig,
        store: CheckpointStore | None = None,
        clock: Callable[[], float] = time.monotonic,
        metrics: CoordinatorMetrics | None = None,
    ) -> None:
        super().__init__(
            config,
            ByteBudget(config.max_buffered_bytes, config.max_job_buffered_bytes),
            clock,
            metrics or CoordinatorMetrics(),
            config.shutdown_grace_s,
        )
        self.jobs: dict[str, Job] = {}
        self.checkpointer = Checkpointer(config, store)
        #: The rendezvous store torch.distributed's ranks meet through (`Coordinator.Store`).
        self.kv_store = KeyValueStore()
        self.shard_control = ShardControl(self, config, clock, self.metrics)
        self.watchdog = Watchdog(self, extra_checks=(self.shard_control.check,))
        self.ended_jobs = EndedJobs(lambda: self.clock())
        #: Same-host local leaders' segments (see `segments`); one per stream at most.
        self.segments = SegmentRegistry(config.max_connections, config.chunk_bytes, self.metrics)
        #: (payload socket name, this coordinator's host id) once the socket listens.
        self.payload_endpoint: tuple[str, str] | None = None
        self._delivery = Delivery[Job](
            self.connections,
            self.metrics,
            self.checkpointer.outer,
            self._detach,
            self.segments,
            before=self.shard_control.before_delivery,
            persist=self.checkpointer.persist,
        )
        #: Carries out a job's actions (also for the watchdog and the shards' control).
        self.execute = self._delivery.execute

    def _other_methods(self) -> dict[str, grpc.RpcMethodHandler]:
        return {
            # Raw request bytes: one that does not parse is INVALID_ARGUMENT (gRPC's
            # deserializer would say UNKNOWN with a traceback; found by the fuzzer).
            "Status": grpc.unary_unary_rpc_method_handler(
                guarded("Status", self.status), response_serializer=pb.StatusReply.SerializeToString
            ),
            "ShardLink": grpc.stream_stream_rpc_method_handler(
                guarded("ShardLink", self.shard_control.link, self.stream_count),
                request_deserializer=pb.ShardMessage.FromString,
            ),
            "Store": grpc.unary_unary_rpc_method_handler(
                guarded("Store", self.kv_store.serve),
                response_serializer=pb.StoreReply.SerializeToString,
            ),
            "Beat": grpc.unary_unary_rpc_method_handler(
                guarded("Beat", functools.partial(serve_beat, self.jobs)),
                response_serializer=pb.BeatReply.SerializeToString,
            ),
        }

    async def status(self, raw: bytes, context: grpc.aio.ServicerContext) -> pb.StatusReply:
        """Membership, progress and late ranks of every job (or one), and the shards."""
        request = pb.StatusRequest.FromString(raw)  # bad bytes: INVALID_ARGUMENT (`guarded`)
        reply = status_reply(
            self.jobs.values(),
            request.job_id,
            self.config.heartbeat_timeout_s,
            self.metrics.lag_tracker,
            self.ended_jobs.snapshots(),
        )
        reply.shards.extend(self.shard_control.statuses())
        reply.recovery.CopyFrom(self.metrics.recovery.summary())
        return reply

    def check_liveness(self) -> None:
        """One watchdog pass (also called directly by tests with a fake clock)."""
        self.watchdog.check()

    def declare_dead(self, job: Job, rank: int, details: str) -> None:
        """End a silent rank's stream (ABORTED, reason DECLARED_DEAD) and drop it from `job`."""
        conn = self.connections.pop((job.job_id, rank), None)
        if conn is not None:
            conn.end(Code.ABORTED, f"rank {rank} {details}", pb.END_REASON_DECLARED_DEAD)
            conn.job, conn.job_id = None, None
        self._leave_job(job, rank, orderly=False, reason=f"{details} in")

    async def drain(self, grace_s: float) -> None:
        """Shutdown: let streams finish for `grace_s`, then end the rest as shutting down.

        Those get UNAVAILABLE with reason SHUTTING_DOWN (the one case
        UNAVAILABLE is for: a restarted coordinator may be reached again) and
        a moment to flush it before the server cancels what is left.
        """
        self.draining = True
        await self.streams_ended(grace_s)
        for conn in list(self.streams):
            conn.end(Code.UNAVAILABLE, SHUTTING_DOWN, pb.END_REASON_SHUTTING_DOWN)
        await self.streams_ended(SHUTDOWN_FLUSH_S)

    # ----------------------------------------------------------- dispatching
    def _unparsable(self, conn: Connection, raw: bytes, exc: Exception) -> RejectedMessage:
        return RejectedMessage(
            Code.INVALID_ARGUMENT,
            f"rank {conn.rank} sent {len(raw)} bytes that do not parse as a "
            f"gradsync.v1.WorkerMessage: {exc}",
        )

    def _admit(
        self, conn: Connection, message: pb.WorkerMessage, size: int
    ) -> Awaitable[None] | None:
        """A worker's stream opens with its Join (returned as a coroutine to await)."""
        problem = first_message_problem(message.WhichOneof("kind"), size)
        if problem is not None:
            conn.end(*problem)
            return None
        return self._join(conn, message.join)

    def _message(
        self, conn: Connection, message: pb.WorkerMessage, raw: bytes
    ) -> Awaitable[None] | None:
        job = conn.job
        if job is None:
            return None  # (admitted streams have a job until they are detached and ended)
        kind = message.WhichOneof("kind")
        job.liveness.touch(conn.rank)
        try:
            handle = _JOB_HANDLERS.get(kind or "")
            if handle is not None:
                self.execute(job, handle(job, conn.rank, message))
            elif kind == "heartbeat":
                job.liveness.touch(conn.rank, message.heartbeat.step)
            elif kind == "gradient":
                chunk = message.gradient
                self._gradient(conn, header_of(chunk), memoryview(chunk.payload))
            elif kind == "leave":
                conn.left = True
                log.info(
                    "job '%s': rank %d left (%s)",
                    job.job_id,
                    conn.rank,
                    quoted(message.leave.reason, MAX_REASON_CHARS) or "no reason given",
                )
                self._detach(conn)
                conn.end(Code.OK, "goodbye")
            elif kind == "join":
                conn.end(Code.FAILED_PRECONDITION, f"rank {conn.rank} sent Join twice")
            else:
                self._reject(
                    conn,
                    RejectedMessage(
                        Code.INVALID_ARGUMENT, f"rank {conn.rank} sent an empty WorkerMessage"
                    ),
                )
        except RejectedMessage as rejection:
            log.warning("job '%s': ending rank %d: %s", job.job_id, conn.rank, rejection.message)
            conn.refused = rejection.message  # the ranks it leaves behind hear why
            conn.end(rejection.code, rejection.message)
        return None

    def _gradient(
        self, conn: Connection, chunk: ChunkHeader, payload: memoryview
    ) -> Awaitable[None] | None:
        """Fold a chunk in; an in-segment one's payload is read from the sender's segment first."""
        job = conn.job
        if job is None:
            return None  # (admitted streams have a job until they are detached and ended)
        if chunk.in_segment:
            try:
                read = self.segments.read_for(job, conn.rank, chunk)
            except RejectedMessage as rejection:
                self._reject(conn, rejection)
                return None
            if read is None:
                return None  # the rest of an aborted step's upload: dropped as over TCP
            payload = read
        self.metrics.observe_chunk(len(payload))
        job.liveness.touch(conn.rank)
        self.execute(job, job.on_gradient(conn.rank, chunk, payload))
        return None

    def admit_segment(self, registration: Registration, fd: int) -> str | None:
        """A local leader registers its segment (on the loop; `fd` is owned from here on)."""
        conn = self.connections.get((registration.job_id, registration.rank))
        job = conn.job if conn is not None else None
        live = job is not None and self.jobs.get(registration.job_id) is job
        expected = leader_session(job, registration.rank) if live and job is not None else b""
        return self.segments.register(registration, fd, expected)

    def _reject(self, conn: Connection, rejection: RejectedMessage) -> None:
        """A malformed message: abort the sender's open step, or end its stream."""
        log.warning("rejected message from %s: %s", conn.peer, rejection.message)
        if conn.job is None:
            conn.end(rejection.code, rejection.message)
        else:
            self.execute(conn.job, conn.job.reject(conn.rank, rejection))

    async def _join(self, conn: Connection, join: pb.Join) -> None:
        job_id = join.job_id
        config = self.config
        problem = join_problem(
            join, config, self.draining, job_id in self.jobs, running_jobs=len(self.jobs)
        )
        if problem is not None:
            log.warning("refused join from %s: %s", conn.peer, problem[1])
            waiting = self.jobs.get(job_id)
            if waiting is not None and not self.draining:
                self.execute(waiting, waiting.refused_join(join.rank, problem[1]))
            reason = pb.END_REASON_SHUTTING_DOWN if self.draining else None
            conn.end(*problem, reason)
            return
        job = self.jobs.get(job_id)
        if job is not None and job.state in (JobState.BROKEN, JobState.REFUSED):
            # A rank restarted after the job failed: the failed job is over (its
            # survivors were told), and the restarted ranks start a new one.
            log.info("job '%s' is %s; rank %d starts it anew", job_id, job.state.value, join.rank)
            self.retire_job(job)
            job = None
        if job is None:
            # In a store thread with a deadline: a hung store must not freeze other jobs.
            resume, problem = await self.checkpointer.load_resume(job_id, join.signature)
            outer_reading: OuterReading | None = None
            if join.signature.HasField("outer") and self.checkpointer.outer.enabled:
                outer_reading = await self.checkpointer.outer.load_all(
                    job_id, config.shard_count, config.fresh_start
                )
            job = self.jobs.get(job_id)  # another rank's Join may have created it meanwhile
            if job is not None and job.state in (JobState.BROKEN, JobState.REFUSED):
                job = None  # ... and it failed already: this rank starts it anew below
            if job is None and problem is None and len(self.jobs) >= config.max_jobs:
                problem = too_many_jobs(len(self.jobs), config.max_jobs)
        if job is None and problem is not None:
            log.error("refused join of rank %d to job '%s': %s", join.rank, job_id, problem[1])
            conn.end(*problem, pb.END_REASON_JOB_REFUSED)
            return
        if job is None:
            stale = self.jobs.get(job_id)
            if stale is not None:
                self.retire_job(stale)
            job = self.jobs[job_id] = new_job(
                job_id,
                config,
                self.budget,
                self.clock,
                self.metrics,
                self.shard_control.registry.shard_map,
                self.payload_endpoint,
                world_size=job_world_size(join, config),
            )
            job.persistence.resume_from(resume)
            job.outer_reading = outer_reading
            job.persist_outer = self.checkpointer.outer.enabled
        try:
            actions = job.join(join.rank, join)
        except RejectedMessage as rejection:
            log.warning(
                "refused join of rank %d to job '%s': %s", join.rank, job_id, rejection.message
            )
            conn.end(rejection.code, rejection.message)
            if not job.members:
                del self.jobs[job_id]
            else:  # the ranks that wait hear who was refused and why
                self.execute(job, job.refused_join(join.rank, rejection.message))
            return
        conn.job, conn.job_id, conn.rank = job, job_id, join.rank
        job.membership.set_peer(join.rank, conn.peer)
        self.connections[(job_id, join.rank)] = conn
        missing = job.assembly.missing(job.membership.ranks())
        wait = f"waiting for ranks {missing} of {job.world_size}" if missing else "all present"
        log.info(
            "job '%s': rank %d joined from %s (incarnation %r, client %r); %s",
            job_id,
            join.rank,
            conn.peer,
            join.incarnation,
            join.client_version,
            wait,
        )
        self.execute(job, actions)

    def _detach(self, conn: Connection) -> None:
        job = conn.job
        if job is None:
            return
        super()._detach(conn)
        conn.job, conn.job_id = None, None
        if not conn.left:
            log_rank_lost(job, conn.rank, "disconnected")
        # A rank whose message was refused: its peers (waiting in that collective, say)
        # learn what was refused, both values included, not only that it disconnected.
        reason = (
            f"disconnected (the coordinator refused its message: {conn.refused}) from"
            if conn.refused is not None and not conn.left
            else None
        )
        self._leave_job(job, conn.rank, orderly=conn.left, reason=reason)

    def _leave_job(self, job: Job, rank: int, orderly: bool, reason: str | None = None) -> None:
        """Drop `rank` from `job` for good and carry out what that means for the others."""
        if not orderly:
            self.metrics.recovery.rank_lost(job.liveness.seconds_since_seen(rank))
        self.segments.forget(job.job_id, rank, job.membership.session_of(rank))
        self.execute(job, job.detach(rank, orderly=orderly, reason=reason))
        # Its straggler statistics must not follow a later member with its rank (its lag
        # histogram series stays: Prometheus series are cumulative).
        self.metrics.lag_tracker.forget(rank)
        if not job.members:
            self.retire_job(job, quiet=True)

    def retire_job(self, job: Job, quiet: bool = False) -> None:
        """Remove `job` from the active jobs now, though ranks may still be connected to it.

        Its connections keep pointing at it (and only they get its actions), so
        a Join with the same id creates a new job while the old streams end.
        Its segments and its shards' copy go; how it ended is recorded (and logged,
        `quiet`: as info when it finished or was abandoned).
        """
        if self.jobs.get(job.job_id) is not job:
            return
        del self.jobs[job.job_id]
        self.segments.forget_job(job.job_id)
        self.shard_control.job_ended(job)
        ended = self.ended_jobs.record(job, self.metrics.lag_tracker)
        if quiet and ended.state in ("finished", "abandoned"):
            log.info("job '%s' %s", job.job_id, ended.outcome)
        else:
            log.warning("job '%s' ended %s: %s", job.job_id, ended.state, ended.outcome)

    def expire_assembly(self, job: Job, details: str) -> None:
        """Refuse a job that assembled too long: its waiting ranks end, its slot is free."""
        self.execute(
            job,
            job.end(Code.DEADLINE_EXCEEDED, details, pb.END_REASON_JOB_REFUSED, JobState.REFUSED),
        )
        self.retire_job(job)


class BeatRefused(Exception):
    """A beat that does not count; its args, (grpc.StatusCode, details), are its answer."""


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
    by `servicer.guarded`): a worker's heartbeat on a connection that carries no bulk data.

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
    request = pb.BeatRequest.FromString(raw)
    try:
        return take_beat(jobs, request)
    except BeatRefused as refused:
        code, details = refused.args
        log.debug("beat refused from %s: %s", context.peer(), details)
        await context.abort(code, details)
        raise  # not reached: abort raises
