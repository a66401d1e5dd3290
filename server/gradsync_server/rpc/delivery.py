"""Carrying out a job's actions on the coordinator's streams (leader and shard alike).

The job (pure) returns actions; this is where they meet sockets: a `Send`
is serialized once and written to every target rank's outbox (an average for
a same-host segment is written into the segment instead and only its header
sent), a `Persist` runs in the background on the checkpoint store, a
`PersistOuter` (a DiLoCo step committed) is saved first and the rest of its
list delivered only once that returned (so that no rank holds a round's whole
answer that the store does not), and a `Terminate` ends streams with a status.
A job's actions reach only the streams joined to that very job object: after
a shard loss (or a Join to a failed job) a new job with the same id may run
while the old one's streams end. Shards hear of the job's control events
first, so that a Welcome's job is known to every shard before any worker can
open a data stream for it. A shard delivers its averages the same way, with
no segments, store checkpoints or shards of its own.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Coroutine, Iterable, Iterator
from typing import Any, Generic, Protocol, TypeVar

from gradsync_server.dataplane.actions import (
    Action,
    Persist,
    PersistOuter,
    ResumeBlob,
    SegmentAverage,
    Send,
    Terminate,
)
from gradsync_server.metrics import CoordinatorMetrics
from gradsync_server.rpc.connection import Connection
from gradsync_server.rpc.outer_records import OuterRecords
from gradsync_server.rpc.payload_socket import averaged_for
from gradsync_server.rpc.segments import SegmentRegistry

log = logging.getLogger("gradsync.server")


class _Job(Protocol):
    @property
    def job_id(self) -> str: ...


JobT = TypeVar("JobT", bound=_Job)


class Delivery(Generic[JobT]):
    """Delivers the actions of the process's jobs (everything on the servicer's loop).

    Args:
        connections: the admitted streams by (job id, rank), shared with the servicer.
        metrics: where aborts and stream ends are counted.
        outer: where a `PersistOuter` is saved before the rest of its actions go out.
        detach: forgets a stream that was dropped as a slow reader.
        segments: same-host segments, for averages written in place (a leader's).
        before: told of a job's actions before they are carried out (a leader's
            shards, which hear each job's control events first).
        persist: carries out `Persist` on the store (a leader's checkpoints).
    """

    def __init__(
        self,
        connections: dict[tuple[str, int], Connection],
        metrics: CoordinatorMetrics,
        outer: OuterRecords,
        detach: Callable[[Connection], None],
        segments: SegmentRegistry | None = None,
        before: Callable[[JobT], None] | None = None,
        persist: Callable[[JobT, Persist], Awaitable[list[Action]]] | None = None,
    ) -> None:
        self._connections = connections
        self._metrics = metrics
        self._outer = outer
        self._detach = detach
        self._segments = segments
        self._before = before
        self._persist_on = persist
        self._background: set[asyncio.Task[None]] = set()

    def execute(
        self, job: JobT, actions: list[Action], then: Callable[[], None] | None = None
    ) -> None:
        """Carry out `actions` of `job`, in order, then call `then`."""
        if self._before is not None:
            self._before(job)
        saves = [action for action in actions if isinstance(action, PersistOuter)]
        if saves:
            rest: list[Action] = [a for a in actions if not isinstance(a, PersistOuter)]
            self._in_background(self._save_outer_first(job, saves, rest, then))
            return
        for action in actions:
            if isinstance(action, Send):
                self._send(job, action)
            elif isinstance(action, Persist):
                self._in_background(self._persist(job, action))
            elif isinstance(action, Terminate):
                self._metrics.observe_error(action.code.name)
                log.warning(
                    "job '%s': ending ranks %s: %s", job.job_id, list(action.ranks), action.details
                )
                reason = action.reason or None  # UNSPECIFIED: let the code decide
                for target in self._targets(job, action.ranks):
                    target.end(action.code, action.details, reason)
        if then is not None:
            then()

    def _targets(self, job: JobT, ranks: Iterable[int]) -> Iterator[Connection]:
        """The streams of `ranks` that are admitted to this very job (a shard's streams
        name their job by id alone)."""
        for rank in ranks:
            target = self._connections.get((job.job_id, rank))
            if target is not None and (target.job is None or target.job is job):
                yield target

    def _send(self, job: JobT, send: Send) -> None:
        message = send.message
        if isinstance(message, SegmentAverage) and self._segments is not None:
            # Written into each rank's segment, the header only sent (the whole chunk,
            # encoded once, to a rank whose segment cannot take it).
            for target in self._targets(job, send.ranks):
                self._write(target, averaged_for(self._segments, target, message))
            return
        if isinstance(message, SegmentAverage):
            message = message.encoded()  # (no same-host segments here)
        if isinstance(message, ResumeBlob):
            for target in self._targets(job, send.ranks):
                target.send_blob(message)  # its writer encodes the chunks as it sends
            return
        if isinstance(message, bytes):
            raw = message  # pre-encoded averaged chunk, serialized once for all ranks
        else:
            raw = message.SerializeToString()
            kind = message.WhichOneof("kind")
            if kind == "step_aborted":
                self._metrics.observe_step_aborted(message.step_aborted)
                log.warning("job '%s': %s", job.job_id, message.step_aborted.message)
            elif kind == "membership":
                log.warning("job '%s': %s", job.job_id, message.membership.reason)
        for target in self._targets(job, send.ranks):
            self._write(target, raw)

    def _write(self, target: Connection, raw: bytes) -> None:
        target.send(raw)
        if target.ended:
            # Dropped as a slow reader: the others must not wait for it while its end
            # flushes (soon: not inside this job's actions).
            asyncio.get_running_loop().call_soon(self._detach, target)

    def _in_background(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(work)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _save_outer_first(
        self,
        job: JobT,
        saves: list[PersistOuter],
        rest: list[Action],
        then: Callable[[], None] | None,
    ) -> None:
        """Save the outer state, then deliver the step's last answers (also if it failed:
        the job goes on, logged; only a restart before the next good save is refused)."""
        for save in saves:
            await self._outer.save(save.snapshot, save.shard_index)
        self.execute(job, rest, then)

    async def _persist(self, job: JobT, action: Persist) -> None:
        """Carry out a Persist in the background, then deliver its acknowledgement."""
        if self._persist_on is not None:
            self.execute(job, await self._persist_on(job, action))
