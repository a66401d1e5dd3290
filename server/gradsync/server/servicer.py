"""The gRPC face of the coordinator: parse, validate, forward, deliver.

Each worker holds one bidirectional `Sync` stream. For every stream the
servicer runs a reader (parse bytes -> hand to the job's state machine) and a
writer (drain the connection's outbox). All job logic lives in
`gradsync.server.job`; this module only translates between bytes on the wire
and the job's actions. Everything runs on one asyncio loop, so job state needs
no locks.

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
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf.message import DecodeError
from gradsync.protocol.codec import decode_gradient, header_of
from gradsync.protocol.codes import Code
from gradsync.server.actions import Action, Persist, Send, Terminate
from gradsync.server.budget import ByteBudget
from gradsync.server.checkpoint import Checkpoint, CheckpointError, CheckpointStore
from gradsync.server.config import ServerConfig
from gradsync.server.errors import RejectedMessage
from gradsync.server.job import Job
from gradsync.server.metrics import CoordinatorMetrics
from gradsync.v1 import gradsync_pb2 as pb

log = logging.getLogger("gradsync.server")

SERVICE_NAME = "gradsync.v1.Coordinator"
_STATUS_BY_CODE = {status.value[0]: status for status in grpc.StatusCode}
_MAX_JOB_ID_CHARS = 128


@dataclass(frozen=True)
class _End:
    """Outbox sentinel: end the stream with this status after prior writes."""

    code: Code
    details: str


class _Connection:
    """One worker's stream: identity once joined, and its bounded outbox."""

    def __init__(self, peer: str, max_outbox_bytes: int) -> None:
        self.peer = peer
        self.job: Job | None = None
        self.rank = -1
        self.left = False
        self.outbox: asyncio.Queue[bytes | _End] = asyncio.Queue()
        self.outbox_bytes = 0
        self.max_outbox_bytes = max_outbox_bytes
        self.ended = False

    def send(self, raw: bytes) -> None:
        if self.ended:
            return
        if self.outbox_bytes + len(raw) > self.max_outbox_bytes:
            self.end(
                Code.RESOURCE_EXHAUSTED,
                f"rank {self.rank} is not reading its results: {self.outbox_bytes} bytes are "
                f"queued for it (limit {self.max_outbox_bytes} bytes)",
            )
            return
        self.outbox_bytes += len(raw)
        self.outbox.put_nowait(raw)

    def end(self, code: Code, details: str) -> None:
        if not self.ended:
            self.ended = True
            self.outbox.put_nowait(_End(code, details))


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
        self._next_straggler_report = 0.0
        self.store = store
        self.clock = clock
        self.jobs: dict[str, Job] = {}
        self._connections: dict[tuple[str, int], _Connection] = {}
        self._budget = ByteBudget(config.max_buffered_bytes)
        self.draining = False
        self.checkpoint_failures = 0
        self._background: set[asyncio.Task[None]] = set()

    @property
    def buffered_bytes(self) -> int:
        """Gradient bytes currently held in partial reductions."""
        return self._budget.used

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
            },
        )

    async def status(
        self, request: pb.StatusRequest, context: grpc.aio.ServicerContext
    ) -> pb.StatusReply:
        """Membership, progress and late ranks of every job (or one)."""
        jobs = [
            job.status()
            for job_id, job in sorted(self.jobs.items())
            if not request.job_id or job_id == request.job_id
        ]
        for job_status in jobs:
            for member in job_status.members:
                member.mean_lag_s = self.metrics.lag_tracker.mean_lag(member.rank) or 0.0
        return pb.StatusReply(jobs=jobs, heartbeat_timeout_s=self.config.heartbeat_timeout_s)

    async def watch(self) -> None:
        """Background task: declare silent workers dead and warn about stalled steps."""
        config = self.config
        period = min(0.25, config.heartbeat_timeout_s / 4)
        while True:
            await asyncio.sleep(period)
            try:
                self.check_liveness()
            except Exception:  # the watchdog must outlive any bug in one check
                log.exception("liveness check failed")

    def _count_abort(self, aborted: pb.StepAborted) -> None:
        reason = pb.AbortReason.Name(aborted.reason).removeprefix("ABORT_REASON_")
        if aborted.reason == pb.ABORT_REASON_PEER_MESSAGE_REJECTED:
            return  # the culprit's own message counts this abort once
        if aborted.reason == pb.ABORT_REASON_MESSAGE_REJECTED:
            self.metrics.observe_rejection(Code(aborted.code).name)
        self.metrics.observe_abort(reason)

    def _report_stragglers(self) -> None:
        """Every few seconds, name ranks whose buckets persistently arrive late."""
        now = self.clock()
        if now < self._next_straggler_report:
            return
        self._next_straggler_report = now + 10.0
        tracker = self.metrics.lag_tracker
        for rank in tracker.persistently_behind(threshold_s=0.05, min_samples=10):
            slowest = ", ".join(f"rank {r} {lag * 1e3:.0f} ms" for r, lag in tracker.slowest(3))
            log.warning(
                "rank %d is persistently behind: its buckets arrive %.0f ms after the first "
                "rank's on average (slowest: %s)",
                rank,
                (tracker.mean_lag(rank) or 0.0) * 1e3,
                slowest,
            )

    def check_liveness(self) -> None:
        """One watchdog pass (also called directly by tests with a fake clock)."""
        self.metrics.set_membership(
            len(self._connections),
            max((job.membership_epoch for job in self.jobs.values()), default=0),
            len(self.jobs),
        )
        self._report_stragglers()
        timeout = self.config.heartbeat_timeout_s
        for job in list(self.jobs.values()):
            for rank in job.silent_ranks(timeout):
                reason = (
                    f"was declared dead after {timeout:g}s without a heartbeat "
                    f"(heartbeat timeout) in"
                )
                log.warning(
                    "job '%s': rank %d %s step %d",
                    job.job_id,
                    rank,
                    reason.removesuffix(" in"),
                    job.open_step,
                )
                conn = self._connections.get((job.job_id, rank))
                if conn is not None:
                    conn.end(Code.UNAVAILABLE, f"rank {rank} {reason.removesuffix(' in')}")
                    conn.job = None
                    del self._connections[(job.job_id, rank)]
                self._execute(job, job.detach(rank, orderly=False, reason=reason))
                self._forget_if_empty(job)
            progress = job.progress
            if (
                progress is not None
                and not progress.stall_warned
                and progress.age() > self.config.stall_warning_s
            ):
                progress.stall_warned = True
                late = job.late_ranks()
                waiting = "; ".join(f"rank {r} (buckets {b})" for r, b in sorted(late.items()))
                log.warning(
                    "job '%s': step %d has been waiting %.1fs for %s",
                    job.job_id,
                    job.open_step,
                    progress.age(),
                    waiting or "every rank (no bucket is complete yet)",
                )

    async def sync(
        self, request_iterator: AsyncIterator[bytes], context: grpc.aio.ServicerContext
    ) -> None:
        """Serve one worker stream until it leaves, fails, or is ended."""
        conn = _Connection(context.peer(), self.config.max_outbox_bytes)
        ended: asyncio.Future[_End] = asyncio.get_running_loop().create_future()
        reader = asyncio.create_task(self._read_loop(conn, request_iterator))
        writer = asyncio.create_task(self._write_loop(conn, context, ended))
        try:
            pending: list[asyncio.Future[Any]] = [reader, ended]
            await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            if not ended.done() and conn.ended:
                # The stream is to end (goodbye or refusal): flush what is queued first.
                await asyncio.wait({ended}, timeout=self.config.shutdown_grace_s)
        finally:
            reader.cancel()
            writer.cancel()
            self._detach(conn)
        if ended.done() and not ended.cancelled() and ended.result().code is not Code.OK:
            end = ended.result()
            context.set_code(_STATUS_BY_CODE[int(end.code)])
            context.set_details(end.details)

    async def _read_loop(self, conn: _Connection, request_iterator: AsyncIterator[bytes]) -> None:
        try:
            async for raw in request_iterator:
                self._dispatch(conn, raw)
                if conn.ended:
                    return
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the transport failed under us: treat as a disconnect
            log.info("stream from %s (rank %s) failed: %s", conn.peer, conn.rank, exc)

    async def _write_loop(
        self,
        conn: _Connection,
        context: grpc.aio.ServicerContext,
        ended: asyncio.Future[_End],
    ) -> None:
        try:
            while True:
                item = await conn.outbox.get()
                if isinstance(item, _End):
                    ended.set_result(item)
                    return
                await context.write(item)
                conn.outbox_bytes -= len(item)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the worker went away while we wrote
            log.info("writing to %s (rank %s) failed: %s", conn.peer, conn.rank, exc)
            if not ended.done():
                ended.set_result(_End(Code.UNAVAILABLE, f"write failed: {exc}"))

    # ----------------------------------------------------------- dispatching
    def _dispatch(self, conn: _Connection, raw: bytes) -> None:
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
            conn.end(rejection.code, rejection.message)

    def _reject(self, conn: _Connection, rejection: RejectedMessage) -> None:
        """A malformed message: abort the sender's open step, or end its stream."""
        log.warning("rejected message from %s: %s", conn.peer, rejection.message)
        if conn.job is None:
            conn.end(rejection.code, rejection.message)
        else:
            self._execute(conn.job, conn.job.reject(conn.rank, rejection))

    def _join(self, conn: _Connection, join: pb.Join) -> None:
        job_id = join.job_id
        config = self.config
        problem: tuple[Code, str] | None = None
        if self.draining:
            problem = (Code.UNAVAILABLE, "the coordinator is shutting down")
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
            conn.end(*problem)
            return
        job = self.jobs.get(job_id)
        if job is None:
            resume, problem = self._load_resume(job_id)
            if problem is not None:
                log.error("refused join of rank %d to job '%s': %s", join.rank, job_id, problem[1])
                conn.end(*problem)
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
            )
            job.resume = resume
        try:
            actions = job.join(join.rank, join)
        except RejectedMessage as rejection:
            log.warning(
                "refused join of rank %d to job '%s': %s", join.rank, job_id, rejection.message
            )
            conn.end(rejection.code, rejection.message)
            if not job.members:
                del self.jobs[job_id]
            return
        conn.job, conn.rank = job, join.rank
        job.set_peer(join.rank, conn.peer)
        self._connections[(job_id, join.rank)] = conn
        joined = len(job.members)
        if joined < config.world_size:
            log.info(
                "job '%s': rank %d joined from %s; waiting for %d/%d workers",
                job_id,
                join.rank,
                conn.peer,
                joined,
                config.world_size,
            )
        else:
            log.info(
                "job '%s': rank %d joined from %s; all %d workers present",
                job_id,
                join.rank,
                conn.peer,
                config.world_size,
            )
        self._execute(job, actions)

    def _execute(self, job: Job, actions: list[Action]) -> None:
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
                    if target is not None:
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
                for rank in action.ranks:
                    target = self._connections.get((job.job_id, rank))
                    if target is not None:
                        target.end(action.code, action.details)

    def _detach(self, conn: _Connection) -> None:
        job = conn.job
        if job is None:
            return
        conn.job = None
        key = (job.job_id, conn.rank)
        if self._connections.get(key) is conn:
            del self._connections[key]
        if not conn.left:
            log.warning(
                "job '%s': rank %d disconnected at step %d", job.job_id, conn.rank, job.open_step
            )
        self._execute(job, job.detach(conn.rank, orderly=conn.left))
        self._forget_if_empty(job)

    def _forget_if_empty(self, job: Job) -> None:
        if not job.members and self.jobs.get(job.job_id) is job:
            del self.jobs[job.job_id]
            log.info("job '%s' finished after %d steps", job.job_id, job.steps_completed)

    # ---------------------------------------------------------- checkpoints
    def _load_resume(self, job_id: str) -> tuple[Checkpoint | None, tuple[Code, str] | None]:
        """The checkpoint a new job resumes from, or why the job must be refused."""
        if self.store is None:
            return None, None
        try:
            # Blocking, but only once per job, when its first rank joins.
            checkpoint = self.store.load_latest(job_id)
        except CheckpointError as exc:
            if self.config.require_checkpoint or self.config.resume:
                flag = "--require-checkpoint" if self.config.require_checkpoint else "--resume"
                return None, (
                    Code.FAILED_PRECONDITION,
                    f"cannot read checkpoints of job '{job_id}' and {flag} is set: {exc}",
                )
            log.warning("job '%s': cannot read checkpoints, starting fresh: %s", job_id, exc)
            return None, None
        if checkpoint is None:
            if self.config.resume:
                return None, (
                    Code.FAILED_PRECONDITION,
                    f"--resume is set but {self.store.description} holds no checkpoint of job "
                    f"'{job_id}' (was the store emptied, e.g. Redis restarted without its "
                    "append-only file?); refusing to start it from scratch",
                )
            return None, None
        log.warning(
            "job '%s' RESUMES from the checkpoint of step %d in %s (%d bytes)",
            job_id,
            checkpoint.step,
            self.store.description,
            len(checkpoint.payload),
        )
        return checkpoint, None

    async def _persist(self, job: Job, action: Persist) -> None:
        """Save a checkpoint off the event loop, then acknowledge to rank 0."""
        if self.store is None:
            durable, message = (
                False,
                "no checkpoint store configured (gradsync serve --checkpoint-store)",
            )
        else:
            checkpoint = Checkpoint(
                job_id=job.job_id,
                step=action.step,
                membership_epoch=job.membership_epoch,
                payload=action.blob,
                metadata={"world_size": str(job.world_size)},
            )
            try:
                await asyncio.to_thread(self.store.save, checkpoint)
                durable, message = True, self.store.description
                job.last_checkpoint_step = max(job.last_checkpoint_step, action.step)
                log.info(
                    "job '%s': checkpoint of step %d is durable in %s (%d bytes)",
                    job.job_id,
                    action.step,
                    message,
                    len(action.blob),
                )
            except CheckpointError as exc:
                self.checkpoint_failures += 1
                durable, message = False, str(exc)
                log.error(
                    "job '%s': checkpoint of step %d FAILED (%d failures so far): %s",
                    job.job_id,
                    action.step,
                    self.checkpoint_failures,
                    exc,
                )
        reply = pb.CoordinatorMessage(
            checkpoint_saved=pb.CheckpointSaved(step=action.step, durable=durable, message=message)
        )
        self._execute(job, [Send((0,), reply)])
        if not durable and self.config.require_checkpoint:
            self._execute(
                job,
                [
                    Terminate(
                        tuple(job.joined_ranks()),
                        Code.UNAVAILABLE,
                        f"checkpoint of step {action.step} failed and --require-checkpoint is set: "
                        f"{message}",
                    )
                ],
            )
