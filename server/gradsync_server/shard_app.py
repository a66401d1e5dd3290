"""Process-level wiring of a coordinator shard: server, control link, banner, signals.

`start_shard` is the injectable seam (binds port 0 in tests and reports the
port, with a `stop` to end it); `run` is what `gradsync shard` calls: it
serves until SIGTERM/SIGINT (exit 0) or until the leader refuses the shard
(exit 2, with the leader's message naming the flag and both values).
"""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
from dataclasses import dataclass

import grpc
from gradsync_proto.codes import Code
from gradsync_proto.defaults import MIB
from gradsync_proto.net.exposition import MetricsServer, serve_metrics
from gradsync_proto.v1 import gradsync_pb2 as pb
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from gradsync_server.app import security_words
from gradsync_server.rpc.auth_check import bind, interceptors, server_credentials
from gradsync_server.rpc.shard_link import LeaderLink
from gradsync_server.rpc.shard_servicer import SERVICE_NAME, ShardServicer
from gradsync_server.shard_config import ShardConfig
from gradsync_server.shard_metrics import ShardMetrics

log = logging.getLogger("gradsync.shard")

#: Exit status of a shard its leader refused (a flag must change, as for a bad flag).
EXIT_REFUSED = 2
#: How long data streams get to flush their last message when the shard stops.
_STOP_FLUSH_S = 1.0
#: Bound on the wait for the leader link to end when the shard stops.
LINK_STOP_TIMEOUT_S = 10.0


@dataclass
class RunningShard:
    """A started shard: its gRPC server, bound port, state and control link.

    Attributes:
        port: the bound port.
        advertise: the address it registers with.
        servicer: its jobs and data streams.
        link: its control link (`link.registered` is set while the leader accepts it).
        link_task: the task following the leader; its result is the leader's
            refusal message (it runs until the shard stops otherwise).
    """

    server: grpc.aio.Server
    port: int
    advertise: str
    servicer: ShardServicer
    link: LeaderLink
    link_task: asyncio.Task[str]
    health: health.aio.HealthServicer
    metrics_server: MetricsServer | None = None

    async def wait_registered(self, timeout_s: float) -> None:
        """Wait until the leader has accepted this shard.

        Raises:
            TimeoutError: not within `timeout_s`.
            RuntimeError: the leader refused the shard (its message).
        """
        registered = asyncio.create_task(self.link.registered.wait())
        try:
            await asyncio.wait(
                {registered, self.link_task}, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED
            )
        finally:
            registered.cancel()
        if self.link_task.done():
            raise RuntimeError(self.link_task.result())
        if not self.link.registered.is_set():
            raise TimeoutError(f"the shard was not registered within {timeout_s:g}s")

    async def stop(self) -> None:
        """End every data stream (UNAVAILABLE, SHARD_LOST), leave the leader, close."""
        servicer = self.servicer
        servicer.draining = True
        for service in ("", SERVICE_NAME):
            await self.health.set(service, health_pb2.HealthCheckResponse.NOT_SERVING)
        servicer.end_all(
            Code.UNAVAILABLE, f"{servicer.name} is shutting down", pb.END_REASON_SHARD_LOST
        )
        self.link_task.cancel()
        # Bounded: stopping must not hang on the leader link (it cancels its own call).
        await asyncio.wait({self.link_task}, timeout=LINK_STOP_TIMEOUT_S)
        await self.server.stop(_STOP_FLUSH_S)
        if self.metrics_server is not None:
            self.metrics_server.close()


def _grpc_options(config: ShardConfig) -> list[tuple[str, int]]:
    """Message limits and the keepalive policy workers use (as the leader's)."""
    return [
        ("grpc.max_receive_message_length", config.max_message_bytes),
        ("grpc.max_send_message_length", config.max_message_bytes),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_recv_ping_interval_without_data_ms", 5000),
        ("grpc.http2.max_ping_strikes", 0),
    ]


async def start_shard(config: ShardConfig, metrics: ShardMetrics | None = None) -> RunningShard:
    """Bind, start serving `Shard.Data`, and start registering with the leader.

    Returns once the port is bound; registration goes on in the background
    (see `RunningShard.wait_registered`).

    Raises:
        OSError: the address cannot be bound.
    """
    metrics = metrics or ShardMetrics()
    credentials = server_credentials(config.tls_cert, config.tls_key, config.tls_client_ca)
    # Workers' data streams present the same token as their Sync stream to the leader.
    server = grpc.aio.server(options=_grpc_options(config), interceptors=interceptors(config.token))
    address = f"{config.host}:{config.port}"
    port = bind(server, address, credentials)
    if port == 0:
        raise OSError(f"could not bind the shard to {address}")
    advertise = config.advertised(port)
    servicer = ShardServicer(config, advertise, metrics=metrics)
    server.add_generic_rpc_handlers((servicer.generic_handler(),))
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    metrics_server = (
        serve_metrics(
            config.metrics_port, metrics.registry, host=config.metrics_host or config.host
        )
        if config.metrics_port is not None
        else None
    )
    await server.start()
    for service in ("", SERVICE_NAME):
        await health_servicer.set(service, health_pb2.HealthCheckResponse.SERVING)
    link = LeaderLink(servicer)
    link_task = asyncio.create_task(link.run())
    return RunningShard(
        server, port, advertise, servicer, link, link_task, health_servicer, metrics_server
    )


def banner(config: ShardConfig, port: int, advertise: str, metrics_url: str | None) -> str:
    """The startup line; `gradsync_proto.net.launch.parse_banner` reads 'listening on HOST:PORT'."""
    chunk = f"{config.chunk_bytes / MIB:g} MiB" if config.chunk_bytes else "the leader's"
    security = security_words(
        config.tls_cert is not None, config.tls_client_ca is not None, config.token is not None
    )
    return (
        f"gradsync shard listening on {config.host}:{port} (advertised as {advertise}, "
        f"leader {config.leader}{' over TLS' if config.tls_ca else ''}, chunk {chunk}, "
        f"max message {config.max_message_bytes} bytes, "
        f"max buffered {config.max_buffered_bytes / MIB:g} MiB, metrics {metrics_url or 'off'}, "
        f"security: {security})"
    )


async def serve(config: ShardConfig) -> int:
    """Serve until SIGTERM/SIGINT (0) or until the leader refuses the shard (2)."""
    running = await start_shard(config)
    metrics_url = running.metrics_server.url if running.metrics_server else None
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    # The banner says the server is up: signals must be handled from then on.
    print(banner(config, running.port, running.advertise, metrics_url), file=sys.stderr, flush=True)
    stopping = asyncio.create_task(stop.wait())
    await asyncio.wait({stopping, running.link_task}, return_when=asyncio.FIRST_COMPLETED)
    stopping.cancel()
    refusal = None
    if running.link_task.done() and not running.link_task.cancelled():
        refusal = running.link_task.result()
    await running.stop()
    if refusal is not None:
        print(
            f"gradsync shard: the leader {config.leader} refused this shard: {refusal}",
            file=sys.stderr,
            flush=True,
        )
        return EXIT_REFUSED
    log.info("shard stopped")
    return 0


def run(config: ShardConfig) -> int:
    """Blocking entry point for `gradsync shard`."""
    code = asyncio.run(serve(config))
    # As `gradsync serve`: a repeated SIGTERM must not turn a clean stop into -15.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    return code
