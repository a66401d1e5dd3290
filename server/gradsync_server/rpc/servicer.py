"""The gRPC face of a coordinator process, leader or shard: one stream handler for workers.

Every worker stream a coordinator serves (a leader's `Coordinator.Sync` and a
shard's `Shard.Data`, each over gRPC or the frame port) runs the same handler: a reader
parses bytes and hands them on, a writer drains the stream's bounded outbox
(`connection`). The stream is admitted by its first message, a worker's
`Join` at the leader or a `ShardHello` at a shard, and from then on its
gradient chunks are parsed without copying their payload (the hot path) and
fed to the job's `JobPlane`. This module owns what every role shares: the
stream guard (`--max-connections`, INTERNAL for bugs), admission by the first
message, chunk decoding, the byte budgets, the gradient counters and how a
stream ends. A role (`leader_role`, `shard_role`) adds what it alone does:
the leader runs the control plane (membership, sessions, checkpoints,
liveness, the shards' links), a shard follows its leader's control events
(`shard_link`). Everything runs on one asyncio loop, so job state needs no
locks.

Every stream ended with an error status first gets a `StreamEnd` message
carrying the same code and message plus an `EndReason`, because the status
code alone cannot tell "declared dead" from "coordinator going away";
UNAVAILABLE is used only for the latter.

Requests and responses are registered as raw bytes (no automatic
(de)serialization): that lets garbage bytes become a clear INVALID_ARGUMENT
for the sender instead of an opaque INTERNAL, and lets one averaged chunk be
serialized once and written to every rank.
"""

from __future__ import annotations

import asyncio
import logging
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, ClassVar, TypeVar

import grpc
from google.protobuf.message import DecodeError
from gradsync_proto.codec import ChunkHeader, decode_gradient
from gradsync_proto.codes import Code
from gradsync_proto.v1 import gradsync_pb2 as pb

from gradsync_server.config import CoordinatorConfig
from gradsync_server.dataplane.budget import ByteBudget
from gradsync_server.errors import RejectedMessage
from gradsync_server.metrics import CoordinatorMetrics
from gradsync_server.rpc.connection import Connection, internal_details

log = logging.getLogger("gradsync.server")

#: The leader's service: workers' Sync streams, Status, FramePort, shards' ShardLink.
SERVICE_NAME = "gradsync.v1.Coordinator"
#: A shard's service: workers' Data streams for its byte range.
SHARD_SERVICE_NAME = "gradsync.v1.Shard"
#: gRPC's status codes by their numbers (a `Code`, a `StreamEnd.code`).
STATUS_BY_CODE = {status.value[0]: status for status in grpc.StatusCode}
#: After the drain grace, how long streams ended for shutdown get to flush their last messages.
SHUTDOWN_FLUSH_S = 1.0

T = TypeVar("T")
Handler = Callable[[Any, grpc.aio.ServicerContext], Awaitable[T]]


class StreamCount:
    """Open streams of one server process against a cap (`limit`)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.active = 0


def guarded(name: str, handler: Handler[T], streams: StreamCount | None = None) -> Handler[T]:
    """The outermost layer of every RPC handler: `handler`, counted against `streams` (if
    given) and with INTERNAL for its bugs. `name` names the RPC in the details ("Sync", ...).

    Streams of every kind (worker Sync streams, shard data streams, shard control links)
    count against one cap, `--max-connections`: one beyond it is refused with
    RESOURCE_EXHAUSTED before any state is touched, so a flood of idle connections cannot
    exhaust the process. An unexpected exception escaping a handler is a bug: it is logged
    with its traceback and the peer gets INTERNAL "internal error in <handler>: <type>:
    <message>", never a stream that ends OK with no message (what gRPC does when a stream
    handler raises after its code was left unset).
    """

    async def run(request: Any, context: grpc.aio.ServicerContext) -> T:
        if streams is not None and streams.active >= streams.limit:
            details = (
                f"the coordinator already serves {streams.active} streams (limit "
                f"{streams.limit}, --max-connections); {name} from {context.peer()} refused"
            )
            log.warning("%s", details)
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, details)
        if streams is not None:
            streams.active += 1
        try:
            return await handler(request, context)
        except (asyncio.CancelledError, grpc.aio.AbortError):
            raise
        except DecodeError as exc:
            # The peer's bytes did not parse (gRPC's deserializer for ShardLink, the
            # handler's own parse of a raw unary request): their fault.
            details = f"{name} from {context.peer()}: a message does not parse: {exc}"
            log.warning("%s", details)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, details)
            raise  # not reached: abort raises
        except Exception as exc:
            log.error("internal error in %s serving %s", name, context.peer(), exc_info=True)
            await context.abort(grpc.StatusCode.INTERNAL, internal_details(name, exc))
            raise  # not reached: abort raises
        finally:
            if streams is not None:
                streams.active -= 1

    return run


class CoordinatorServicer(ABC):
    """The worker streams and jobs of one coordinator process, in one role.

    A role subclass names its service and stream method, and says how a
    stream is admitted (`_admit`), what an admitted stream's chunks and other
    messages do (`_gradient`, `_message`), how a malformed message is
    answered (`_unparsable`, `_reject`) and what a stream's end leaves
    behind (`_detach`).

    Args:
        config: the process's configuration.
        budget: the gradient bytes partial reductions may hold (--max-buffered-mb).
        clock: monotonic time source.
        metrics: where its metrics go.
        flush_s: how long a stream that is to end gets to flush what is queued for it.
    """

    #: The gRPC service and the stream method that serve workers in this role.
    service: ClassVar[str]
    stream_method: ClassVar[str]

    def __init__(
        self,
        config: CoordinatorConfig,
        budget: ByteBudget,
        clock: Callable[[], float],
        metrics: CoordinatorMetrics,
        flush_s: float,
    ) -> None:
        self.config = config
        self.clock = clock
        self.metrics = metrics
        #: Gradient bytes currently held in partial reductions.
        self.budget = budget
        #: What all outboxes queue together (see `connection`).
        self.outbox_budget = ByteBudget(config.outbox_pool_bytes)
        #: Streams of every kind, against --max-connections (see `guarded`).
        self.stream_count = StreamCount(config.max_connections)
        self.flush_s = flush_s
        #: Streams admitted to a job, by (job id, rank).
        self.connections: dict[tuple[str, int], Connection] = {}
        #: Every open worker stream, admitted or still waiting for its first message.
        self.streams: set[Connection] = set()
        self.draining = False
        self.frame_port = 0  # told to workers (0: none; set by `app.start`)

    def connection_count(self) -> int:
        """Worker streams currently admitted to a job."""
        return len(self.connections)

    def stats(self) -> pb.ShardStats:
        """This process's gradient counters (a shard's sign of life; shard 0 at the leader)."""
        return self.metrics.stats(self.budget.used, self.connection_count())

    async def streams_ended(self, timeout_s: float) -> None:
        """Wait until every worker stream has ended, for at most `timeout_s`."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while self.streams and loop.time() < deadline:
            await asyncio.sleep(0.01)

    def generic_handler(self) -> grpc.GenericRpcHandler:
        """The handler to register on a `grpc.aio.server`: the role's service (raw-bytes
        stream method) and `Coordinator.FramePort`, which workers ask a leader and a shard
        alike for the port that serves their stream as frames (`frame_server`)."""
        methods = {self.stream_method: grpc.stream_stream_rpc_method_handler(self.sync_handler())}
        methods.update(self._other_methods())
        frame_port = grpc.unary_unary_rpc_method_handler(
            guarded("FramePort", self.frame_port_reply),
            response_serializer=pb.FramePortReply.SerializeToString,
        )
        return _Methods(
            {f"/{self.service}/{name}": handler for name, handler in methods.items()}
            | {f"/{SERVICE_NAME}/FramePort": frame_port}
        )

    async def frame_port_reply(self, raw: bytes, context: Any) -> pb.FramePortReply:
        """Where this process serves worker streams as frames (0: nowhere)."""
        return pb.FramePortReply(port=self.frame_port)

    def _other_methods(self) -> dict[str, grpc.RpcMethodHandler]:
        """The role's RPCs beside the worker stream."""
        return {}

    def sync_handler(self) -> Any:
        """The stream handler as gRPC runs it (guarded); the frame port runs it too."""
        return guarded(self.stream_method, self.sync, self.stream_count)

    async def sync(
        self, request_iterator: AsyncIterator[bytes], context: grpc.aio.ServicerContext
    ) -> None:
        """Serve one worker stream until it leaves, fails, or is ended."""
        conn = Connection(context.peer(), self.config.max_outbox_bytes, self.outbox_budget)
        self.streams.add(conn)

        def detach() -> None:
            self.streams.discard(conn)
            self._detach(conn)

        end = await conn.serve(
            request_iterator,
            lambda raw: self._dispatch(conn, raw),
            context,
            self.stream_method,
            self.config.first_message_timeout_s,
            self.flush_s,
            detach,
        )
        if end is not None and end.code is not Code.OK:
            context.set_code(STATUS_BY_CODE[int(end.code)])
            context.set_details(end.details)

    def _dispatch(self, conn: Connection, raw: bytes) -> Awaitable[None] | None:
        """Handle one message; what must wait (a Join, a chunk ahead of the leader's
        view) is returned as an awaitable for the reader to await."""
        try:
            fast = decode_gradient(raw)
            if fast is not None and conn.job_id is not None:
                # The hot path: a gradient chunk, parsed without copying its payload.
                return self._gradient(conn, *fast)
            message = pb.WorkerMessage.FromString(raw)
        except (DecodeError, ValueError) as exc:
            self._reject(conn, self._unparsable(conn, raw, exc))
            return None
        if conn.job_id is None:
            return self._admit(conn, message, len(raw))
        return self._message(conn, message, raw)

    # ------------------------------------------------------ what a role decides
    @abstractmethod
    def _admit(
        self, conn: Connection, message: pb.WorkerMessage, size: int
    ) -> Awaitable[None] | None:
        """Admit the stream by its first message (`size` bytes), or end it."""

    @abstractmethod
    def _gradient(
        self, conn: Connection, chunk: ChunkHeader, payload: memoryview
    ) -> Awaitable[None] | None:
        """Feed a gradient chunk of an admitted stream to its job."""

    @abstractmethod
    def _message(
        self, conn: Connection, message: pb.WorkerMessage, raw: bytes
    ) -> Awaitable[None] | None:
        """Handle an admitted stream's message that is not a fast-path chunk."""

    @abstractmethod
    def _unparsable(self, conn: Connection, raw: bytes, exc: Exception) -> RejectedMessage:
        """The rejection of `raw`, which does not parse (`exc` says why)."""

    @abstractmethod
    def _reject(self, conn: Connection, rejection: RejectedMessage) -> None:
        """A malformed message: abort the sender's open step, or end its stream."""

    def _detach(self, conn: Connection) -> None:
        """The stream ended: forget it (a role adds what that means for its job)."""
        key = (conn.job_id or "", conn.rank)
        if self.connections.get(key) is conn:
            del self.connections[key]


class _Methods(grpc.GenericRpcHandler):  # type: ignore[misc]  # grpc ships no stubs
    """RPC handlers by their full method name ("/gradsync.v1.Shard/Data")."""

    def __init__(self, methods: dict[str, grpc.RpcMethodHandler]) -> None:
        self._methods = methods

    def service(self, details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        return self._methods.get(details.method)
