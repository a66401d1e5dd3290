"""The standby gate: while this coordinator does not hold the lease, it serves nothing.

Every RPC but the health service's is answered UNAVAILABLE, naming the active coordinator's
advertised address and fence, so a worker (or shard) moves on to its next address; nothing
a caller sent is parsed. The servicer behind the gate has seen no request while closed, so
opening it at takeover is a freshly started coordinator on the same store: the first Join
loads the job from the store exactly as after a restart.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, Protocol

import grpc

from gradsync_server.rpc.auth_check import method_name, refusing

_HEALTH_PREFIX = "/grpc.health.v1.Health/"


class StandbyGate(grpc.aio.ServerInterceptor):  # type: ignore[misc]  # grpc ships no stubs
    """Closed (refusing) until `open` is called; `close` refuses new calls again."""

    def __init__(self) -> None:
        self.active = False
        #: What a refused caller is told about the active coordinator.
        self.active_elsewhere = "unknown (no lease holder yet)"
        self.refused = 0

    def open(self) -> None:
        self.active = True

    def close(self, active_elsewhere: str) -> None:
        self.active = False
        self.active_elsewhere = active_elsewhere

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        name = method_name(handler_call_details.method)
        if self.active or name.startswith(_HEALTH_PREFIX):
            return await continuation(handler_call_details)
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        self.refused += 1
        message = (
            f"this coordinator is a standby (does not hold the lease) and serves no {name}; "
            f"the active coordinator is {self.active_elsewhere}"
        )
        return refusing(handler, grpc.StatusCode.UNAVAILABLE, message)


class _Servicer(Protocol):
    def generic_handler(self) -> grpc.GenericRpcHandler: ...

    def admit_segment(self, registration: Any, fd: int) -> str | None: ...


class ServicerSwitch(grpc.GenericRpcHandler):  # type: ignore[misc]  # grpc ships no stubs
    """Routes every call to the current servicer's handlers.

    A gRPC server's handlers cannot be replaced once it runs, yet a demoted coordinator
    must drop the job state of a history the new active one no longer shares: it swaps in
    a fresh servicer here (`standby.stand_down`) and keeps its port, health and gate.
    """

    def __init__(self, servicer: _Servicer) -> None:
        self.switch(servicer)

    def switch(self, servicer: _Servicer) -> None:
        """Calls from now on go to `servicer` (the gate is closed while this happens)."""
        self._servicer = servicer
        self._handler = servicer.generic_handler()

    def admit_segment(self, registration: Any, fd: int) -> str | None:
        """The payload socket's registrations, too, go to the current servicer."""
        return self._servicer.admit_segment(registration, fd)

    def service(
        self, handler_call_details: grpc.HandlerCallDetails
    ) -> grpc.RpcMethodHandler | None:
        return self._handler.service(handler_call_details)
