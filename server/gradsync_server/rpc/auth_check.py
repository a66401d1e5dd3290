"""Who may talk to a coordinator or shard: TLS credentials, the token check, protected mode.

Shared by `gradsync serve` and `gradsync shard` (both in `app`):

- `server_credentials` turns `--tls-cert/--tls-key` into gRPC server
  credentials; with `--tls-client-ca` the handshake also requires a client
  certificate issued by that CA (mTLS), so a peer without one never reaches
  a handler.
- `TokenCheck` is a server interceptor that runs before every RPC (Sync,
  Status, ShardLink, Shard.Data and the health service alike): the token a
  caller presents in its metadata is compared in constant time
  (`gradsync_proto.auth.token_matches`) and a call without the right one
  is answered UNAUTHENTICATED before the handler runs, so it cannot create a
  job, claim a rank or read anything. Its request bytes are not even parsed.
  `ShardLink` takes the shard token instead of the workers' token: a shard
  learns every member of every job, so a worker must not be able to pose as one.
- `exposure_refusal` is protected mode (as Redis's): with neither a token nor
  client certificates, anyone who reaches the port can train in, read or
  disturb every job, so such a server may listen only on loopback unless the
  operator says `--insecure`.
- `RefusalLog` is the one rate-limited log of refused callers, shared by every port of a
  coordinator process (the token check here and the frame port).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
from gradsync_proto import auth

log = logging.getLogger("gradsync.server")

#: How long a refused stream waits for the caller's first message before its status.
FIRST_MESSAGE_WAIT_S = 2.0

#: At most this many refused streams wait for their first message at once; beyond
#: it a refusal is immediate, so a flood of unauthenticated streams cannot hold
#: handlers (which the connection cap does not count: they never reach it).
MAX_WAITING_REFUSALS = 64

MISSING_TOKEN = (
    "this server requires a token and the call carried none: set {env} or {env_file} "
    "(or pass token= / --token-file) to the token the server was started with"
)
WRONG_TOKEN = (
    "the token presented does not match this server's: check {env} / {env_file} "
    "(or token= / --token-file) on this side against the server's"
)
WRONG_SHARD_TOKEN = (
    "a shard link must present the leader's shard token (not the workers' token): "
    "check {env} / {env_file} or --shard-token-file on this shard against the leader's"
)
NO_SHARD_TOKEN = (
    "this coordinator has no shard token, so it admits no shard: start it with "
    "--shard-token-file FILE (or {env} / {env_file}) and give each shard the same"
)
#: The method only shards call (the leader's control stream to them).
SHARD_LINK_METHOD = "/gradsync.v1.Coordinator/ShardLink"


def server_credentials(
    cert: str | None, key: str | None, client_ca: str | None
) -> grpc.ServerCredentials | None:
    """TLS server credentials from PEM files, or None without `cert` (plaintext).

    Raises:
        TokenError: a file cannot be read or is not PEM (names the flag);
            `key` or `cert` given without the other, or `client_ca` without both.
    """
    if cert is None and key is None:
        if client_ca is not None:
            raise auth.TokenError("--tls-client-ca needs --tls-cert and --tls-key (mTLS is TLS)")
        return None
    if cert is None or key is None:
        raise auth.TokenError("--tls-cert and --tls-key go together: give both or neither")
    pair = (auth.read_pem_file(key, "--tls-key"), auth.read_pem_file(cert, "--tls-cert"))
    roots = auth.read_pem_file(client_ca, "--tls-client-ca") if client_ca else None
    return grpc.ssl_server_credentials(
        [pair], root_certificates=roots, require_client_auth=roots is not None
    )


def bind(server: grpc.aio.Server, address: str, credentials: grpc.ServerCredentials | None) -> int:
    """Add a listening port, with TLS when `credentials` are given; the bound port (0 = failed)."""
    if credentials is None:
        return int(server.add_insecure_port(address))
    return int(server.add_secure_port(address, credentials))


def exposure_refusal(
    command: str, host: str, *, token: bool, client_ca: bool, insecure: bool
) -> str | None:
    """Why `command` must not listen on `host` as configured, or None when it may.

    A server is exposed when it binds anything but loopback. Exposed, it needs
    a way to tell callers apart: a token, or client certificates (mTLS). TLS
    alone encrypts but admits anyone, so it does not count.
    """
    if insecure or token or client_ca or auth.is_loopback(host):
        return None
    return (
        f"gradsync {command}: refusing to listen on --host {host} without authentication: "
        "anyone who can reach this port could join or disturb every job and read its "
        f"weights. Set a token (--token-file FILE, ${auth.ENV_TOKEN_FILE} or "
        f"${auth.ENV_TOKEN}; make one with `gradsync token FILE`), or require client "
        "certificates (--tls-cert, --tls-key, --tls-client-ca), or listen on 127.0.0.1; "
        "--insecure listens anyway, for trusted networks only (see SECURITY.md)."
    )


class TokenCheck(grpc.aio.ServerInterceptor):  # type: ignore[misc]  # grpc ships no stubs
    """Refuse every call that does not present its token (UNAUTHENTICATED), before its handler.

    Args:
        token: the workers' shared secret, required of every call but ShardLink;
            None = those calls are not checked (no token configured).
        shard_token: the shards' secret, required of ShardLink; None = ShardLink is
            refused when `token` is set, and unchecked otherwise.
        refusals: where refused calls are logged, rate-limited (shared with the
            process's other ports; None: a log of its own).
    """

    def __init__(
        self, token: str | None, shard_token: str | None = None, refusals: RefusalLog | None = None
    ) -> None:
        self._token = token
        self._shard_token = shard_token
        self._refusals = refusals or RefusalLog()
        #: Calls refused since start (for tests).
        self.refused = 0
        #: Refused streams now waiting for their first message (bounded).
        self.waiting = 0

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        method = handler_call_details.method
        shard_link = method in (SHARD_LINK_METHOD, SHARD_LINK_METHOD.encode())
        expected = self._shard_token if shard_link else self._token
        if expected is None and (not shard_link or self._token is None):
            return await continuation(handler_call_details)  # nothing to check this call for
        presented = auth.presented_token(handler_call_details.invocation_metadata)
        if expected is not None and auth.token_matches(expected, presented):
            return await continuation(handler_call_details)
        handler = await continuation(handler_call_details)
        if handler is None:  # an unknown method: UNIMPLEMENTED says nothing secret
            return None
        if shard_link:
            template = WRONG_SHARD_TOKEN if expected is not None else NO_SHARD_TOKEN
            env, env_file = auth.ENV_SHARD_TOKEN, auth.ENV_SHARD_TOKEN_FILE
        else:
            template = MISSING_TOKEN if presented is None else WRONG_TOKEN
            env, env_file = auth.ENV_TOKEN, auth.ENV_TOKEN_FILE
        self.refused += 1
        why = "no token" if presented is None else "wrong token"
        self._refusals.note("gRPC", repr(method_name(method)), why)
        return _refusing(handler, template.format(env=env, env_file=env_file), self)


def method_name(method: str | bytes) -> str:
    """A call's full method name as text (gRPC may hand it over as bytes)."""
    return method.decode("utf-8", "replace") if isinstance(method, bytes) else str(method)


def _refusing(
    handler: grpc.RpcMethodHandler, message: str, check: TokenCheck
) -> grpc.RpcMethodHandler:
    """A handler of the same shape as `handler` that only aborts with UNAUTHENTICATED."""

    async def refuse_stream(requests: Any, context: grpc.aio.ServicerContext[Any, Any]) -> None:
        # Wait (bounded) for the caller's first message: a status that overtakes the
        # client's first write makes grpc's client report INTERNAL ("Failed execute_batch")
        # instead of UNAUTHENTICATED, and the caller would not learn why.
        if check.waiting < MAX_WAITING_REFUSALS:
            check.waiting += 1
            try:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(anext(aiter(requests)), FIRST_MESSAGE_WAIT_S)
            finally:
                check.waiting -= 1
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    return refusing(handler, grpc.StatusCode.UNAUTHENTICATED, message, refuse_stream)


def refusing(
    handler: grpc.RpcMethodHandler,
    code: grpc.StatusCode,
    message: str,
    streaming: Callable[..., Any] | None = None,
) -> grpc.RpcMethodHandler:
    """A handler of `handler`'s shape that only aborts with `code` and `message` (`streaming`
    instead for streamed requests). Its requests are left as raw bytes (no deserializer):
    nothing a refused caller sent is parsed."""

    async def unary(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> None:
        await context.abort(code, message)

    streaming = streaming or unary
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(streaming)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(streaming)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(unary)
    return grpc.unary_unary_rpc_method_handler(unary)


def interceptors(
    token: str | None, shard_token: str | None = None, refusals: RefusalLog | None = None
) -> list[grpc.aio.ServerInterceptor]:
    """The server's interceptors: the token check when either token is set."""
    if token is None and shard_token is None:
        return []
    return [TokenCheck(token, shard_token, refusals)]


#: Refusals are logged at most once per this many seconds (with a count).
REFUSAL_LOG_PERIOD_S = 10.0


class RefusalLog:
    """Counts refusals and logs them at most once per `period_s`.

    Whoever can reach a port can make it refuse them as fast as they can connect: a
    wrong token, bytes that are not frames, a TLS handshake that fails or never
    starts, a connection dropped over a cap. Logging each refusal would let an
    unauthenticated flood fill the log disk, so refusals are counted and written at
    most once per `REFUSAL_LOG_PERIOD_S` as one WARNING line: how many, on which
    ports, and the latest one's peer and reason.

    Args:
        period_s: the least time between two lines.
        clock: monotonic seconds (injectable for tests of the rate limit).
    """

    def __init__(
        self, period_s: float = REFUSAL_LOG_PERIOD_S, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._period_s = period_s
        self._clock = clock
        self._last_line = -period_s
        self._since_line: Counter[str] = Counter()
        #: Refusals since start, by port ("gRPC", "frame"), for tests and status.
        self.total: Counter[str] = Counter()
        #: Lines written (for tests of the rate limit).
        self.lines = 0

    def note(self, port: str, peer: str, reason: str) -> None:
        """Count one refusal on `port` of `peer` for `reason`; log if a period has passed."""
        self.total[port] += 1
        self._since_line[port] += 1
        now = self._clock()
        elapsed = now - self._last_line
        if elapsed < self._period_s:
            return
        counts = ", ".join(
            f"{count} on the {name} port" for name, count in self._since_line.items()
        )
        log.warning(
            "refused %d unauthenticated connection(s) or call(s) in the last %.3gs (%s; latest: "
            "%s on the %s port: %s)",
            sum(self._since_line.values()),
            elapsed if self.lines else min(self._period_s, elapsed),
            counts,
            peer,
            port,
            reason,
        )
        self.lines += 1
        self._last_line = now
        self._since_line.clear()
