"""One worker's stream as the servicer sees it: its identity and its bounded outbox.

The servicer's reader hands messages to the job; what the job wants sent is
queued here and drained by the stream's writer. The queue is bounded in
bytes (architecture invariant 5): a worker that stops reading is ended with
RESOURCE_EXHAUSTED instead of growing the coordinator's memory. Ending a
stream is queued too, so it happens after what was queued before, and an
error end is announced by a `StreamEnd` carrying the reason.

Bounds: one outbox holds at most `max_outbox_bytes` (a few
buckets), and all outboxes together are counted in one coordinator-wide
`ByteBudget`; a worker whose outbox is behind when either would be exceeded
is dropped at once. Its queue is discarded first, so the RESOURCE_EXHAUSTED
`StreamEnd` is the next thing it reads (behind at most the one write already
in flight) and the memory is freed now; it then gets `flush_s` (a bounded
wait) to read it before the stream is cancelled. A stream that sends no
first message within `first_message_s` is ended with DEADLINE_EXCEEDED, and
an unexpected exception in a handler ends the stream with INTERNAL naming the
handler and the exception (logged with its traceback), never with OK.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from gradsync_proto.codes import Code
from gradsync_proto.v1 import gradsync_pb2 as pb

from gradsync_server.control.job import Job
from gradsync_server.dataplane.actions import ResumeBlob
from gradsync_server.dataplane.budget import ByteBudget, Reservation
from gradsync_server.errors import RejectedMessage

log = logging.getLogger("gradsync.server")

#: A request as the stream's reader gets it: bytes, or a message gRPC parsed (ShardLink).
R = TypeVar("R")

#: How long a stream that ends waits for a write in flight before cancelling it.
WRITER_STOP_S = 1.0


@dataclass(frozen=True)
class End:
    """Outbox sentinel: end the stream with this status after prior writes."""

    code: Code
    details: str


class Connection:
    """One worker's stream: identity once joined, and its bounded outbox.

    A shard's control stream at the leader is one too (`shard_control`): its
    StreamEnd travels in a `LeaderMessage` (`envelope`), and `heartbeat`
    (seconds, message) is written whenever the outbox stays empty that long.
    """

    def __init__(
        self,
        peer: str,
        max_outbox_bytes: int,
        outbox_budget: ByteBudget | None = None,
        *,
        envelope: type[pb.CoordinatorMessage | pb.LeaderMessage] = pb.CoordinatorMessage,
        heartbeat: tuple[float, bytes] | None = None,
    ) -> None:
        self.peer = peer
        self._envelope = envelope
        self._heartbeat = heartbeat
        #: The job that admitted the stream (None until then, and once it left).
        self.job_id: str | None = None
        #: At the leader, the very job object the stream joined (see `delivery`).
        self.job: Job | None = None
        self.rank = -1
        #: The incarnation and session secret (never logged) of a shard stream's hello.
        self.incarnation = ""
        self.session = b""
        self.left = False
        #: Why the coordinator ended this stream for a refused message (told to its peers).
        self.refused: str | None = None
        self.outbox: asyncio.Queue[bytes | ResumeBlob | End] = asyncio.Queue()
        #: Set when the queue was discarded: a blob being written stops too.
        self._discarded = False
        self.outbox_bytes = 0
        self.max_outbox_bytes = max_outbox_bytes
        self.ended = False
        #: The peer sent its first message (checked by the first-message deadline).
        self.greeted = False
        #: How the stream was ended (set by `end`), whether or not the writer got to it.
        self.end_status: End | None = None
        #: The stream's synchronous write, when its pipe has one (a frame connection's
        #: `write_now`: False when its buffer is full); None for gRPC. Used by `send`
        #: while the writer waits on an empty outbox, which saves the queue's hand-over
        #: to the writer task on every message.
        self._write_now: Callable[[bytes], bool] | None = None
        self._writer_idle = False
        self._outbox_budget = outbox_budget
        self._held: Reservation | None = (
            outbox_budget.reserve(("outbox", id(self))) if outbox_budget is not None else None
        )

    def _account(self) -> None:
        """Tell the global budget what this outbox holds now."""
        if self._held is not None:
            self._held.hold(max(0, self.outbox_bytes))

    def send(self, raw: bytes) -> None:
        if self.ended:
            return
        budget = self._outbox_budget
        over_own = self.outbox_bytes + len(raw) > self.max_outbox_bytes
        over_all = budget is not None and self.outbox_bytes > 0 and not budget.fits(len(raw))
        if over_own or over_all:
            limit = (
                f"limit {self.max_outbox_bytes} bytes per worker"
                if over_own
                else f"all workers' queues hold {budget.used if budget else 0} bytes, limit "
                f"{budget.limit if budget else 0} (--max-buffered-mb)"
            )
            self.end(
                Code.RESOURCE_EXHAUSTED,
                f"rank {self.rank} is not reading its results fast enough: "
                f"{self.outbox_bytes} bytes are queued for it ({limit}); dropped",
                pb.END_REASON_RESOURCE_EXHAUSTED,
                discard=True,
            )
            return
        direct = self._write_now
        if direct is not None and self._writer_idle and self.outbox.empty() and direct(raw):
            return  # nothing queued, the writer waiting: written straight through, in order
        self.queue(raw)

    def queue(self, raw: bytes) -> None:
        """Queue `raw` for the writer past the outbox's bound: what `send` admitted, and
        a shard link's messages (what the leader decides for its shards is not bounded
        per link)."""
        self._writer_idle = False  # from here on the writer keeps the order
        self.outbox_bytes += len(raw)
        self._account()
        self.outbox.put_nowait(raw)

    def send_blob(self, blob: ResumeBlob) -> None:
        """Queue a state blob; the writer encodes and sends its chunks one at a time.

        Not counted in the outbox: its bytes are the job's (bounded by
        --max-checkpoint-mb, held once for every receiver), and each write waits
        for the stream's flow control, so nothing piles up behind a slow reader.
        """
        if not self.ended:
            self.outbox.put_nowait(blob)

    def _discard_queue(self) -> None:
        """Drop every queued write (a slow reader's backlog), freeing its memory now."""
        self._discarded = True
        while True:
            try:
                item = self.outbox.get_nowait()
            except asyncio.QueueEmpty:
                break
            if isinstance(item, bytes):
                self.outbox_bytes -= len(item)
        self._account()

    def end(
        self, code: Code, details: str, reason: pb.EndReason | None = None, discard: bool = False
    ) -> None:
        """End the stream after what is queued; an error is announced by a StreamEnd first.

        `reason` defaults to the one the code implies (RESOURCE_EXHAUSTED's, else none).
        The StreamEnd bypasses the outbox limit: it is small and must arrive.
        With `discard`, what is queued is dropped first, so the StreamEnd is
        the next message the peer reads.
        """
        if self.ended:
            return
        self.ended = True
        self.end_status = End(code, details)
        if discard:
            self._discard_queue()
        if code is not Code.OK:
            if reason is None:
                exhausted = code is Code.RESOURCE_EXHAUSTED
                reason = (
                    pb.END_REASON_RESOURCE_EXHAUSTED if exhausted else pb.END_REASON_UNSPECIFIED
                )
            stream_end = pb.StreamEnd(reason=reason, code=int(code), message=details)
            raw = self._envelope(stream_end=stream_end).SerializeToString()
            self.outbox_bytes += len(raw)
            self.outbox.put_nowait(raw)
        self.outbox.put_nowait(End(code, details))

    async def drain(self, context: Any, ended: asyncio.Future[End]) -> None:
        """Write the outbox to the stream until an `End` comes out; resolve `ended` with it.

        `context` is the call's `grpc.aio.ServicerContext` (typed loosely so this
        module stays free of gRPC). A write that fails means the worker went away:
        `ended` then resolves to UNAVAILABLE.
        """
        self._write_now = getattr(context, "write_now", None)
        try:
            while True:
                self._writer_idle = self.outbox.empty()
                item = await self._next()
                self._writer_idle = False
                if isinstance(item, End):
                    ended.set_result(item)
                    return
                if isinstance(item, ResumeBlob):
                    for raw in item.messages():
                        if self._discarded:
                            break
                        await context.write(raw)
                    continue
                await context.write(item)
                self.outbox_bytes -= len(item)
                self._account()
        except asyncio.CancelledError:
            self._writer_idle = False
            raise
        except Exception as exc:  # the worker went away while we wrote
            self._writer_idle = False
            log.info("writing to %s (rank %s) failed: %s", self.peer, self.rank, exc)
            if not ended.done():
                ended.set_result(End(Code.UNAVAILABLE, f"write failed: {exc}"))

    async def _next(self) -> bytes | ResumeBlob | End:
        """The next item to write; the heartbeat when the outbox stays empty for its period."""
        if self._heartbeat is None:
            return await self.outbox.get()
        period_s, heartbeat = self._heartbeat
        try:
            return await asyncio.wait_for(self.outbox.get(), timeout=period_s)
        except TimeoutError:
            self.outbox_bytes += len(heartbeat)  # (the writer counts it out again)
            return heartbeat

    def fail_internal(self, handler: str, exc: BaseException) -> None:
        """A bug in `handler`: log it with its traceback, end the stream with INTERNAL."""
        log.error(
            "internal error in %s serving %s (rank %s)",
            handler,
            self.peer,
            self.rank,
            exc_info=(type(exc), exc, exc.__traceback__),
        )
        self.end(Code.INTERNAL, internal_details(handler, exc), discard=True)

    async def _read(
        self,
        request_iterator: AsyncIterator[R],
        dispatch: Callable[[R], Awaitable[None] | None],
        handler: str,
    ) -> None:
        """Hand every request to `dispatch` until the stream ends.

        A `RejectedMessage` out of `dispatch` ends this stream with its code
        (e.g. a gradient for a refused job); any other exception is a bug, not
        the peer's doing: INTERNAL naming `handler`. A transport failure under
        the loop is a disconnect.
        """
        try:
            async for raw in request_iterator:
                self.greeted = True
                try:
                    waiting = dispatch(raw)
                    if waiting is not None:
                        await waiting  # a Join may wait for the checkpoint store (off the loop)
                except RejectedMessage as rejection:
                    log.warning("ending %s (rank %d): %s", self.peer, self.rank, rejection.message)
                    self.end(rejection.code, rejection.message)
                except Exception as exc:
                    self.fail_internal(handler, exc)
                if self.ended:
                    return
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the transport failed under us: treat as a disconnect
            log.info("%s stream from %s (rank %s) failed: %s", handler, self.peer, self.rank, exc)

    async def serve(
        self,
        request_iterator: AsyncIterator[R],
        dispatch: Callable[[R], Awaitable[None] | None],
        context: Any,
        handler: str,
        first_message_s: float,
        flush_s: float,
        detach: Callable[[], None],
    ) -> End | None:
        """Run one stream: a reader hands the requests to `dispatch` while the outbox is written.

        Returns once the reader finishes or the stream is ended (after flushing what
        was queued, for at most `flush_s`), with the `End` it ended with (None when
        the reader finished first). `detach` forgets the connection, before both
        tasks are reaped so that none is reported pending at exit. A stream that
        sent nothing within `first_message_s` is ended with DEADLINE_EXCEEDED. An
        exception out of the reader (a bug: transport failures are the reader's to
        handle) ends the stream with INTERNAL naming `handler`.
        """
        loop = asyncio.get_running_loop()
        ended: asyncio.Future[End] = loop.create_future()
        reader = asyncio.create_task(self._read(request_iterator, dispatch, handler))
        writer = asyncio.create_task(self.drain(context, ended))
        timer = loop.call_later(first_message_s, self._first_message_due)
        try:
            pending: list[asyncio.Future[Any]] = [reader, ended]
            await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            if reader.done() and not reader.cancelled() and reader.exception() is not None:
                self.fail_internal(handler, reader.exception())  # type: ignore[arg-type]
            if not ended.done() and self.ended:
                # The stream is to end (goodbye or refusal): flush what is queued first.
                await asyncio.wait({ended}, timeout=flush_s)
        finally:
            timer.cancel()
            reader.cancel()
            try:
                if not writer.done():
                    # Let a write in flight finish rather than cancel it half-way: that
                    # leaves an operation pending in gRPC's core, which then logs an
                    # ExecuteBatchError ("too many operations") when the handler returns.
                    # A peer that is gone makes the write fail at once.
                    self.outbox.put_nowait(End(Code.OK, ""))
                    await asyncio.wait({writer}, timeout=WRITER_STOP_S)
            finally:
                # Also when this handler is cancelled again during that wait (a peer
                # cancelling under load): skipping detach would leave a gone rank in
                # its job until the heartbeat timeout, and the others waiting for it.
                writer.cancel()
                try:
                    detach()
                finally:
                    self._discard_queue()
                    if self._held is not None:
                        self._held.release()
                        self._held = None
                    await asyncio.gather(reader, writer, return_exceptions=True)
        if ended.done() and not ended.cancelled():
            return ended.result()
        # The writer never got to the end (a peer that does not read): the status is
        # still the one the stream was ended with, never a silent OK.
        return self.end_status

    def _first_message_due(self) -> None:
        if self.ended or self.greeted:
            return
        self.end(
            Code.DEADLINE_EXCEEDED,
            f"{self.peer} sent no first message (Join, ShardHello or ShardRegister) within "
            "the first-message deadline (--first-message-timeout-s); stream ended",
        )


def internal_details(handler: str, exc: BaseException) -> str:
    """The INTERNAL status details for an unexpected exception in `handler` (bounded)."""
    text = f"internal error in {handler}: {type(exc).__name__}: {exc}"
    return text if len(text) <= 1000 else text[:1000] + "..."
