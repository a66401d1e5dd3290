"""The gRPC face of the coordinator: parse, validate, forward, deliver.

Each worker holds one bidirectional `Sync` stream. For every stream the
servicer runs a reader (parse bytes -> hand to the job's state machine) and a
writer (drain the connection's outbox). This module is glue: job logic lives
in `gradsync.server.job` and its components, liveness checks in
`watchdog`, checkpoint store I/O in `checkpointer`, the status reply in
`status`, the control streams of coordinator shards (`Coordinator.ShardLink`)
in `shard_control`; the servicer only translates between bytes on the wire and
the actions those return. A job's actions reach only the streams joined to that
very job object: after a shard loss (or a Join to a failed job) a new job with
the same id may run while the old one's streams end. Everything runs on one
asyncio loop, so job state needs no locks.

Every stream the coordinator ends with an error status first gets a
`StreamEnd` message carrying the same code and message plus an `EndReason`,
because the status code alone cannot tell "declared dead" from "coordinator
going away"; UNAVAILABLE is used only for the latter.

Requests and responses are registered as raw bytes (no automatic
(de)serialization): that lets garbage bytes become a clear INVALID_ARGUMENT
for the sender instead of an opaque INTERNAL, and lets one averaged chunk be
serialized once and written to every rank.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable

import grpc
from google.protobuf.message import DecodeError
from gradsync.protocol.codec import decode_gradient, header_of
from gradsync.protocol.codes import Code
from gradsync.server.actions import Action, Persist, Send, Terminate
from gradsync.server.budget import ByteBudget
from gradsync.server.checkpoint import CheckpointStore
from gradsync.server.checkpointer import Checkpointer
from gradsync.server.config import ServerConfig
from gradsync.server.connection import Connection
from gradsync.server.errors import RejectedMessage
from gradsync.server.job import Job, JobState
from gradsync.server.metrics import CoordinatorMetrics
from gradsync.server.shard_control import ShardControl
from gradsync.server.status import EndedJobs, status_reply
from gradsync.server.watchdog import Watchdog
from gradsync.v1 import gradsync_pb2 as pb

log = logging.getLogger("gradsync.server")

SERVICE_NAME = "gradsync.v1.Coordinator"
_STATUS_BY_CODE = {status.value[0]: status for status in grpc.StatusCode}
_MAX_JOB_ID_CHARS = 128
#: After the drain grace, how long streams ended for shutdown get to flush their last messages.
SHUTDOWN_FLUSH_S = 1.0
_SHUTTING_DOWN = "the coordinator is shutting down"


class CoordinatorServicer:
    """Owns the jobs and the worker streams of one coordinator process."""

    def __init__(
        self,
        config: ServerConfig,
        store: CheckpointStore | None = None,
        clock: Callable[[], float] = time.monotonic,
        metrics: CoordinatorMetrics | None = None,
    ) -> None:
        self.config = config
        self.metrics = metrics or CoordinatorMetrics()
        self.clock = clock
        self.jobs: dict[str, Job] = {}
        self.checkpointer = Checkpointer(config, store)
        self.shard_control = ShardControl(self, config, clock, self.metrics)
        self.watchdog = Watchdog(self, extra_checks=(self.shard_control.check,))
        self._connections: dict[tuple[str, int], Connection] = {}
        self._streams: set[Connection] = set()
        self._budget = ByteBudget(config.max_buffered_bytes)
        self.draining = False
        self._background: set[asyncio.Task[None]] = set()
        self.ended_jobs = EndedJobs(lambda: self.clock())

    @property
    def store(self) -> CheckpointStore | None:
        """The checkpoint store, if one is configured."""
        return self.checkpointer.store

    @property
    def buffered_bytes(self) -> int:
        """Gradient bytes currently held in partial reductions."""
        return self._budget.used

    def connection_count(self) -> int:
        """Worker streams currently joined to a job."""
        return len(self._connections)

    def generic_handler(self) -> grpc.GenericRpcHandler:
        """The handler to register on a `grpc.aio.server` (raw-bytes Sync method)."""
        return grpc.method_handlers_generic_handler(
            SERVICE_NAME,
            {
                "Sync": grpc.stream_stream_rpc_method_handler(self.sync),
                "Status": grpc.unary_unary_rpc_method_handler(
                    self.status,
                    request_deserializer=pb.StatusRequest.FromString,
                    response_serializer=pb.StatusReply.SerializeToString,
                ),
                "ShardLink": grpc.stream_stream_rpc_method_handler(
                    self.shard_control.link,
                    request_deserializer=pb.ShardMessage.FromString,
                    response_serializer=pb.LeaderMessage.SerializeToString,
                ),
            },
        )

    async def status(
        self, request: pb.StatusRequest, context: grpc.aio.ServicerContext
    ) -> pb.StatusReply:
        """Membership, progress and late ranks of every job (or one), and the shards."""
        reply = status_reply(
            self.jobs.values(),
            request.job_id,
            self.config.heartbeat_timeout_s,
            self.metrics.lag_tracker,
            self.ended_jobs.snapshots(),
        )
        reply.shards.extend(
            self.shard_control.statuses(self.buffered_bytes, self.connection_count())
        )
        return reply

    def own_stats(self) -> pb.ShardStats:
        """This coordinator's gradient counters (shard 0 of a sharded coordinator)."""
        return self.metrics.stats(self.buffered_bytes, self.connection_count())

    def _count_abort(self, aborted: pb.StepAborted) -> None:
        reason = pb.AbortReason.Name(aborted.reason).removeprefix("ABORT_REASON_")
        if aborted.reason == pb.ABORT_REASON_PEER_MESSAGE_REJECTED:
            return  # the culprit's own message counts this abort once
        if aborted.reason == pb.ABORT_REASON_MESSAGE_REJECTED:
            self.metrics.observe_rejection(Code(aborted.code).name)
        self.metrics.observe_abort(reason)

    def check_liveness(self) -> None:
        """One watchdog pass (also called directly by tests with a fake clock)."""
        self.watchdog.check()

    def declare_dead(self, job: Job, rank: int, details: str) -> None:
        """End a silent rank's stream (ABORTED, reason DECLARED_DEAD) and drop it from `job`."""
        conn = self._connections.pop((job.job_id, rank), None)
        if conn is not None:
            conn.end(Code.ABORTED, f"rank {rank} {details}", pb.END_REASON_DECLARED_DEAD)
            conn.job = None
        self._leave_job(job, rank, orderly=False, reason=f"{details} in")

    async def drain(self, grace_s: float) -> None:
        """Shutdown: let streams finish for `grace_s`, then end the rest as shutting down.

        Those get UNAVAILABLE with reason SHUTTING_DOWN (the one case
        UNAVAILABLE is for: a restarted coordinator may be reached again) and
        a moment to flush it before the server cancels what is left.
        """
        self.draining = True
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace_s
        while self._streams and loop.time() < deadline:
            await asyncio.sleep(0.05)
        for conn in list(self._streams):
            conn.end(Code.UNAVAILABLE, _SHUTTING_DOWN, pb.END_REASON_SHUTTING_DOWN)
        deadline = loop.time() + SHUTDOWN_FLUSH_S
        while self._streams and loop.time() < deadline:
            await asyncio.sleep(0.01)

    async def sync(
        self, request_iterator: AsyncIterator[bytes], context: grpc.aio.ServicerContext
    ) -> None:
        """Serve one worker stream until it leaves, fails, or is ended."""
        conn = Connection(context.peer(), self.config.max_outbox_bytes)
        self._streams.add(conn)

        def detach() -> None:
            self._detach(conn)
            self._streams.discard(conn)

        end = await conn.serve(
            self._read_loop(conn, request_iterator), context, self.config.shutdown_grace_s, detach
        )
        if end is not None and end.code is not Code.OK:
            context.set_code(_STATUS_BY_CODE[int(end.code)])
            context.set_details(end.details)

    async def _read_loop(self, conn: Connection, request_iterator: AsyncIterator[bytes]) -> None:
        try:
            async for raw in request_iterator:
                self._dispatch(conn, raw)
                if conn.ended:
                    return
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the transport failed under us: treat as a disconnect
            log.info("stream from %s (rank %s) failed: %s", conn.peer, conn.rank, exc)

    # ----------------------------------------------------------- dispatching
    def _dispatch(self, conn: Connection, raw: bytes) -> None:
        job = conn.job
        try:
            fast = decode_gradient(raw)
            if fast is not None and job is not None:
                # The hot path: a gradient chunk, parsed without copying its payload.
                self.metrics.observe_chunk(len(fast[1]))
                job.touch(conn.rank)
                self._execute(job, job.on_gradient(conn.rank, *fast))
                return
            message = pb.WorkerMessage.FromString(raw)
        except (DecodeError, ValueError) as exc:
            self._reject(
                conn,
                RejectedMessage(
                    Code.INVALID_ARGUMENT,
                    f"rank {conn.rank} sent {len(raw)} bytes that do not parse as a "
                    f"gradsync.v1.WorkerMessage: {exc}",
                ),
            )
            return
        kind = message.WhichOneof("kind")
        if job is None:
            if kind != "join":
                got = kind or "an empty message"
                conn.end(
                    Code.FAILED_PRECONDITION,
                    f"the first message on a stream must be a Join, got {got}",
                )
                return
            self._join(conn, message.join)
            return
        job.touch(conn.rank)
        try:
            if kind == "heartbeat":
                job.touch(conn.rank, message.heartbeat.step)
            elif kind == "abandon":
                self._execute(job, job.on_abandon(conn.rank, message.abandon))
            elif kind == "checkpoint":
                self._execute(job, job.on_checkpoint_chunk(conn.rank, message.checkpoint))
            elif kind == "gradient":
                chunk = message.gradient
                self._execute(
                    job, job.on_gradient(conn.rank, header_of(chunk), memoryview(chunk.payload))
                )
            elif kind == "collective":
                self._execute(job, job.on_collective(conn.rank, message.collective))
            elif kind == "out_of_inputs":
                self._execute(job, job.on_out_of_inputs(conn.rank, message.out_of_inputs))
            elif kind == "state":
                self._execute(job, job.on_state_chunk(conn.rank, message.state))
            elif kind == "leave":
                conn.left = True
                log.info(
                    "job '%s': rank %d left (%s)",
                    job.job_id,
                    conn.rank,
                    message.leave.reason or "no reason given",
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
            conn.end(rejection.code, rejection.message)

    def _reject(self, conn: Connection, rejection: RejectedMessage) -> None:
        """A malformed message: abort the sender's open step, or end its stream."""
        log.warning("rejected message from %s: %s", conn.peer, rejection.message)
        if conn.job is None:
            conn.end(rejection.code, rejection.message)
        else:
            self._execute(conn.job, conn.job.reject(conn.rank, rejection))

    def _join(self, conn: Connection, join: pb.Join) -> None:
        job_id = join.job_id
        config = self.config
        problem: tuple[Code, str] | None = None
        if self.draining:
            problem = (Code.UNAVAILABLE, _SHUTTING_DOWN)
        elif not job_id or len(job_id) > _MAX_JOB_ID_CHARS or not job_id.isprintable():
            problem = (
                Code.INVALID_ARGUMENT,
                f"job id {job_id!r} must be 1..{_MAX_JOB_ID_CHARS} printable characters",
            )
        elif join.rank >= config.world_size:
            problem = (
                Code.INVALID_ARGUMENT,
                f"rank {join.rank} is out of range for world size {config.world_size} "
                f"(valid ranks 0..{config.world_size - 1})",
            )
        elif job_id not in self.jobs and len(self.jobs) >= config.max_jobs:
            problem = (
                Code.RESOURCE_EXHAUSTED,
                f"the coordinator already runs {len(self.jobs)} jobs (limit {config.max_jobs})",
            )
        if problem is not None:
            log.warning("refused join from %s: %s", conn.peer, problem[1])
            waiting = self.jobs.get(job_id)
            if waiting is not None and not self.draining:
                self._execute(waiting, waiting.refused_join(join.rank, problem[1]))
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
            resume, problem = self.checkpointer.load_resume(job_id)
            if problem is not None:
                log.error("refused join of rank %d to job '%s': %s", join.rank, job_id, problem[1])
                conn.end(*problem, pb.END_REASON_JOB_REFUSED)
                return
            job = self.jobs[job_id] = Job(
                job_id,
                config.world_size,
                config.chunk_bytes,
                config.max_message_bytes,
                self._budget,
                clock=self.clock,
                heartbeat_interval_s=config.heartbeat_interval_s,
                checkpoint_every=config.checkpoint_every,
                metrics=self.metrics,
                on_failure=config.on_failure,
                min_workers=config.min_workers,
                max_collective_bytes=config.max_collective_bytes,
                shard_map=self.shard_control.registry.shard_map,
                shard_count=config.shard_count,
            )
            job.persistence.resume = resume
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
                self._execute(job, job.refused_join(join.rank, rejection.message))
            return
        conn.job, conn.rank = job, join.rank
        job.set_peer(join.rank, conn.peer)
        self._connections[(job_id, join.rank)] = conn
        missing = job.assembly.missing(job.membership.ranks())
        wait = f"waiting for ranks {missing} of {config.world_size}" if missing else "all present"
        log.info("job '%s': rank %d joined from %s; %s", job_id, join.rank, conn.peer, wait)
        self._execute(job, actions)

    def _execute(self, job: Job, actions: list[Action]) -> None:
        # Shards hear of a job's start, membership changes and aborts before workers do.
        self.shard_control.before_delivery(job, actions)
        for action in actions:
            if isinstance(action, Send):
                message = action.message
                if isinstance(message, bytes):
                    raw = message  # pre-encoded averaged chunk, serialized once for all ranks
                else:
                    raw = message.SerializeToString()
                    kind = message.WhichOneof("kind")
                    if kind == "step_aborted":
                        self._count_abort(message.step_aborted)
                        log.warning("job '%s': %s", job.job_id, message.step_aborted.message)
                    elif kind == "membership":
                        log.warning("job '%s': %s", job.job_id, message.membership.reason)
                for rank in action.ranks:
                    target = self._connections.get((job.job_id, rank))
                    if target is not None and target.job is job:
                        target.send(raw)
            elif isinstance(action, Persist):
                task = asyncio.create_task(self._persist(job, action))
                self._background.add(task)
                task.add_done_callback(self._background.discard)
            elif isinstance(action, Terminate):
                self.metrics.observe_error(action.code.name)
                log.warning(
                    "job '%s': ending ranks %s: %s", job.job_id, list(action.ranks), action.details
                )
                reason = action.reason or None  # UNSPECIFIED: let the code decide
                for rank in action.ranks:
                    target = self._connections.get((job.job_id, rank))
                    if target is not None and target.job is job:
                        target.end(action.code, action.details, reason)

    def _detach(self, conn: Connection) -> None:
        job = conn.job
        if job is None:
            return
        conn.job = None
        key = (job.job_id, conn.rank)
        if self._connections.get(key) is conn:
            del self._connections[key]
        if not conn.left and job.state is JobState.ASSEMBLING:
            log.warning(
                "job '%s': rank %d disconnected while waiting for the others; dropped from the "
                "assembling job (it may join again)",
                job.job_id,
                conn.rank,
            )
        elif not conn.left:
            log.warning(
                "job '%s': rank %d disconnected at step %d", job.job_id, conn.rank, job.open_step
            )
        self._leave_job(job, conn.rank, orderly=conn.left)

    def _leave_job(self, job: Job, rank: int, orderly: bool, reason: str | None = None) -> None:
        """Drop `rank` from `job` for good and carry out what that means for the others."""
        self._execute(job, job.detach(rank, orderly=orderly, reason=reason))
        # Its straggler statistics must not follow a later member with its rank.
        self.metrics.forget_rank(rank)
        self._forget_if_empty(job)

    def _forget_if_empty(self, job: Job) -> None:
        if job.members or self.jobs.get(job.job_id) is not job:
            return
        del self.jobs[job.job_id]
        self.shard_control.job_ended(job)
        ended = self.ended_jobs.record(job, self.metrics.lag_tracker)
        if ended.state in ("finished", "abandoned"):
            log.info("job '%s' %s", job.job_id, ended.outcome)
        else:
            log.warning("job '%s' ended %s: %s", job.job_id, ended.state, ended.outcome)

    def retire_job(self, job: Job) -> None:
        """Remove `job` from the active jobs now, though ranks may still be connected to it.

        Its connections keep pointing at it (and only they get its actions), so
        a Join with the same id creates a new job while the old streams end.
        """
        if self.jobs.get(job.job_id) is not job:
            return
        del self.jobs[job.job_id]
        self.shard_control.job_ended(job)
        ended = self.ended_jobs.record(job, self.metrics.lag_tracker)
        log.warning("job '%s' ended %s: %s", job.job_id, ended.state, ended.outcome)

    def execute(self, job: Job, actions: list[Action]) -> None:
        """Carry out `actions` of `job` (for the watchdog's periodic reports)."""
        self._execute(job, actions)

    async def _persist(self, job: Job, action: Persist) -> None:
        """Carry out a Persist in the background, then deliver its acknowledgement."""
        self._execute(job, await self.checkpointer.persist(job, action))
