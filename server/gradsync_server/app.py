"""Process-level wiring of a coordinator process, leader or shard: server, health,
banner, signals.

One runtime with two roles. The leader (`gradsync serve`) holds the control
plane and byte range 0; a shard (`gradsync shard --leader HOST:PORT`) holds
range i and follows its leader's control events. Both listen the same way
(message limits, keepalive policy, token check, TLS, health, /metrics) and
stop the same way (SIGTERM/SIGINT).

`start` is the injectable seam (it binds port 0 in tests and reports the
port) and `Running` what it started; `run` is what the CLI calls. The
leader serves until a signal, then drains running streams for the configured
grace period and returns 0. A sharded leader (`--shards`,
`--wait-for-shards`) also waits, bounded by `--shard-wait-timeout`, for
every shard to register, and returns 1 naming the missing ones when they do
not; with `--shards` it starts (and stops) the shards itself
(`local_shards`). A shard serves until a signal (0) or until its leader
refuses it (2, with the leader's message naming the flag and both values).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import secrets
import signal
import sys
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import grpc
from gradsync_proto.codes import Code
from gradsync_proto.host import host_id
from gradsync_proto.net.exposition import MetricsServer, serve_metrics
from gradsync_proto.v1 import gradsync_pb2 as pb
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from gradsync_server.config import MIB, CoordinatorConfig, Role
from gradsync_server.local_shards import LocalShards, watch_parent
from gradsync_server.metrics import CoordinatorMetrics
from gradsync_server.rpc.auth_check import RefusalLog, bind, interceptors, server_credentials
from gradsync_server.rpc.frame_server import FrameServer, start_frame_server
from gradsync_server.rpc.leader_role import LeaderRole
from gradsync_server.rpc.outer_records import configured_store
from gradsync_server.rpc.payload_socket import PayloadSocket
from gradsync_server.rpc.servicer import SERVICE_NAME, SHARD_SERVICE_NAME, SHUTDOWN_FLUSH_S
from gradsync_server.rpc.shard_link import LeaderLink
from gradsync_server.rpc.shard_role import ShardRole
from gradsync_server.rpc.standby_gate import ServicerSwitch, StandbyGate
from gradsync_server.store.checkpoint_redis import RedisCheckpointStore
from gradsync_server.store.stores import redacted_store_url

log = logging.getLogger("gradsync.server")

#: Exit status of a shard its leader refused (a flag must change, as for a bad flag).
EXIT_REFUSED = 2
#: How long a shard's data streams get to flush their last message when it stops.
_SHARD_STOP_FLUSH_S = 1.0
#: Bound on the wait for a shard's leader link to end when the shard stops.
LINK_STOP_TIMEOUT_S = 10.0


#: The servicer of the role: a leader's `LeaderRole` or a shard's `ShardRole`.
S = TypeVar("S", LeaderRole, ShardRole)


@dataclass
class Running(Generic[S]):
    """A started coordinator process: its gRPC server, bound port, servicer and what runs
    beside them.

    Attributes:
        advertise: the address workers are told (a shard registers with it).
        watchdog: a leader's watch of its jobs (None on a shard).
        local_shards: a leader's `--shards` children (None: none, or not started yet).
        payload_socket: a same-host leader's payload path (None: off).
        frames: workers' Sync streams as frames (None: off, a shard, or a leased leader).
        gate: the standby gate of a `--lease` leader (None: always serving).
        switch: where a `--lease` leader's calls go: a demoted one swaps in a fresh servicer.
        link: a shard's control link (`link.registered` is set while the leader accepts it).
        link_task: the task following a shard's leader; its result is the leader's refusal
            message (it runs until the shard stops otherwise).
        refusals: the rate-limited log of refused callers, shared by both ports.
    """

    config: CoordinatorConfig
    server: grpc.aio.Server
    port: int
    servicer: S
    health: health.aio.HealthServicer
    metrics_server: MetricsServer | None
    advertise: str
    watchdog: asyncio.Task[None] | None = None
    local_shards: LocalShards | None = None
    payload_socket: PayloadSocket | None = None
    frames: FrameServer | None = None
    gate: StandbyGate | None = None
    switch: ServicerSwitch | None = None
    link: LeaderLink | None = None
    link_task: asyncio.Task[str] | None = None
    refusals: RefusalLog | None = None

    async def wait_registered(self, timeout_s: float) -> None:
        """Wait until the leader has accepted this shard.

        Raises:
            TimeoutError: not within `timeout_s`.
            RuntimeError: the leader refused the shard (its message).
        """
        if self.link is None or self.link_task is None:
            raise RuntimeError("only a shard registers with a leader")
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

    async def stop(self, grace_s: float | None = None) -> None:
        """Stop serving and close.

        A leader stops accepting joins and lets streams finish for `grace_s` (None: the
        configured grace); streams still open after it are ended by the servicer with a
        SHUTTING_DOWN StreamEnd (so workers know to reconnect) before the server cancels
        whatever has not flushed by then. A shard ends every data stream (UNAVAILABLE,
        SHARD_LOST) and leaves its leader.
        """
        servicer = self.servicer
        servicer.draining = True
        await _set_health(self.health, self.config, serving=False)
        if isinstance(servicer, ShardRole):
            servicer.end_all(
                Code.UNAVAILABLE, f"{servicer.name} is shutting down", pb.END_REASON_SHARD_LOST
            )
            if self.link_task is not None:
                self.link_task.cancel()
                # Bounded: stopping must not hang on the leader link (it cancels its own call).
                await asyncio.wait({self.link_task}, timeout=LINK_STOP_TIMEOUT_S)
            if self.frames is not None:  # (gRPC's streams flush in its stop)
                await servicer.streams_ended(_SHARD_STOP_FLUSH_S)
                await self.frames.stop()
            await self.server.stop(_SHARD_STOP_FLUSH_S)
            servicer.outer_states.close()
        else:
            grace = servicer.config.shutdown_grace_s if grace_s is None else grace_s
            # grpc refuses new calls at once and cancels the rest at its deadline;
            # the servicer's own drain ends them in-band just before that.
            stopping = asyncio.create_task(self.server.stop(grace + SHUTDOWN_FLUSH_S))
            await servicer.drain(grace)
            # The workers are gone: the shards' control streams would hold the stop.
            servicer.shard_control.close_links()
            if self.local_shards is not None:
                await self.local_shards.stop()
            await stopping
            if self.frames is not None:
                await self.frames.stop()
            if self.payload_socket is not None:
                self.payload_socket.close()
            servicer.segments.close()  # every stream is gone: no descriptor stays open
            if self.watchdog is not None:
                self.watchdog.cancel()
            servicer.checkpointer.close()  # its store threads (a hung call finishes alone)
            if servicer.checkpointer.store is not None:
                servicer.checkpointer.store.close()
        if self.metrics_server is not None:
            self.metrics_server.close()


def grpc_options(config: CoordinatorConfig) -> list[tuple[str, int]]:
    """Server options: explicit message limits, a keepalive policy clients match, and
    bounds on connections before any caller is authenticated.

    gRPC's own handshake deadline (TCP accept to the client's HTTP/2 settings, TLS
    included) is otherwise 120 s: a silent connection gets the first-message deadline,
    as on the frame port. And the number of connections is capped well above what the
    streams' cap (`--max-connections`) needs, so that silent connections cannot take
    every descriptor: over it a new connection is closed at accept.
    """
    return [
        ("grpc.max_receive_message_length", config.max_message_bytes),
        ("grpc.max_send_message_length", config.max_message_bytes),
        # Workers ping every 1 s to spot a frozen coordinator (KEEPALIVE_TIME_MS in
        # gradsync.path.shard_streams); pings are never counted as strikes.
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_recv_ping_interval_without_data_ms", 5000),
        ("grpc.http2.max_ping_strikes", 0),
        ("grpc.server_handshake_timeout_ms", max(1, round(config.first_message_timeout_s * 1000))),
        ("grpc.max_allowed_incoming_connections", 2 * config.max_connections + 64),
    ]


def _listen(
    config: CoordinatorConfig, gate: StandbyGate | None, refusals: RefusalLog
) -> tuple[grpc.aio.Server, int, health.aio.HealthServicer]:
    """A gRPC server bound to the configured address, with the token check and health.

    The token check runs before every handler, the health service's included.

    Raises:
        OSError: the address cannot be bound.
    """
    credentials = server_credentials(config.tls_cert, config.tls_key, config.tls_client_ca)
    leader = config.role is Role.LEADER
    server = grpc.aio.server(
        options=grpc_options(config),
        # A shard's own shard token is what it presents to its leader, not what it checks.
        # The token check first: an unauthenticated caller learns nothing, not even the
        # active coordinator's address from a standby's refusal.
        interceptors=[
            *interceptors(config.token, config.shard_token if leader else None, refusals),
            *([gate] if gate is not None else []),
        ],
    )
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    address = f"{config.host}:{config.port}"
    port = bind(server, address, credentials)
    if port == 0:
        raise OSError(f"could not bind the {'coordinator' if leader else 'shard'} to {address}")
    return server, port, health_servicer


async def _set_health(
    health_servicer: health.aio.HealthServicer, config: CoordinatorConfig, serving: bool
) -> None:
    status = health_pb2.HealthCheckResponse
    service = SERVICE_NAME if config.role is Role.LEADER else SHARD_SERVICE_NAME
    for name in ("", service):
        await health_servicer.set(name, status.SERVING if serving else status.NOT_SERVING)


async def start(
    config: CoordinatorConfig, metrics: CoordinatorMetrics | None = None
) -> Running[Any]:
    """Create, bind and start a coordinator process; the returned port is the bound one.

    A shard returns once its port is bound; registering with its leader goes on in the
    background (see `Running.wait_registered`). Workers' data streams to a shard present
    the same token as their Sync stream to the leader.

    Raises:
        OSError: the address cannot be bound.
    """
    leader = config.role is Role.LEADER
    if leader and config.local_shards and config.shard_count > 1 and config.shard_token is None:
        # Its own children need a shard credential the workers never see: make one.
        config = dataclasses.replace(config, shard_token=secrets.token_urlsafe(32))
    metrics = metrics or CoordinatorMetrics(shard=not leader)
    gate = StandbyGate() if config.lease else None
    refusals = RefusalLog()
    server, port, health_servicer = _listen(config, gate, refusals)
    advertise = config.advertised(port)
    servicer: LeaderRole | ShardRole
    switch = None
    if leader:
        servicer = LeaderRole(config, configured_store(config), metrics=metrics)
        switch = ServicerSwitch(servicer) if gate is not None else None
    else:
        servicer = ShardRole(config, advertise, metrics=metrics)
    server.add_generic_rpc_handlers((switch or servicer.generic_handler(),))
    metrics_server = None
    if config.metrics_port is not None:
        host = config.metrics_host or config.host
        metrics_server = serve_metrics(config.metrics_port, metrics.registry, host=host)
    await server.start()
    running: Running[Any] = Running(
        config, server, port, servicer, health_servicer, metrics_server, advertise
    )
    running.gate, running.switch, running.refusals = gate, switch, refusals
    if isinstance(servicer, ShardRole):
        running.link = LeaderLink(servicer)
        running.link_task = asyncio.create_task(running.link.run())
    elif config.payload_socket and config.shard_count == 1:
        # Same-host local leaders may move payloads through their segments (`segments`).
        admit = (switch or servicer).admit_segment
        running.payload_socket = PayloadSocket(asyncio.get_running_loop(), admit)
        servicer.payload_endpoint = (running.payload_socket.name, config.host_id or host_id())
    # A leased coordinator says SERVING only once it holds the lease (`serve`).
    await _set_health(health_servicer, config, serving=gate is None)
    if isinstance(servicer, LeaderRole):
        running.watchdog = asyncio.create_task(servicer.watchdog.run())
    if gate is None and config.frame_port is not None:
        running.frames = await start_frame_server(config, servicer, refusals)
    if gate is None and leader and config.local_shards and config.shard_count > 1:
        running.local_shards = LocalShards(config, port)
        await running.local_shards.start()
    return running


async def wait_for_shards(running: Running[LeaderRole], timeout_s: float) -> bool:
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


def banner(running: Running[Any]) -> str:
    """The startup line; `gradsync demo`, tests and `gradsync_proto.net.launch.parse_banner`
    read 'listening on HOST:PORT'.

    It says how callers are checked, never the token itself.
    """
    config = running.config
    metrics_url = running.metrics_server.url if running.metrics_server else None
    # How callers are checked ("TLS + client certificates + token"), never the token.
    checks = {"TLS": config.tls_cert, "client certificates": config.tls_client_ca}
    checks["token"] = config.token
    parts = [what for what, value in checks.items() if value is not None]
    security = " + ".join(parts) if parts else "plaintext, no authentication"
    limits = (
        f"max message {config.max_message_bytes} bytes, "
        f"max buffered {config.max_buffered_bytes / MIB:g} MiB"
    )
    if config.role is Role.SHARD:
        chunk = f"{config.chunk_bytes / MIB:g} MiB" if config.chunk_bytes else "the leader's"
        return (
            f"gradsync shard listening on {config.host}:{running.port} (advertised as "
            f"{running.advertise}, leader {config.leader}{' over TLS' if config.tls_ca else ''}, "
            f"chunk {chunk}, {limits}, metrics {metrics_url or 'off'}, security: {security})"
        )
    shards = f", shards {config.shard_count} ({config.shards_flag})"
    return (
        f"gradsync coordinator listening on {config.host}:{running.port} "
        f"(frames on port {running.servicer.frame_port or 'off'}, "
        f"world size {config.world_size}, chunk {config.chunk_bytes / MIB:g} MiB, {limits}, "
        f"max jobs {config.max_jobs}, heartbeat timeout {config.heartbeat_timeout_s:g}s, "
        f"checkpoints {redacted_store_url(config.checkpoint_store or 'off')}, "
        f"metrics {metrics_url or 'off'}{shards if config.shard_count > 1 else ''}, "
        f"security: {security})"
    )


async def serve(config: CoordinatorConfig) -> int:
    """Serve until SIGTERM or SIGINT, then stop and return the exit code 0.

    A sharded leader returns 1 instead when its shards have not all registered within
    `shard_wait_timeout_s`; a shard returns 2 when its leader refuses it, and stops when
    its parent (`parent_pid`) is gone.
    """
    running = await start(config)
    stop = asyncio.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(signum, stop.set)
    # The banner says the server is up: signals must be handled from then on.
    print(banner(running), file=sys.stderr, flush=True)
    if running.gate is not None:
        return await serve_leased(config, running, stop)
    stopping = asyncio.create_task(stop.wait())
    ends: set[asyncio.Task[Any]] = {stopping}
    if running.link_task is not None:
        ends.add(running.link_task)
    if config.parent_pid is not None:  # a leader's local shard: it dies with its leader
        ends.add(asyncio.create_task(watch_parent(config.parent_pid)))
    shards = None
    if config.role is Role.LEADER and config.shard_count > 1:
        shards = asyncio.create_task(wait_for_shards(running, config.shard_wait_timeout_s))
        ends.add(shards)
    done, _ = await asyncio.wait(ends, return_when=asyncio.FIRST_COMPLETED)
    if shards in done and shards.result():  # every shard came: serve until a signal
        done, _ = await asyncio.wait(ends - {shards}, return_when=asyncio.FIRST_COMPLETED)
    for task in ends - {running.link_task}:
        task.cancel()
    if shards in done and not shards.result():
        await running.stop(0)
        return 1
    refusal = None
    if running.link_task is not None and running.link_task.done():
        refusal = None if running.link_task.cancelled() else running.link_task.result()
    if config.role is Role.LEADER:
        jobs = len(running.servicer.jobs)
        log.info("shutting down: draining %d job(s) for up to %gs", jobs, config.shutdown_grace_s)
    await running.stop()
    if refusal is not None:
        print(
            f"gradsync shard: the leader {config.leader} refused this shard: {refusal}",
            file=sys.stderr,
            flush=True,
        )
        return EXIT_REFUSED
    log.info("coordinator stopped" if config.role is Role.LEADER else "shard stopped")
    return 0


async def serve_leased(
    config: CoordinatorConfig, running: Running[LeaderRole], stop: asyncio.Event
) -> int:
    """Serve a `--lease` coordinator until SIGTERM (0, lease released): a standby until it
    holds the lease, active while it does, a standby again once demoted (`standby`)."""
    from gradsync_server.standby import lease_for, take_part  # redis only when leased

    lease, metrics = lease_for(config, running.port, running.servicer.metrics.registry)
    store = running.servicer.checkpointer.store
    if isinstance(store, RedisCheckpointStore):
        store.fence = lease.write_token  # a demoted coordinator's writes are refused in Redis
    return await take_part(config, running, lease, metrics, stop, set_health=_set_health)


def run(config: CoordinatorConfig) -> int:
    """Blocking entry point for `gradsync serve` and `gradsync shard`."""
    code = asyncio.run(serve(config))
    # The loop restored the default handlers on close; a repeated SIGTERM from
    # an impatient supervisor must not turn a clean drain into exit code -15.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    return code
