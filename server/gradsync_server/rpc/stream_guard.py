"""The outermost layer of every coordinator RPC handler: a connection cap and a bug net.

Two things every handler needs and none should write itself:

- `--max-connections`: streams of every kind (worker Sync streams, shard data
  streams, shard control links) count against one cap; one beyond it is
  refused with RESOURCE_EXHAUSTED before any state is touched, so a flood of
  idle connections cannot exhaust the process.
- An unexpected exception escaping a handler is a bug. It is logged with its
  traceback and the peer gets INTERNAL "internal error in <handler>: <type>:
  <message>", never a stream that ends OK with no message (what gRPC does
  when a stream handler raises after its code was left unset).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import grpc
from google.protobuf.message import DecodeError

from gradsync_server.rpc.connection import internal_details

log = logging.getLogger("gradsync.server")

T = TypeVar("T")
Handler = Callable[[Any, grpc.aio.ServicerContext], Awaitable[T]]


class StreamCount:
    """Open streams of one server process against a cap.

    Args:
        limit: the most streams served at once.
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.active = 0


def guarded(name: str, handler: Handler[T], streams: StreamCount | None = None) -> Handler[T]:
    """`handler`, counted against `streams` (if given) and with INTERNAL for its bugs.

    `name` names the RPC in the INTERNAL details ("Sync", "ShardLink", ...).
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
