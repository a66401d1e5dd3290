"""The leader's side of its shards' control streams (`Coordinator.ShardLink`).

Each coordinator shard holds one bidirectional control stream to the leader:
it registers (`ShardRegister`; version and configuration are checked by the
`ShardRegistry`), then sends its counters as a sign of life every heartbeat
interval and reports the worker messages it refused (`ShardRejected`); the
leader answers with `ShardAccepted`, then heartbeats and, per job, the
`ShardJobView` (at the job's start, queued before the Welcome goes to the
workers, and after every change of members, epoch or ranks out of inputs),
`ShardAbort` for every step the leader aborts, and `ShardJobEnd` when it
forgets the job. Those are the job's control events: the job (the control
plane) decides them and applies them to its own data plane as it goes, and
this module sends what `Job.take_events` returns before the workers hear of
the actions, so that a Welcome's job is known to every shard before any
worker can open a data stream for it.

A shard whose stream ends, or that is silent beyond the heartbeat timeout
(checked by the watchdog through `check`), is lost: every job the leader
holds ends at once with UNAVAILABLE and reason SHARD_LOST (the workers
reconnect and the job resumes from its last checkpoint once the shard is
back), since a range of every bucket is gone with it. Jobs start only while
every shard is registered. All of this runs on the servicer's event loop, so
it needs no locks.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, Protocol

import grpc
from gradsync_proto import __version__
from gradsync_proto.codes import Code
from gradsync_proto.v1 import gradsync_pb2 as pb

from gradsync_server import defaults
from gradsync_server.config import CoordinatorConfig
from gradsync_server.control.job import Job, JobState
from gradsync_server.control.shard_registry import (
    RegistrationRefused,
    ShardRecord,
    ShardRegistry,
    shard_view,
)
from gradsync_server.dataplane.actions import Action
from gradsync_server.dataplane.nonfinite import NonFiniteContribution, NonFiniteRejection
from gradsync_server.errors import RejectedMessage
from gradsync_server.metrics import CoordinatorMetrics, ShardSample
from gradsync_server.rpc.connection import WRITER_STOP_S, Connection
from gradsync_server.rpc.servicer import STATUS_BY_CODE
from gradsync_server.text import capped, quoted

log = logging.getLogger("gradsync.server")

#: Longest text of a shard's refusal relayed to the ranks (a shard's own messages name
#: the rank, step, bucket, offset, shard and values, which takes a few hundred characters).
SHARD_TEXT_CHARS = 1000


class Leader(Protocol):
    """What the shard control needs from the coordinator (the servicer)."""

    jobs: dict[str, Job]
    #: True while the coordinator shuts down (a shard going away then ends no job).
    draining: bool

    def execute(self, job: Job, actions: list[Action]) -> None:
        """Carry out `actions` of `job`."""

    def retire_job(self, job: Job) -> None:
        """Remove `job` from the active jobs at once and record how it ended."""

    def stats(self) -> pb.ShardStats:
        """The leader's own counters (shard 0)."""


@dataclass(frozen=True)
class _Link:
    """One registered shard's control stream: its record, and the stream (its outbox)."""

    record: ShardRecord
    stream: Connection


class ShardControl:
    """The shard registry, the control streams, and what jobs tell their shards.

    Args:
        leader: the coordinator whose jobs the shards follow.
        config: the leader's configuration (shard count, chunk size, heartbeats).
        clock: monotonic time source (injectable for tests).
        metrics: where the shards' series are exported (when sharded).
    """

    def __init__(
        self,
        leader: Leader,
        config: CoordinatorConfig,
        clock: Callable[[], float],
        metrics: CoordinatorMetrics,
    ) -> None:
        self._leader = leader
        self._config = config
        self._clock = clock
        self.registry = ShardRegistry(
            config.shard_count,
            __version__,
            config.chunk_bytes,
            clock,
            config.shards_flag,
            live_s=config.heartbeat_timeout_s,
        )
        self._links: dict[int, _Link] = {}
        #: Jobs the shards were told about (they must be told when the job ends).
        self._known: set[Job] = set()
        #: Jobs ended because a shard was lost, with the status their data streams get.
        self._lost_jobs: dict[Job, tuple[Code, str]] = {}
        self._next_report = clock() + defaults.SHARD_WAIT_REPORT_PERIOD_S
        self.complete = asyncio.Event()
        if self.registry.complete():
            self.complete.set()
        if self.registry.sharded:
            metrics.watch_shards(self.samples)

    # ------------------------------------------------------------- job events
    def before_delivery(self, job: Job) -> None:
        """Send the shards the control events `job` decided, before its workers hear of them."""
        if not self.registry.sharded:
            return  # an unsharded job decides none (this runs for every averaged chunk)
        events = job.take_events()
        if not events:
            return
        self._known.add(job)
        for event in events:
            self._broadcast(event)

    def job_ended(self, job: Job) -> None:
        """`job` left the leader's active jobs: its shards forget it."""
        if job not in self._known:
            return  # it never started: no shard knows it
        self._known.discard(job)
        lost = self._lost_jobs.get(job)
        if lost is None:
            self._broadcast(job.end_event())
            return
        end = pb.ShardJobEnd(job_id=job.job_id, code=int(lost[0]), message=lost[1])
        self._broadcast(pb.LeaderMessage(job_end=end))

    def _broadcast(self, message: pb.LeaderMessage) -> None:
        if message.WhichOneof("kind") != "job":
            raw = message.SerializeToString()
            for link in self._links.values():
                link.stream.queue(raw)
            return
        for index, link in self._links.items():
            link.stream.queue(shard_view(message, index).SerializeToString())

    def _start_waiting_jobs(self) -> None:
        """Every shard is registered: start the jobs that waited, assembled, for them."""
        for job in list(self._leader.jobs.values()):
            if job.state is JobState.ASSEMBLING:
                self._leader.execute(job, job.start_if_ready())

    # ----------------------------------------------------------------- status
    def statuses(self) -> list[pb.ShardStatus]:
        """StatusReply.shards: the leader's own counters first, then every shard index."""
        if not self.registry.sharded:
            return []
        shards = [_status(0, "", self._leader.stats(), alive=True, version=__version__)]
        for index in range(1, self.registry.shard_count):
            record = self.registry.get(index)
            if record is None:
                shards.append(
                    pb.ShardStatus(index=index, address=self.registry.last_address(index))
                )
                continue
            status = _status(index, record.shown_address, record.stats, alive=self._alive(record))
            status.version = record.version
            status.last_seen_s = self.registry.seconds_since_heard(record)
            shards.append(status)
        return shards

    def samples(self) -> list[ShardSample]:
        """The shards' series for the leader's /metrics (read at every scrape)."""
        own = self._leader.stats()
        samples = [ShardSample(0, "", True, own.bytes_received, own.bytes_sent, 0.0)]
        for index in range(1, self.registry.shard_count):
            record = self.registry.get(index)
            received, sent = self.registry.totals(index)
            if record is None:
                address, up, last_seen = self.registry.last_address(index), False, 0.0
            else:
                address, up = record.shown_address, self._alive(record)
                last_seen = self.registry.seconds_since_heard(record)
            samples.append(ShardSample(index, address, up, received, sent, last_seen))
        return samples

    def _alive(self, record: ShardRecord) -> bool:
        return self.registry.seconds_since_heard(record) <= self._config.heartbeat_timeout_s

    # --------------------------------------------------------------- liveness
    def check(self) -> None:
        """One watchdog pass: lose silent shards; say every ~10 s what is missing."""
        if not self.registry.sharded or self._leader.draining:
            return
        timeout = self._config.heartbeat_timeout_s
        for record in self.registry.silent(timeout):
            silence = self.registry.seconds_since_heard(record)
            self.lose(
                record, f"silent for {silence:.1f}s, beyond the heartbeat timeout of {timeout:g}s"
            )
        now = self._clock()
        if self.registry.complete() or now < self._next_report:
            return
        self._next_report = now + defaults.SHARD_WAIT_REPORT_PERIOD_S
        waiting = sorted(j.job_id for j in self._leader.jobs.values())
        jobs = f"; jobs waiting: {waiting}" if waiting else ""
        log.warning("%s%s", self.registry.describe_missing(), jobs)

    def close_links(self) -> None:
        """Shutdown: end every control stream now (UNAVAILABLE, SHUTTING_DOWN).

        Without this a remote shard would hold the server's stop for its whole
        grace; told, it re-registers with the restarted leader.
        """
        for link in self._links.values():
            link.stream.end(
                Code.UNAVAILABLE, "the leader is shutting down", pb.END_REASON_SHUTTING_DOWN
            )

    def lose(self, record: ShardRecord, why: str) -> None:
        """Shard `record` is lost: end its stream and every job the leader holds."""
        if not self.registry.remove(record):
            return  # already lost, or replaced by a newer registration
        self.complete.clear()
        index, address = record.index, record.shown_address
        summary = f"shard {index} at {address} was lost ({why})"
        link = self._links.get(index)
        if link is not None and link.record is record:
            del self._links[index]
            link.stream.end(Code.UNAVAILABLE, summary, pb.END_REASON_SHARD_LOST)
        if self._leader.draining:
            log.info("shard %d at %s went away during shutdown", index, address)
            return
        jobs = list(self._leader.jobs.values())
        log.error("%s; ending %d job(s): %s", summary, len(jobs), [j.job_id for j in jobs])
        for job in jobs:
            actions = job.end_for_shard_loss(index, address, why)
            self._lost_jobs[job] = (Code.UNAVAILABLE, f"{summary}; job '{job.job_id}' ended")
            self._leader.execute(job, actions)
            self._leader.retire_job(job)
            self._lost_jobs.pop(job, None)

    # ------------------------------------------------------------ the stream
    async def link(
        self, request_iterator: AsyncIterator[pb.ShardMessage], context: grpc.aio.ServicerContext
    ) -> None:
        """Serve one shard's control stream: register, then follow until it ends or is lost."""
        peer = context.peer()
        try:
            first = await asyncio.wait_for(
                anext(request_iterator), timeout=self._config.heartbeat_timeout_s
            )
        except (StopAsyncIteration, TimeoutError):
            await self._refuse(
                context,
                Code.FAILED_PRECONDITION,
                f"{peer} opened a shard link but sent no ShardRegister within "
                f"{self._config.heartbeat_timeout_s:g}s",
            )
            return
        if first.WhichOneof("kind") != "register":
            got = first.WhichOneof("kind") or "an empty message"
            message = f"the first message on a shard link must be a ShardRegister, got {got}"
            await self._refuse(context, Code.FAILED_PRECONDITION, message)
            return
        try:
            record, replaced = self.registry.register(first.register, peer_host_of(peer))
        except RegistrationRefused as refused:
            log.error("refused shard registration from %s: %s", peer, refused.message)
            await self._refuse(context, refused.code, refused.message)
            return
        if replaced is not None:
            self.lose(replaced, f"silent, and a shard registered at {replaced.shown_address}")
        config = self._config
        heartbeat = pb.LeaderMessage(heartbeat=pb.Heartbeat()).SerializeToString()
        stream = Connection(
            peer,
            0,  # (no bound: its messages are queued past it, `Connection.queue`)
            envelope=pb.LeaderMessage,
            heartbeat=(config.heartbeat_interval_s, heartbeat),
        )
        stream.greeted = True  # (the ShardRegister)
        link = _Link(record, stream)
        accepted = pb.ShardAccepted(
            shard_index=record.index,
            shard_count=self.registry.shard_count,
            heartbeat_interval_s=config.heartbeat_interval_s,
            heartbeat_timeout_s=config.heartbeat_timeout_s,
            nonfinite=config.nonfinite,
        )
        stream.queue(pb.LeaderMessage(accepted=accepted).SerializeToString())
        self._links[record.index] = link
        missing = self.registry.missing()
        log.info(
            "shard %d registered: %s (from %s, version %s); %s",
            record.index,
            record.shown_address,
            peer,
            record.version,
            f"still missing shard(s) {missing}" if missing else "all shards registered",
        )
        if self.registry.complete():
            self.complete.set()
            self._start_waiting_jobs()
        end = await stream.serve(
            request_iterator,
            lambda message: self._follow(link, message),
            context,
            "ShardLink",
            config.heartbeat_timeout_s,
            WRITER_STOP_S,
            lambda: self.lose(record, "its control stream ended"),
        )
        if end is not None and end.code is not Code.OK:
            context.set_code(STATUS_BY_CODE[int(end.code)])
            context.set_details(end.details)

    def _follow(self, link: _Link, message: pb.ShardMessage) -> None:
        """One message of a registered shard: a sign of life, and what it reports."""
        record = link.record
        kind = message.WhichOneof("kind")
        stats = message.stats if kind == "stats" else None
        if not self.registry.heard(record, stats):
            link.stream.end(Code.OK, "")  # replaced or lost meanwhile
        elif kind == "rejected":
            self._on_rejected(record, message.rejected)
        elif kind == "nonfinite":
            self._count_nonfinite(record, message.nonfinite)

    def _on_rejected(self, record: ShardRecord, rejected: pb.ShardRejected) -> None:
        """A shard refused a worker's message: the leader aborts the step for every rank."""
        job = self._leader.jobs.get(rejected.job_id)
        try:
            code = Code(rejected.code)
        except ValueError:
            code = Code.INVALID_ARGUMENT
        rejection: RejectedMessage
        words = capped(rejected.message, SHARD_TEXT_CHARS)  # reaches every rank: bounded
        rank, step, bucket = rejected.rank, rejected.step, rejected.bucket_index
        if rejected.reason == pb.ABORT_REASON_NONFINITE:  # --nonfinite abort, at the shard
            rejection = NonFiniteRejection(rank, step, bucket, words)
            self._count_nonfinite(record, rejected)
        else:
            rejection = RejectedMessage(code, words, step=step, bucket_index=bucket)
        actions = None
        if job is not None and job in self._known:
            actions = job.reject_from_shard(rejected.rank, rejection)
        if job is None or actions is None:
            # The job ended, or that step was aborted already: nothing more to undo.
            log.info(
                "shard %d refused a message of rank %d for step %d of job %s (nothing "
                "left to abort): %s",
                record.index,
                rejected.rank,
                rejected.step,
                quoted(rejected.job_id),
                quoted(rejected.message),
            )
            return
        self._leader.execute(job, actions)

    def _count_nonfinite(
        self, record: ShardRecord, report: pb.ShardNonFinite | pb.ShardRejected
    ) -> None:
        """A shard saw NaN/Inf (ShardNonFinite, or a NONFINITE ShardRejected): count and log it.

        Described from the fields, not the shard's text (the shard logs its own,
        with the counts), so that nothing a peer wrote reaches the log or status.
        A member named by its local leader's sum is described with that leader.
        """
        job = self._leader.jobs.get(report.job_id)
        if job is None:
            return  # the job ended meanwhile
        groups = job.membership.groups
        via = groups.leader_of(report.rank) if report.via_local_leader else -1
        job.in_flight.nonfinite.note(
            NonFiniteContribution(
                job_id=job.job_id,
                rank=report.rank,
                step=report.step,
                bucket_index=report.bucket_index,
                offset=-1,
                nonfinite=0,
                elements=0,
                where=f"shard {record.index}",
                covered=groups.group_of(report.rank) if via >= 0 else (),
                via=via,
            )
        )

    async def _refuse(self, context: grpc.aio.ServicerContext, code: Code, details: str) -> None:
        """End a stream that never registered: a StreamEnd, then the same status."""
        end = pb.StreamEnd(code=int(code), message=details)
        try:
            await context.write(pb.LeaderMessage(stream_end=end).SerializeToString())
        except Exception as exc:  # the shard is already gone; the status below is moot
            log.info("could not tell a refused shard why: %s", exc)
        context.set_code(STATUS_BY_CODE[int(code)])
        context.set_details(details)


def peer_host_of(peer: str) -> str:
    """The host of a gRPC peer string ("ipv4:10.0.0.5:41488" -> "10.0.0.5", ipv6 bracketed)."""
    kind, _, rest = peer.partition(":")
    if kind not in ("ipv4", "ipv6") or ":" not in rest:
        return ""
    host = rest.rsplit(":", 1)[0]
    if kind == "ipv6" and not host.startswith("["):
        host = f"[{host}]"
    return host


def _status(index: int, address: str, stats: pb.ShardStats, **fields: Any) -> pb.ShardStatus:
    """One row of StatusReply.shards, its counters from `stats` (same field names)."""
    counters = {name: getattr(stats, name) for name in pb.ShardStats.DESCRIPTOR.fields_by_name}
    return pb.ShardStatus(index=index, address=address, **counters, **fields)
