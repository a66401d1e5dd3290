"""Process-level wiring of the coordinator: server, health, banner, signals.

`start_server` is the injectable seam (binds port 0 in tests and reports the
port); `run` is what `gradsync serve` calls: it serves until SIGTERM/SIGINT,
then drains running streams for the configured grace period and returns 0.
A sharded leader (`--shards`, `--wait-for-shards`) also waits, bounded by
`--shard-wait-timeout`, for every shard to register, and returns 1 naming the
missing ones when they do not; with `--shards` it starts (and stops) the
shards itself (`local_shards`).
"""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
from dataclasses import dataclass

import grpc
from gradsync_proto.host import host_id
from gradsync_proto.net.exposition import MetricsServer, serve_metrics
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from gradsync_server.config import MIB, ServerConfig
from gradsync_server.local_shards import LocalShards
from gradsync_server.metrics import CoordinatorMetrics
from gradsync_server.rpc.auth_check import bind, interceptors, server_credentials
from gradsync_server.rpc.payload_socket import PayloadSocket
from gradsync_server.rpc.servicer import SERVICE_NAME, SHUTDOWN_FLUSH_S, CoordinatorServicer
from gradsync_server.store.stores import open_store, redacted_store_url

log = logging.getLogger("gradsync.server")


@dataclass
class RunningServer:
    """A started coordinator: the gRPC server, its bound port and its state."""

    server: grpc.aio.Server
    port: int
    servicer: CoordinatorServicer
    health: health.aio.HealthServicer
    watchdog: asyncio.Task[None]
    metrics_server: MetricsServer | None = None
    local_shards: LocalShards | None = None
    payload_socket: PayloadSocket | None = None

    async def stop(self, grace_s: float | None = None) -> None:
        """Stop accepting joins, let streams finish for `grace_s`, then close.

        Streams still open after the grace are ended by the servicer with a
        SHUTTING_DOWN StreamEnd (so workers know to reconnect) before the
        server cancels whatever has not flushed by then.
        """
        self.servicer.draining = True
        for service in ("", SERVICE_NAME):
            await self.health.set(service, health_pb2.HealthCheckResponse.NOT_SERVING)
        grace = self.servicer.config.shutdown_grace_s if grace_s is None else grace_s
        # grpc refuses new calls at once and cancels the rest at its deadline;
        # the servicer's own drain ends them in-band just before that.
        stopping = asyncio.create_task(self.server.stop(grace + SHUTDOWN_FLUSH_S))
        await self.servicer.drain(grace)
        # The workers are gone: the shards' control streams would hold the stop.
        self.servicer.shard_control.close_links()
        if self.local_shards is not None:
            await self.local_shards.stop()
        await stopping
        if self.payload_socket is not None:
            self.payload_socket.close()
        self.servicer.segments.close()  # every stream is gone: no descriptor stays open
        self.watchdog.cancel()
        if self.metrics_server is not None:
            self.metrics_server.close()
        self.servicer.checkpointer.close()  # its store threads (a hung call finishes alone)
        if self.servicer.store is not None:
            self.servicer.store.close()


def grpc_options(config: ServerConfig) -> list[tuple[str, int]]:
    """Channel options: explicit message limits and a keepalive policy clients match."""
    return [
        ("grpc.max_receive_message_length", config.max_message_bytes),
        ("grpc.max_send_message_length", config.max_message_bytes),
        # Workers ping every 10 s to spot dead connections; allow it.
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_recv_ping_interval_without_data_ms", 5000),
        ("grpc.http2.max_ping_strikes", 0),
    ]


async def start_server(config: ServerConfig) -> RunningServer:
    """Create, bind and start a coordinator; the returned port is the bound one."""
    store = (
        open_store(
            config.checkpoint_store,
            password=config.redis_password,
            timeout_s=config.store_timeout_s,
        )
        if config.checkpoint_store
        else None
    )
    metrics = CoordinatorMetrics()
    servicer = CoordinatorServicer(config, store, metrics=metrics)
    credentials = server_credentials(config.tls_cert, config.tls_key, config.tls_client_ca)
    metrics_server = (
        serve_metrics(
            config.metrics_port, metrics.registry, host=config.metrics_host or config.host
        )
        if config.metrics_port is not None
        else None
    )
    # The token check runs before every handler, the health service's included.
    server = grpc.aio.server(options=grpc_options(config), interceptors=interceptors(config.token))
    server.add_generic_rpc_handlers((servicer.generic_handler(),))
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    address = f"{config.host}:{config.port}"
    port = bind(server, address, credentials)
    if port == 0:
        raise OSError(f"could not bind the coordinator to {address}")
    await server.start()
    payload_socket = None
    if config.payload_socket and config.shard_count == 1:
        # Same-host local leaders may move payloads through their segments (`segments`).
        payload_socket = PayloadSocket(asyncio.get_running_loop(), servicer.admit_segment)
        servicer.payload_endpoint = (payload_socket.name, config.host_id or host_id())
    for service in ("", SERVICE_NAME):
        await health_servicer.set(service, health_pb2.HealthCheckResponse.SERVING)
    watchdog = asyncio.create_task(servicer.watchdog.run())
    running = RunningServer(
        server, port, servicer, health_servicer, watchdog, metrics_server, None, payload_socket
    )
    if config.local_shards and config.shard_count > 1:
        running.local_shards = LocalShards(config, port)
        await running.local_shards.start()
    return running


async def wait_for_shards(running: RunningServer, timeout_s: float) -> bool:
    """Wait until every shard has registered; False (logged, naming them) after `timeout_s`."""
    control = running.servicer.shard_control
    try:
        await asyncio.wait_for(control.complete.wait(), timeout=timeout_s)
    except TimeoutError:
        log.error(
            "gave up after --shard-wait-timeout %gs: %s",
            timeout_s,
            control.registry.describe_missing(),
        )
        return False
    return True


def security_words(tls: bool, client_ca: bool, token: bool) -> str:
    """How callers are checked, for banners ("TLS + client certificates + token")."""
    parts = (["TLS"] if tls else []) + (["client certificates"] if client_ca else [])
    parts += ["token"] if token else []
    return " + ".join(parts) if parts else "plaintext, no authentication"


def banner(config: ServerConfig, port: int, metrics_url: str | None = None) -> str:
    """The startup line; `gradsync demo` and tests parse 'listening on HOST:PORT'.

    It says how callers are checked, never the token itself.
    """
    security = security_words(
        config.tls_cert is not None, config.tls_client_ca is not None, config.token is not None
    )
    return (
        f"gradsync coordinator listening on {config.host}:{port} "
        f"(world size {config.world_size}, chunk {config.chunk_bytes / MIB:g} MiB, "
        f"max message {config.max_message_bytes} bytes, "
        f"max buffered {config.max_buffered_bytes / MIB:g} MiB, max jobs {config.max_jobs}, "
        f"heartbeat timeout {config.heartbeat_timeout_s:g}s, "
        f"checkpoints {redacted_store_url(config.checkpoint_store or 'off')}, "
        f"metrics {metrics_url or 'off'}"
        + (
            f", shards {config.shard_count} ({config.shards_flag})"
            if config.shard_count > 1
            else ""
        )
        + f", security: {security})"
    )


async def serve(config: ServerConfig) -> int:
    """Serve until SIGTERM or SIGINT, then drain and return the exit code 0.

    A sharded leader returns 1 instead when its shards have not all registered
    within `shard_wait_timeout_s`.
    """
    running = await start_server(config)
    metrics_url = running.metrics_server.url if running.metrics_server else None
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    # The banner says the server is up: signals must be handled from then on.
    print(banner(config, running.port, metrics_url), file=sys.stderr, flush=True)
    if config.shard_count > 1:
        waiting = asyncio.create_task(wait_for_shards(running, config.shard_wait_timeout_s))
        stopped = asyncio.create_task(stop.wait())
        await asyncio.wait({waiting, stopped}, return_when=asyncio.FIRST_COMPLETED)
        stopped.cancel()
        if waiting.done() and not waiting.result():
            await running.stop(0)
            return 1
        waiting.cancel()
    await stop.wait()
    jobs = len(running.servicer.jobs)
    log.info("shutting down: draining %d job(s) for up to %gs", jobs, config.shutdown_grace_s)
    await running.stop()
    log.info("coordinator stopped")
    return 0


def run(config: ServerConfig) -> int:
    """Blocking entry point for `gradsync serve`."""
    code = asyncio.run(serve(config))
    # The loop restored the default handlers on close; a repeated SIGTERM from
    # an impatient supervisor must not turn a clean drain into exit code -15.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    return code
