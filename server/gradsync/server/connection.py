"""One worker's stream as the servicer sees it: its identity and its bounded outbox.

The servicer's reader hands messages to the job; what the job wants sent is
queued here and drained by the stream's writer. The queue is bounded in
bytes (architecture invariant 5): a worker that stops reading is ended with
RESOURCE_EXHAUSTED instead of growing the coordinator's memory. Ending a
stream is queued too, so it happens after what was queued before, and an
error end is announced by a `StreamEnd` carrying the reason.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from gradsync.protocol.codes import Code
from gradsync.server.job import Job
from gradsync.v1 import gradsync_pb2 as pb

log = logging.getLogger("gradsync.server")

#: How long a stream that ends waits for a write in flight before cancelling it.
WRITER_STOP_S = 1.0


def _default_reason(code: Code) -> pb.EndReason:
    """The EndReason of an end whose cause is its status code alone."""
    if code is Code.RESOURCE_EXHAUSTED:
        return pb.END_REASON_RESOURCE_EXHAUSTED
    return pb.END_REASON_UNSPECIFIED


@dataclass(frozen=True)
class End:
    """Outbox sentinel: end the stream with this status after prior writes."""

    code: Code
    details: str


class Connection:
    """One worker's stream: identity once joined, and its bounded outbox."""

    def __init__(self, peer: str, max_outbox_bytes: int) -> None:
        self.peer = peer
        self.job: Job | None = None
        self.rank = -1
        self.left = False
        self.outbox: asyncio.Queue[bytes | End] = asyncio.Queue()
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
                pb.END_REASON_RESOURCE_EXHAUSTED,
            )
            return
        self.outbox_bytes += len(raw)
        self.outbox.put_nowait(raw)

    def end(self, code: Code, details: str, reason: pb.EndReason | None = None) -> None:
        """End the stream after what is queued; an error is announced by a StreamEnd first.

        `reason` defaults to the one the code implies (see `_default_reason`).
        The StreamEnd bypasses the outbox limit: it is small and must arrive.
        """
        if self.ended:
            return
        self.ended = True
        if code is not Code.OK:
            stream_end = pb.StreamEnd(
                reason=_default_reason(code) if reason is None else reason,
                code=int(code),
                message=details,
            )
            raw = pb.CoordinatorMessage(stream_end=stream_end).SerializeToString()
            self.outbox_bytes += len(raw)
            self.outbox.put_nowait(raw)
        self.outbox.put_nowait(End(code, details))

    async def drain(self, context: Any, ended: asyncio.Future[End]) -> None:
        """Write the outbox to the stream until an `End` comes out; resolve `ended` with it.

        `context` is the call's `grpc.aio.ServicerContext` (typed loosely so this
        module stays free of gRPC). A write that fails means the worker went away:
        `ended` then resolves to UNAVAILABLE.
        """
        try:
            while True:
                item = await self.outbox.get()
                if isinstance(item, End):
                    ended.set_result(item)
                    return
                await context.write(item)
                self.outbox_bytes -= len(item)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the worker went away while we wrote
            log.info("writing to %s (rank %s) failed: %s", self.peer, self.rank, exc)
            if not ended.done():
                ended.set_result(End(Code.UNAVAILABLE, f"write failed: {exc}"))

    async def serve(
        self,
        reading: Awaitable[None],
        context: Any,
        flush_s: float,
        detach: Callable[[], None],
    ) -> End | None:
        """Run one stream: `reading` consumes the requests while the outbox is written.

        Returns once the reader finishes or the stream is ended (after flushing what
        was queued, for at most `flush_s`), with the `End` it ended with (None when
        the reader finished first). `detach` forgets the connection, before both
        tasks are reaped so that none is reported pending at exit.
        """
        ended: asyncio.Future[End] = asyncio.get_running_loop().create_future()
        reader = asyncio.ensure_future(reading)
        writer = asyncio.create_task(self.drain(context, ended))
        try:
            pending: list[asyncio.Future[Any]] = [reader, ended]
            await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            if not ended.done() and self.ended:
                # The stream is to end (goodbye or refusal): flush what is queued first.
                await asyncio.wait({ended}, timeout=flush_s)
        finally:
            reader.cancel()
            if not writer.done():
                # Let a write in flight finish rather than cancel it half-way: that
                # leaves an operation pending in gRPC's core, which then logs an
                # ExecuteBatchError ("too many operations") when the handler returns.
                # A peer that is gone makes the write fail at once.
                self.outbox.put_nowait(End(Code.OK, ""))
                await asyncio.wait({writer}, timeout=WRITER_STOP_S)
            writer.cancel()
            detach()
            await asyncio.gather(reader, writer, return_exceptions=True)
        return ended.result() if ended.done() and not ended.cancelled() else None
