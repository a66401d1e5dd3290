"""The coordinator servicer in the shard role: workers' data streams, and the leader's decisions.

Each worker opens one `Shard.Data` stream per shard: a `ShardHello`, then
gradient chunks of the shard's byte ranges; the averages come back on the
same stream. The stream is `servicer`'s, as at the leader: admitted by its
first message, chunks parsed without copying, a bounded outbox, a
`StreamEnd` before an error status.

Each job's data plane is a `JobPlane` (pure, the class the leader runs for
its own range); the leader's control events arrive through the `on_*`
methods, called by the control link (`shard_link`). Control and data
travel on different connections, so a hello or a chunk may arrive before the
view or abort that makes it valid: the reader then waits, bounded, for the
shard's state to catch up before judging it. A hello waits for the shard's
registration up to the heartbeat timeout, but for the view announcing its job
or rank only `ANNOUNCE_GRACE_S`: the leader sends a view before the Welcome
that lets a worker dial, so a view later than that is not on its way, and a
stream naming a job or rank nobody announced must not be held for a whole
heartbeat timeout.
Everything runs on one asyncio loop, so no locks.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from gradsync_proto.codec import ChunkHeader, header_of
from gradsync_proto.codes import Code
from gradsync_proto.v1 import gradsync_pb2 as pb

from gradsync_server import defaults
from gradsync_server.config import CoordinatorConfig
from gradsync_server.dataplane import nonfinite
from gradsync_server.dataplane.budget import ByteBudget
from gradsync_server.dataplane.plane import JobPlane, ShardOutcome
from gradsync_server.errors import RejectedMessage
from gradsync_server.metrics import CoordinatorMetrics
from gradsync_server.rpc.connection import Connection
from gradsync_server.rpc.delivery import Delivery
from gradsync_server.rpc.outer_records import ShardOuterStates
from gradsync_server.rpc.servicer import SHARD_SERVICE_NAME, STATUS_BY_CODE, CoordinatorServicer
from gradsync_server.rpc.shard_collectives import ShardCollectives

log = logging.getLogger("gradsync.shard")

#: How long a stream that is to end gets to flush what is queued for it.
_FLUSH_S = 1.0
#: How long a hello naming a job, or a rank of a job, this shard has not heard of
#: waits for the leader's view: it was sent before the worker's Welcome, so it
#: trails the hello (which needs a Welcome and a new connection) by far less.
ANNOUNCE_GRACE_S = 1.0


class ShardRole(CoordinatorServicer):
    """The coordinator servicer of a shard: its jobs and data streams.

    Args:
        config: the shard's configuration.
        advertise: the address it registers with (for messages).
        clock: monotonic time source.
        metrics: where its metrics go (a fresh shard `CoordinatorMetrics` when None).
    """

    service = SHARD_SERVICE_NAME
    stream_method = "Data"

    def __init__(
        self,
        config: CoordinatorConfig,
        advertise: str,
        clock: Callable[[], float] = time.monotonic,
        metrics: CoordinatorMetrics | None = None,
    ) -> None:
        super().__init__(
            config,
            ByteBudget(config.max_buffered_bytes),
            clock,
            metrics or CoordinatorMetrics(shard=True),
            _FLUSH_S,
        )
        self.advertise = advertise
        #: None until the leader accepts the shard (and again once it is lost).
        self.index: int | None = None
        #: The leader's --nonfinite policy (from ShardAccepted).
        self.nonfinite = defaults.NONFINITE
        self.heartbeat_timeout_s = config.hello_wait_s
        self.jobs: dict[str, JobPlane] = {}
        #: Messages for the leader (rejections, non-finite reports), drained by the control link.
        self.to_leader: asyncio.Queue[pb.ShardMessage] = asyncio.Queue()
        self._changed = asyncio.Event()
        #: This shard's range of the DiLoCo outer state on the store (`outer_records`).
        self.outer_states = ShardOuterStates(config)
        self._delivery = Delivery[JobPlane](
            self.connections, self.metrics, self.outer_states.records, self._detach
        )
        #: This shard's range of the process groups' spread bulk ops (`shard_collectives`).
        self.group_collectives = ShardCollectives(
            config.max_collective_bytes, self.budget, self.metrics, clock
        )

    @property
    def name(self) -> str:
        """How messages name this shard: "shard 2 at 10.0.0.5:50051"."""
        index = "?" if self.index is None else str(self.index)
        return f"shard {index} at {self.advertise}"

    # ------------------------------------------------------------ the leader
    def _notify(self) -> None:
        """Wake every reader waiting for the shard's state to catch up."""
        self._changed.set()
        self._changed = asyncio.Event()

    async def _wait_until(self, ready: Callable[[], bool], timeout_s: float) -> bool:
        """Wait (bounded) until `ready()` holds, re-checking after each change of state."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while not ready():
            remaining = deadline - loop.time()
            if remaining <= 0:
                return False
            try:
                await asyncio.wait_for(self._changed.wait(), remaining)
            except TimeoutError:
                return ready()
        return True

    def on_accepted(self, accepted: pb.ShardAccepted) -> None:
        """The leader accepted this shard: learn its index and the heartbeat bounds."""
        self.index = accepted.shard_index
        self.heartbeat_timeout_s = accepted.heartbeat_timeout_s or self.config.hello_wait_s
        self.nonfinite = accepted.nonfinite or defaults.NONFINITE
        if self.nonfinite not in defaults.NONFINITE_POLICIES:
            # Leader and shard run the same version, so this is a bug; checking stays safe.
            log.error(
                "the leader's --nonfinite policy %r is unknown here; using %r",
                self.nonfinite,
                nonfinite.ABORT,
            )
            self.nonfinite = nonfinite.ABORT
        self.metrics.set_shard_index(accepted.shard_index)
        log.info(
            "registered with leader %s as shard %d of %d",
            self.config.leader,
            accepted.shard_index,
            accepted.shard_count,
        )
        self._notify()

    def on_view(self, view: pb.ShardJobView) -> None:
        """A job started or its membership changed at the leader."""
        job = self.jobs.get(view.job_id)
        if job is None:
            if self.index is None:
                return
            try:
                job = JobPlane.for_shard(
                    view,
                    self.index,
                    self.name,
                    self.budget,
                    self.clock,
                    self.metrics,
                    nonfinite=self.nonfinite,
                )
            except ValueError as exc:
                log.error("cannot follow job '%s': %s", view.job_id, exc)
                return
            self.outer_states.started(job, view, self.index)
            self.jobs[view.job_id] = job
            log.info(
                "job '%s': following the leader from step %d (members %s, epoch %d)",
                view.job_id,
                view.start_step,
                list(job.membership.ranks()),
                view.membership_epoch,
            )
            outcome = ShardOutcome()
        else:
            outcome = job.apply(view)
        self._delivery.execute(job, self.group_collectives.follow(view))
        for (job_id, rank), conn in list(self.connections.items()):
            if job_id == view.job_id and not job.is_current(rank, conn.incarnation, conn.session):
                self._drop(conn, Code.OK, f"rank {rank} is no longer a member of job '{job_id}'")
        self._deliver(job, outcome)
        self._notify()

    def on_abort(self, abort: pb.ShardAbort) -> None:
        """The leader aborted a step: drop what this shard holds of it."""
        job = self.jobs.get(abort.job_id)
        if job is not None:
            job.abort(abort.step)
            self._notify()

    def on_job_end(self, end: pb.ShardJobEnd) -> None:
        """The job ended at the leader: end its data streams with the leader's status."""
        job = self.jobs.pop(end.job_id, None)
        self.group_collectives.forget(end.job_id)
        code = Code(end.code) if end.code in STATUS_BY_CODE else Code.UNKNOWN
        if job is not None:
            job.step.release()  # free every buffer it holds
            log.info("job '%s' ended at the leader (%s): %s", end.job_id, code.name, end.message)
        for (job_id, _), conn in list(self.connections.items()):
            if job_id == end.job_id:
                self._drop(conn, code, end.message or f"job '{job_id}' ended")
        self._notify()

    def on_leader_lost(self, why: str) -> None:
        """The control stream is gone: end every data stream, forget every job."""
        details = f"{self.name} lost its leader {self.config.leader} ({why})"
        self.end_all(Code.UNAVAILABLE, details, pb.END_REASON_SHARD_LOST)
        for job in self.jobs.values():
            job.step.release()
        self.jobs.clear()
        self.group_collectives.clear()
        self.index = None
        self.metrics.set_shard_index(-1)
        while not self.to_leader.empty():
            self.to_leader.get_nowait()
        self._notify()

    def end_all(self, code: Code, details: str, reason: pb.EndReason) -> None:
        """End every data stream (admitted or still waiting) with `code`."""
        for conn in list(self.streams):
            self._drop(conn, code, details, reason)

    def _drop(
        self, conn: Connection, code: Code, details: str, reason: pb.EndReason | None = None
    ) -> None:
        """Forget an admitted stream now and end it with `code`."""
        self._detach(conn)
        conn.end(code, details, reason)

    def _deliver(self, job: JobPlane, outcome: ShardOutcome) -> None:
        """Send the averages (once the outer state is saved, if a DiLoCo step committed
        here), then report a rejection or non-finite contributions to the leader."""

        def report() -> None:
            if outcome.rejected is not None:
                log.warning("job '%s': %s", job.job_id, outcome.rejected.message)
                self.metrics.observe_rejection(Code(outcome.rejected.code).name)
                self.to_leader.put_nowait(pb.ShardMessage(rejected=outcome.rejected))
            for contribution in outcome.nonfinite:
                self.to_leader.put_nowait(pb.ShardMessage(nonfinite=contribution))

        self._delivery.execute(job, [*outcome.saves, *outcome.sends], report)

    # --------------------------------------------------------------- streams
    def _unparsable(self, conn: Connection, raw: bytes, exc: Exception) -> RejectedMessage:
        if conn.job_id is None:
            return RejectedMessage(
                Code.INVALID_ARGUMENT,
                f"{len(raw)} bytes that do not parse as a gradsync.v1.WorkerMessage: {exc}",
            )
        return RejectedMessage(
            Code.INVALID_ARGUMENT,
            f"rank {conn.rank} sent {len(raw)} bytes that are not a gradient chunk "
            f"for {self.name}: {exc}",
        )

    def _message(
        self, conn: Connection, message: pb.WorkerMessage, raw: bytes
    ) -> Awaitable[None] | None:
        kind = message.WhichOneof("kind")
        if kind == "heartbeat":
            return None
        if kind == "leave":
            self._drop(conn, Code.OK, "goodbye")
            return None
        if kind == "shard_hello":
            self._drop(conn, Code.FAILED_PRECONDITION, f"rank {conn.rank} sent two hellos")
            return None
        if kind == "collective":
            self._collective(conn, message.collective)
            return None
        try:
            if kind != "gradient":
                raise ValueError(
                    "a shard data stream carries gradient and collective chunks only, "
                    f"got {kind or 'nothing'}"
                )
            chunk = header_of(message.gradient)
        except ValueError as exc:
            self._reject(conn, self._unparsable(conn, raw, exc))
            return None
        return self._gradient(conn, chunk, memoryview(message.gradient.payload))

    async def _gradient(self, conn: Connection, chunk: ChunkHeader, payload: memoryview) -> None:
        """Feed a chunk to its job, first waiting (bounded) for a view or abort it needs."""
        self.metrics.observe_chunk(len(payload))
        job_id = conn.job_id
        if job_id is None:
            return  # only admitted streams send chunks (see `servicer`)
        job = self.jobs.get(job_id)
        if job is not None and job.awaits_leader(chunk):
            waiting = job
            await self._wait_until(
                lambda: self.jobs.get(job_id) is not waiting or not waiting.awaits_leader(chunk),
                self.heartbeat_timeout_s,
            )
            job = self.jobs.get(job_id)
        if job is None or conn.ended:
            return  # the job ended (its streams are being ended)
        if not job.is_current(conn.rank, conn.incarnation, conn.session):
            self._drop(conn, Code.OK, f"rank {conn.rank} is no longer a member of job '{job_id}'")
            return
        self._deliver(job, job.on_gradient(conn.rank, chunk, payload))

    def _collective(self, conn: Connection, chunk: pb.CollectiveChunk) -> None:
        """A chunk of a process group's input to this shard's range of a bulk op.

        Its job's view came before the Welcome that let the rank dial, so the job
        is known here; a refused chunk ends the sender's stream (its rank's pending
        operations then fail, naming this shard), and a mismatch fails the range for
        every rank, as at the leader.
        """
        job_id = conn.job_id
        job = self.jobs.get(job_id) if job_id is not None else None
        if job_id is None or job is None or not self.group_collectives.knows(job_id):
            return  # the job ended (its streams are being ended)
        self.metrics.observe_chunk(len(chunk.payload))
        try:
            actions = self.group_collectives.accept(job_id, conn.rank, chunk)
        except RejectedMessage as rejection:
            log.warning("job '%s': %s", job_id, rejection.message)
            self.metrics.observe_rejection(rejection.code.name)
            self._drop(conn, rejection.code, f"{self.name}: {rejection.message}")
            return
        self._delivery.execute(job, actions)

    def _reject(self, conn: Connection, rejection: RejectedMessage) -> None:
        """A malformed message: the leader aborts the step (an unadmitted stream just ends)."""
        job = self.jobs.get(conn.job_id) if conn.job_id is not None else None
        if job is None:
            self._drop(conn, rejection.code, rejection.message)
            return
        self._deliver(job, ShardOutcome([], job.report(conn.rank, rejection)))

    def _admit(
        self, conn: Connection, message: pb.WorkerMessage, size: int
    ) -> Awaitable[None] | None:
        """A data stream opens with its ShardHello (returned as a coroutine to await)."""
        kind = message.WhichOneof("kind")
        if kind != "shard_hello":
            self._drop(
                conn,
                Code.FAILED_PRECONDITION,
                f"the first message on a shard data stream must be a ShardHello, "
                f"got {kind or 'an empty message'}",
            )
            return None
        return self._hello(conn, message.shard_hello)

    async def _hello(self, conn: Connection, hello: pb.ShardHello) -> None:
        """Admit a stream whose ShardHello the leader's view vouches for."""
        if self.draining:
            self._drop(
                conn, Code.UNAVAILABLE, f"{self.name} is shutting down", pb.END_REASON_SHARD_LOST
            )
            return
        wait_s = ANNOUNCE_GRACE_S

        def announced() -> bool:
            if hello.shard_index != self.index:
                return True  # wrong whatever the leader says next
            job = self.jobs.get(hello.job_id)
            # A member is judged at once, whatever its incarnation and session: the
            # view that made it one came before any Welcome of another incarnation.
            return job is not None and hello.rank in job.membership.members

        await self._wait_until(lambda: self.index is not None, self.heartbeat_timeout_s)
        if self.index is not None and not conn.ended:
            await self._wait_until(announced, wait_s)
        if conn.ended:
            return
        if self.index is None:
            self._drop(
                conn,
                Code.UNAVAILABLE,
                f"{self.name} is not registered with its leader {self.config.leader}",
                pb.END_REASON_SHARD_LOST,
            )
            return
        if hello.shard_index != self.index:
            self._drop(
                conn,
                Code.INVALID_ARGUMENT,
                f"rank {hello.rank} of job '{hello.job_id}' opened a data stream for shard "
                f"{hello.shard_index}, but this is {self.name}",
            )
            return
        job = self.jobs.get(hello.job_id)
        problem = (
            f"{self.name} does not know job '{hello.job_id}': its leader {self.config.leader} "
            f"did not announce it within {wait_s:g}s (rank {hello.rank}, incarnation "
            f"{hello.incarnation!r})"
            if job is None
            else job.hello_problem(hello.rank, hello.incarnation, hello.session)
        )
        if problem is not None:
            log.warning("refused data stream from %s: %s", conn.peer, problem)
            refused = job is not None and job.session_refused(
                hello.rank, hello.incarnation, hello.session
            )
            code = Code.PERMISSION_DENIED if refused else Code.FAILED_PRECONDITION
            self._drop(conn, code, problem)
            return
        conn.job_id, conn.rank, conn.incarnation = hello.job_id, hello.rank, hello.incarnation
        conn.session = hello.session
        previous = self.connections.get((hello.job_id, hello.rank))
        if previous is not None:
            self._drop(previous, Code.OK, f"replaced by a newer data stream from {conn.peer}")
        self.connections[(hello.job_id, hello.rank)] = conn
        log.info(
            "job '%s': rank %d opened its data stream from %s", hello.job_id, hello.rank, conn.peer
        )
