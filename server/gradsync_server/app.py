"""Process-level wiring of a coordinator process, leader or shard: server, health,
banner, signals.

One runtime with two roles. The leader (`gradsync serve`) holds the control
plane and byte range 0; a shard (`gradsync shard --leader HOST:PORT`) holds
range i and follows its leader's control events. Both listen the same way
(message limits, keepalive policy, token check, TLS, health, /metrics) and
stop the same way (SIGTERM/SIGINT).

`start_server` and `start_shard` are the injectable seams (they bind port 0
in tests and report the port); `run` and `run_shard` are what the CLI calls.
The leader serves until a signal, then drains running streams for the
configured grace period and returns 0. A sharded leader (`--shards`,
`--wait-for-shards`) also waits, bounded by `--shard-wait-timeout`, for every
shard to register, and returns 1 naming the missing ones when they do not;
with `--shards` it starts (and stops) the shards itself (`local_shards`). A
shard serves until a signal (0) or until its leader refuses it (2, with the
leader's message naming the flag and both values).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import secrets
import signal
import sys
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any

import grpc
from gradsync_proto.codes import Code
from gradsync_proto.host import host_id
from gradsync_proto.net.exposition import MetricsServer, serve_metrics
from gradsync_proto.v1 import gradsync_pb2 as pb
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from gradsync_server.config import MIB, ServerConfig
from gradsync_server.local_shards import LocalShards
from gradsync_server.metrics import CoordinatorMetrics
from gradsync_server.parent_watch import watch_parent
from gradsync_server.rpc.auth_check import bind, interceptors, server_credentials
from gradsync_server.rpc.frame_server import FrameServer, start_frame_server
from gradsync_server.rpc.leader_role import LeaderRole
from gradsync_server.rpc.payload_socket import PayloadSocket
from gradsync_server.rpc.servicer import SERVICE_NAME, SHARD_SERVICE_NAME, SHUTDOWN_FLUSH_S
from gradsync_server.rpc.shard_link import LeaderLink
from gradsync_server.rpc.shard_role import ShardRole
from gradsync_server.rpc.standby_gate import ServicerSwitch, StandbyGate
from gradsync_server.shard_config import ShardConfig
from gradsync_server.store.checkpoint_redis import RedisCheckpointStore
from gradsync_server.store.stores import open_store, redacted_store_url

log = logging.getLogger("gradsync.server")

#: Exit status of a shard its leader refused (a flag must change, as for a bad flag).
EXIT_REFUSED = 2
#: How long a shard's data streams get to flush their last message when it stops.
_SHARD_STOP_FLUSH_S = 1.0
#: Bound on the wait for a shard's leader link to end when the shard stops.
LINK_STOP_TIMEOUT_S = 10.0


@dataclass
class RunningServer:
    """A started coordinator: the gRPC server, its bound port and its state."""

    server: grpc.aio.Server
    port: int
    servicer: LeaderRole
    health: health.aio.HealthServicer
    watchdog: asyncio.Task[None]
    metrics_server: MetricsServer | None = None
    local_shards: LocalShards | None = None
    payload_socket: PayloadSocket | None = None
    #: Workers' Sync streams as frames (None: off, or a leased coordinator).
    frames: FrameServer | None = None
    #: The standby gate of a `--lease` coordinator (None: always serving).
    gate: StandbyGate | None = None
    #: Where a `--lease` coordinator's calls go: a demoted one swaps in a fresh servicer.
    switch: ServicerSwitch | None = None

    async def stop(self, grace_s: float | None = None) -> None:
        """Stop accepting joins, let streams finish for `grace_s`, then close.

        Streams still open after the grace are ended by the servicer with a
        SHUTTING_DOWN StreamEnd (so workers know to reconnect) before the
        server cancels whatever has not flushed by then.
        """
        self.servicer.draining = True
        await _set_health(self.health, SERVICE_NAME, serving=False)
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
        if self.frames is not None:
            await self.frames.stop()
        if self.payload_socket is not None:
            self.payload_socket.close()
        self.servicer.segments.close()  # every stream is gone: no descriptor stays open
        self.watchdog.cancel()
        if self.metrics_server is not None:
            self.metrics_server.close()
        self.servicer.checkpointer.close()  # its store threads (a hung call finishes alone)
        if self.servicer.store is not None:
            self.servicer.store.close()


def grpc_options(max_message_bytes: int) -> list[tuple[str, int]]:
    """Channel options: explicit message limits and a keepalive policy clients match."""
    return [
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
        # Workers ping every 1 s to spot a frozen coordinator (KEEPALIVE_TIME_MS in
        # gradsync.path.shard_streams); pings are never counted as strikes.
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_recv_ping_interval_without_data_ms", 5000),
        ("grpc.http2.max_ping_strikes", 0),
    ]


def _listen(
    config: ServerConfig | ShardConfig, what: str, gate: StandbyGate | None = None
) -> tuple[grpc.aio.Server, int, health.aio.HealthServicer]:
    """A gRPC server bound to the configured address, with the token check and health.

    The token check runs before every handler, the health service's included.

    Raises:
        OSError: the address cannot be bound.
    """
    credentials = server_credentials(config.tls_cert, config.tls_key, config.tls_client_ca)
    server = grpc.aio.server(
        options=grpc_options(config.max_message_bytes),
        # A shard's own shard token is what it presents to its leader, not what it checks.
        # The token check first: an unauthenticated caller learns nothing, not even the
        # active coordinator's address from a standby's refusal.
        interceptors=[
            *interceptors(
                config.token, config.shard_token if isinstance(config, ServerConfig) else None
            ),
            *([gate] if gate is not None else []),
        ],
    )
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    address = f"{config.host}:{config.port}"
    port = bind(server, address, credentials)
    if port == 0:
        raise OSError(f"could not bind the {what} to {address}")
    return server, port, health_servicer


async def _set_health(
    health_servicer: health.aio.HealthServicer, service: str, serving: bool
) -> None:
    status = health_pb2.HealthCheckResponse
    for name in ("", service):
        await health_servicer.set(name, status.SERVING if serving else status.NOT_SERVING)


def _metrics_server(
    config: ServerConfig | ShardConfig, metrics: CoordinatorMetrics
) -> MetricsServer | None:
    if config.metrics_port is None:
        return None
    return serve_metrics(
        config.metrics_port, metrics.registry, host=config.metrics_host or config.host
    )


def _stop_on_signals() -> asyncio.Event:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    return stop


def _run(main: Coroutine[Any, Any, int]) -> int:
    code = asyncio.run(main)
    # The loop restored the default handlers on close; a repeated SIGTERM from
    # an impatient supervisor must not turn a clean drain into exit code -15.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    return code


async def start_server(config: ServerConfig) -> RunningServer:
    """Create, bind and start a coordinator; the returned port is the bound one."""
    if config.local_shards and config.shard_count > 1 and config.shard_token is None:
        # Its own children need a shard credential the workers never see: make one.
        config = dataclasses.replace(config, shard_token=secrets.token_urlsafe(32))
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
    servicer = LeaderRole(config, store, metrics=metrics)
    metrics_server = _metrics_server(config, metrics)
    gate = StandbyGate() if config.lease else None
    server, port, health_servicer = _listen(config, "coordinator", gate)
    switch = ServicerSwitch(servicer) if gate is not None else None
    server.add_generic_rpc_handlers((switch or servicer.generic_handler(),))
    await server.start()
    payload_socket = None
    if config.payload_socket and config.shard_count == 1:
        # Same-host local leaders may move payloads through their segments (`segments`).
        admit = (switch or servicer).admit_segment
        payload_socket = PayloadSocket(asyncio.get_running_loop(), admit)
        servicer.payload_endpoint = (payload_socket.name, config.host_id or host_id())
    # A leased coordinator says SERVING only once it holds the lease (`serve`).
    await _set_health(health_servicer, SERVICE_NAME, serving=gate is None)
    watchdog = asyncio.create_task(servicer.watchdog.run())
    running = RunningServer(
        server, port, servicer, health_servicer, watchdog, metrics_server, None, payload_socket
    )
    running.gate, running.switch = gate, switch
    if gate is None and config.frame_port is not None:
        running.frames = await start_frame_server(config, servicer)
    if gate is None and config.local_shards and config.shard_count > 1:
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


def banner(
    config: ServerConfig, port: int, metrics_url: str | None = None, frame_port: int = 0
) -> str:
    """The startup line; `gradsync demo` and tests parse 'listening on HOST:PORT'.

    It says how callers are checked, never the token itself.
    """
    security = security_words(
        config.tls_cert is not None, config.tls_client_ca is not None, config.token is not None
    )
    return (
        f"gradsync coordinator listening on {config.host}:{port} "
        f"(frames on port {frame_port or 'off'}, world size {config.world_size}, "
        f"chunk {config.chunk_bytes / MIB:g} MiB, "
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
    stop = _stop_on_signals()
    # The banner says the server is up: signals must be handled from then on.
    line = banner(config, running.port, metrics_url, running.servicer.frame_port)
    print(line, file=sys.stderr, flush=True)
    if running.gate is not None:
        return await serve_leased(config, running, stop)
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


async def serve_leased(config: ServerConfig, running: RunningServer, stop: asyncio.Event) -> int:
    """Serve a `--lease` coordinator until SIGTERM (0, lease released): a standby until it
    holds the lease, active while it does, a standby again once demoted (`standby`)."""
    from gradsync_server.standby import lease_for, take_part  # redis only when leased

    lease, metrics = lease_for(config, running.port, running.servicer.metrics.registry)
    store = running.servicer.store
    if isinstance(store, RedisCheckpointStore):
        store.fence = lease.write_token  # a demoted coordinator's writes are refused in Redis
    return await take_part(config, running, lease, metrics, stop, set_health=_set_health)


def run(config: ServerConfig) -> int:
    """Blocking entry point for `gradsync serve`."""
    return _run(serve(config))


# --------------------------------------------------------------------- shards
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
    servicer: ShardRole
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
        await _set_health(self.health, SHARD_SERVICE_NAME, serving=False)
        servicer.end_all(
            Code.UNAVAILABLE, f"{servicer.name} is shutting down", pb.END_REASON_SHARD_LOST
        )
        self.link_task.cancel()
        # Bounded: stopping must not hang on the leader link (it cancels its own call).
        await asyncio.wait({self.link_task}, timeout=LINK_STOP_TIMEOUT_S)
        await self.server.stop(_SHARD_STOP_FLUSH_S)
        if self.metrics_server is not None:
            self.metrics_server.close()
        servicer.outer_states.close()


async def start_shard(
    config: ShardConfig, metrics: CoordinatorMetrics | None = None
) -> RunningShard:
    """Bind, start serving `Shard.Data`, and start registering with the leader.

    Returns once the port is bound; registration goes on in the background
    (see `RunningShard.wait_registered`). Workers' data streams present the
    same token as their Sync stream to the leader.

    Raises:
        OSError: the address cannot be bound.
    """
    metrics = metrics or CoordinatorMetrics(shard=True)
    server, port, health_servicer = _listen(config, "shard")
    advertise = config.advertised(port)
    servicer = ShardRole(config, advertise, metrics=metrics)
    server.add_generic_rpc_handlers((servicer.generic_handler(),))
    metrics_server = _metrics_server(config, metrics)
    await server.start()
    await _set_health(health_servicer, SHARD_SERVICE_NAME, serving=True)
    link = LeaderLink(servicer)
    link_task = asyncio.create_task(link.run())
    return RunningShard(
        server, port, advertise, servicer, link, link_task, health_servicer, metrics_server
    )


def shard_banner(config: ShardConfig, port: int, advertise: str, metrics_url: str | None) -> str:
    """A shard's startup line; `gradsync_proto.net.launch.parse_banner` reads 'listening on
    HOST:PORT'."""
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


async def serve_shard(config: ShardConfig) -> int:
    """Serve until SIGTERM/SIGINT (0) or until the leader refuses the shard (2)."""
    running = await start_shard(config)
    metrics_url = running.metrics_server.url if running.metrics_server else None
    stop = _stop_on_signals()
    # The banner says the server is up: signals must be handled from then on.
    banner_line = shard_banner(config, running.port, running.advertise, metrics_url)
    print(banner_line, file=sys.stderr, flush=True)
    stopping = asyncio.create_task(stop.wait())
    waits: set[asyncio.Task[Any]] = {stopping, running.link_task}
    if config.parent_pid is not None:  # a leader's local shard: it dies with its leader
        waits.add(asyncio.create_task(watch_parent(config.parent_pid)))
    await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    for task in waits - {running.link_task}:
        task.cancel()
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


def run_shard(config: ShardConfig) -> int:
    """Blocking entry point for `gradsync shard`."""
    return _run(serve_shard(config))
