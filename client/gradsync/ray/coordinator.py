"""The coordinator on Ray: a leader actor and shard actors, named, found from any driver.

`start_coordinator` places the leader (and, with `shards=S`, S-1 shard actors spread over
the cluster's nodes), waits until every shard has registered with the leader, and returns
a `Coordinator`: its address, the token workers need, and `stop()`. Every actor is named
in the "gradsync" namespace, so a second driver gets the same handle with
`get_coordinator(name)`; with `detached=True` the coordinator outlives the driver that
started it, as a service would.

Each actor runs the ordinary coordinator or shard (`gradsync_server.app.start`)
in-process, on a loop of its own (`LoopThread`), so there is no child process to
leak. It listens on its node's address, where other nodes reach it; beyond loopback the
coordinator needs credentials, so unless the caller gives a token, client certificates or
`insecure=True`, a random token is made here and handed to workers through Ray (never on
a command line).
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import threading
import time
from collections.abc import Coroutine, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

import ray
from gradsync_proto import auth
from gradsync_proto.net.channels import ChannelSecurity

from gradsync import defaults
from gradsync.ray.placement import (
    DEFAULT_COORDINATOR_RESOURCES,
    NAMESPACE,
    actor_options,
    host_port,
    leader_actor_name,
    shard_actor_name,
)

log = logging.getLogger("gradsync.ray")

#: Bound on starting one actor's server (its process may first import torch).
START_TIMEOUT_S = 120.0
#: Bound on the wait for every shard to register with the leader.
SHARD_REGISTER_TIMEOUT_S = 60.0
#: Bound on one stop call, beyond the drain's grace.
STOP_TIMEOUT_S = 30.0
#: Bound on the wait until killed actors are gone.
DEATH_TIMEOUT_S = 30.0
#: How long closing an actor's loop waits for its thread to end.
LOOP_CLOSE_TIMEOUT_S = 10.0

#: Options of `start_coordinator` that are the actors' business, not `CoordinatorConfig` fields.
_SET_HERE = frozenset({"port", "shard_count", "local_shards"})


T = TypeVar("T")


def _node_ip() -> str:
    return str(ray.util.get_node_ip_address())  # type: ignore[no-untyped-call]  # untyped in ray


def fetch(refs: Any, timeout_s: float | None = None) -> Any:
    """`ray.get`, typed Any: ray's overloads type a result from an untyped call as a list."""
    return ray.get(refs, timeout=timeout_s)


class LoopThread:
    """A running event loop in a daemon thread, with a blocking `call` into it: an actor's
    server runs on it, since Ray calls the actor's methods on threads of its own."""

    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def call(self, coroutine: Coroutine[Any, Any, T], timeout_s: float) -> T:
        """Run `coroutine` on the loop and wait for its result.

        Raises:
            TimeoutError: it did not finish within `timeout_s` (it is cancelled).
            Exception: whatever the coroutine raised.
        """
        future = asyncio.run_coroutine_threadsafe(coroutine, self.loop)
        try:
            return future.result(timeout=timeout_s)
        except TimeoutError:
            future.cancel()
            raise

    def close(self) -> None:
        """Cancel what still runs on the loop, stop it and join its thread; twice is a no-op."""
        # Not `loop.is_running()`: right after __init__ the thread may not have entered
        # run_forever yet, and returning then would leave the loop running for good.
        if self.loop.is_closed() or not self._thread.is_alive():
            return

        async def cancel_rest() -> None:
            current = asyncio.current_task()
            rest = [task for task in asyncio.all_tasks() if task is not current]
            for task in rest:
                task.cancel()
            await asyncio.gather(*rest, return_exceptions=True)

        try:
            self.call(cancel_rest(), LOOP_CLOSE_TIMEOUT_S)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(LOOP_CLOSE_TIMEOUT_S)
            if not self._thread.is_alive():
                self.loop.close()


class _ServerActor:
    """What the leader's and the shards' actor bodies share: a loop, a server, its info."""

    #: The name of the thread the actor's loop runs in (each actor body names its own).
    thread_name: str

    def __init__(self, log_level: str) -> None:
        form = "%(asctime)s %(levelname)s %(name)s: %(message)s"
        logging.basicConfig(level=log_level, format=form, force=True)
        self._loop = LoopThread(self.thread_name)
        self._running: Any = None
        self._info: dict[str, Any] = {}

    def info(self) -> dict[str, Any]:
        """What `start` returned: the address, process id and node (and the leader's more)."""
        return dict(self._info)


class LeaderServer(_ServerActor):
    """Ray actor body: the coordinator (shard 0), on its node's address."""

    thread_name = "gradsync-coordinator"

    def start(self, options: dict[str, Any], shard_names: list[str]) -> dict[str, Any]:
        """Bind and serve; return the address workers use, and what `info` returns."""
        from gradsync_server.app import banner, start
        from gradsync_server.config import CoordinatorConfig

        node_ip = _node_ip()
        options = dict(options)
        bind_host = options.pop("host", None) or node_ip
        config = CoordinatorConfig(host=bind_host, port=0, local_shards=False, **options)
        self._running = self._loop.call(start(config), START_TIMEOUT_S)
        advertised = node_ip if bind_host in ("0.0.0.0", "::", "") else bind_host
        metrics = self._running.metrics_server
        print(banner(self._running), flush=True)
        self._info = {
            "address": host_port(advertised, self._running.port),
            "token": config.token,
            "shard_names": list(shard_names),
            "world_size": config.world_size,
            "pid": os.getpid(),
            "node_ip": node_ip,
            "metrics_url": metrics.url if metrics is not None else None,
        }
        return self.info()

    def wait_for_shards(self, timeout_s: float) -> str | None:
        """None once every shard has registered; else which are missing, after `timeout_s`."""
        from gradsync_server.app import wait_for_shards

        if self._running is None:
            return "the coordinator was never started"
        if self._loop.call(wait_for_shards(self._running, timeout_s), timeout_s + 5.0):
            return None
        return str(self._running.servicer.shard_control.registry.describe_missing())

    def stop(self, grace_s: float | None) -> None:
        """Drain the jobs for `grace_s` (None: the configured grace), then close the server."""
        if self._running is not None:
            running, self._running = self._running, None
            grace = running.servicer.config.shutdown_grace_s if grace_s is None else grace_s
            self._loop.call(running.stop(grace), grace + STOP_TIMEOUT_S)
        self._loop.close()


class ShardServer(_ServerActor):
    """Ray actor body: one coordinator shard, registering with its leader."""

    thread_name = "gradsync-shard"

    def start(self, options: dict[str, Any]) -> dict[str, Any]:
        """Bind, advertise this node's address and start registering with the leader."""
        from gradsync_server.app import banner, start
        from gradsync_server.config import CoordinatorConfig, Role

        node_ip = _node_ip()
        config = CoordinatorConfig(role=Role.SHARD, host=node_ip, port=0, **options)
        self._running = self._loop.call(start(config), START_TIMEOUT_S)
        print(banner(self._running), flush=True)
        self._info = {"address": self._running.advertise, "pid": os.getpid(), "node_ip": node_ip}
        return self.info()

    def stop(self) -> None:
        """Close the shard's server and its link to the leader."""
        if self._running is not None:
            running, self._running = self._running, None
            self._loop.call(running.stop(), STOP_TIMEOUT_S)
        self._loop.close()


# Any: ray's typed handles do not see the methods of a class made remote this way.
_LeaderActor: Any = ray.remote(LeaderServer)
_ShardActor: Any = ray.remote(ShardServer)


@dataclass(frozen=True)
class Coordinator:
    """A coordinator running on Ray: where workers connect, and how to stop it.

    Attributes:
        name: its name; the leader actor is `gradsync-coordinator:<name>` in the
            "gradsync" namespace.
        address: "host:port" of the leader; workers need nothing else (and the token).
        world_size: ranks per job.
        token: the secret every call must present, or None (client certificates, or
            loopback). Never printed.
        leader: the leader's actor handle.
        shards: the shard actors' handles (shard 1 first).
        metrics_url: the leader's Prometheus endpoint (`metrics_port=` in the serve
            options; 0 = a free port), or None.
    """

    name: str
    address: str
    world_size: int
    token: str | None = field(repr=False)
    leader: Any = field(repr=False)
    shards: tuple[Any, ...] = field(default=(), repr=False)
    metrics_url: str | None = None

    @classmethod
    def of(
        cls, name: str, info: Mapping[str, Any], leader: Any, shards: tuple[Any, ...]
    ) -> Coordinator:
        """The handle of the coordinator whose leader's `info` this is."""
        metrics_url = info.get("metrics_url")
        return cls(
            name, info["address"], info["world_size"], info["token"], leader, shards, metrics_url
        )

    def environment(self) -> dict[str, str]:
        """Environment variables a worker needs to reach this coordinator."""
        env = {"GRADSYNC_COORDINATOR": self.address}
        if self.token is not None:
            env[auth.ENV_TOKEN] = self.token
        return env

    def security(self) -> ChannelSecurity:
        """Client credentials for this coordinator (the token; TLS from the environment)."""
        return ChannelSecurity.resolve(token=self.token)

    def status(self, job_id: str = "") -> Any:
        """The coordinator's `StatusReply` (`gradsync status`), over its gRPC address."""
        from gradsync.status import query_status

        return query_status(self.address, job_id, security=self.security())

    def pids(self) -> dict[str, int]:
        """Process id of each actor by actor role ("leader", "shard 1", ...)."""
        handles = {"leader": self.leader} | {
            f"shard {index}": shard for index, shard in enumerate(self.shards, start=1)
        }
        infos = fetch([handle.info.remote() for handle in handles.values()])
        return {role: int(info["pid"]) for role, info in zip(handles, infos, strict=True)}

    def stop(self, grace_s: float | None = None) -> None:
        """Drain running jobs for `grace_s`, stop every server, and end every actor.

        Returns once no actor of this coordinator is alive any more (bounded by
        `DEATH_TIMEOUT_S`); safe to call from any driver, and twice.
        """
        handles = (self.leader, *self.shards)
        try:
            drain_s = defaults.SHUTDOWN_GRACE_S if grace_s is None else grace_s
            fetch(self.leader.stop.remote(grace_s), timeout_s=drain_s + STOP_TIMEOUT_S)
            fetch([shard.stop.remote() for shard in self.shards], timeout_s=STOP_TIMEOUT_S)
        except ray.exceptions.RayActorError:
            pass  # already gone: killing it below is all that is left to do
        except ray.exceptions.GetTimeoutError:
            # A drain longer than asked for (a configured grace above `grace_s`): the
            # jobs it still held end with the actors.
            log.warning("coordinator %r did not stop in time; ending its actors", self.name)
        finally:
            for handle in handles:
                ray.kill(handle, no_restart=True)
        _wait_until_dead(handles, DEATH_TIMEOUT_S)
        log.info("coordinator %r stopped", self.name)


def _wait_until_dead(handles: tuple[Any, ...], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    for handle in handles:
        while True:
            try:
                fetch(handle.info.remote(), timeout_s=max(0.1, deadline - time.monotonic()))
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                break
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"an actor of the coordinator was still alive after {timeout_s:g} s"
                )
            time.sleep(0.1)


def start_coordinator(
    world_size: int,
    *,
    shards: int = 1,
    resources: Mapping[str, float] | None = None,
    name: str = "default",
    detached: bool = False,
    log_level: str = "WARNING",
    **serve_options: Any,
) -> Coordinator:
    """Start a gradsync coordinator as Ray actors and return its handle.

    Args:
        world_size: ranks per job.
        shards: coordinator shards, the leader included; shards 1..S-1 are spread over
            the cluster's nodes (`scheduling_strategy="SPREAD"`).
        resources: each actor's resources, as Ray Train writes them ({"CPU": 1,
            "head": 0.01}); default one CPU. A custom resource that only one node type
            has pins the coordinator there (the example cluster YAML's head node).
        name: the coordinator's name in the "gradsync" namespace (`get_coordinator`).
        detached: outlive this driver (until `stop()` or the cluster ends).
        log_level: the actors' log level.
        **serve_options: `gradsync_server.config.CoordinatorConfig` fields: `on_failure`,
            `min_workers`, `checkpoint_store`, `heartbeat_timeout_s`, `token`, `tls_cert`...
            `host` is where to bind (default: the node's address).

    Raises:
        ValueError: a bad option (the message names it), or `name` is taken.
        TimeoutError: the shards did not all register in time (naming the missing ones);
            every actor started is ended first.
    """
    from gradsync_server.config import CoordinatorConfig

    if shards < 1:
        raise ValueError(f"shards must be at least 1 (the leader), got {shards}")
    reserved = sorted(_SET_HERE & serve_options.keys())
    if reserved:
        raise ValueError(f"{', '.join(reserved)} are set by start_coordinator, not options")
    options = dict(serve_options, world_size=world_size, shard_count=shards)
    if not any(options.get(key) for key in ("token", "tls_client_ca", "insecure")) and not (
        auth.is_loopback(str(options.get("host", "")))
    ):
        # Other nodes must reach it, so it listens beyond loopback: that needs a secret.
        options["token"] = secrets.token_urlsafe(32)
    if shards > 1 and not options.get("shard_token"):
        # The shard actors' own credential at the leader; the workers never see it.
        options["shard_token"] = secrets.token_urlsafe(32)
    CoordinatorConfig(**options)  # refuse a bad option here, with its message, not in an actor
    placement = actor_options(resources, DEFAULT_COORDINATOR_RESOURCES)
    # Every option is checked before the first call into Ray (the name lookup).
    if not ray.is_initialized():
        ray.init()  # $RAY_ADDRESS, else a local cluster (as `run` does)
    _refuse_taken(name)
    common: dict[str, Any] = dict(placement, namespace=NAMESPACE, max_restarts=0, max_concurrency=4)
    if detached:
        common["lifetime"] = "detached"
    shard_names = [shard_actor_name(name, index) for index in range(1, shards)]
    leader = _LeaderActor.options(name=leader_actor_name(name), **common).remote(log_level)
    started: list[Any] = [leader]
    try:
        info = _started(leader.start.remote(options, shard_names), "the leader", placement)
        shard_options = _shard_options(options, info["address"])
        for shard_name in shard_names:
            options_of = dict(common, name=shard_name, scheduling_strategy="SPREAD")
            started.append(_ShardActor.options(**options_of).remote(log_level))
        handles = started[1:]
        _started([shard.start.remote(shard_options) for shard in handles], "the shards", placement)
        if handles:
            missing = fetch(
                leader.wait_for_shards.remote(SHARD_REGISTER_TIMEOUT_S),
                timeout_s=SHARD_REGISTER_TIMEOUT_S + 10.0,
            )
            if missing is not None:
                raise TimeoutError(
                    f"coordinator {name!r}: shards did not register with the leader at "
                    f"{info['address']} within {SHARD_REGISTER_TIMEOUT_S:g} s: {missing}"
                )
    except BaseException:
        for handle in started:
            ray.kill(handle, no_restart=True)
        raise
    log.info("coordinator %r listening on %s (%d shard(s))", name, info["address"], shards)
    return Coordinator.of(name, info, leader, tuple(started[1:]))


def _started(refs: Any, what: str, placement: Mapping[str, Any]) -> Any:
    """`fetch` of a start call; a timeout names the request and the cluster's free resources.

    An actor that no node can host waits for one (an autoscaler may add it); past
    `START_TIMEOUT_S` the caller learns why, instead of a bare GetTimeoutError.
    """
    try:
        return fetch(refs, timeout_s=START_TIMEOUT_S)
    except ray.exceptions.GetTimeoutError as exc:
        raise TimeoutError(
            f"{what} of the coordinator did not start within {START_TIMEOUT_S:g} s: each "
            f"actor asks for {dict(placement)}, and the cluster has {cluster_resources()} "
            "(pass resources= that fit, or add nodes)"
        ) from exc


def cluster_resources() -> str:
    """What the Ray cluster has free now, and in all: "{...} free of {...}" (for messages)."""
    free = dict(ray.available_resources())  # type: ignore[no-untyped-call]  # untyped in ray
    total = dict(ray.cluster_resources())  # type: ignore[no-untyped-call]  # untyped in ray
    return f"{free} free of {total}"


def _shard_options(options: Mapping[str, Any], leader_address: str) -> dict[str, Any]:
    """The leader's options that a shard shares: credentials and the chunk size."""
    credentials = ("token", "shard_token", "tls_cert", "tls_key", "tls_client_ca", "tls_ca")
    shard = {
        key: options[key] for key in (*credentials, "insecure", "chunk_bytes") if key in options
    }
    if "tls_cert" in options and "tls_ca" not in options:
        shard["tls_ca"] = options["tls_cert"]  # a self-signed leader: its own certificate
    shard["leader"] = leader_address
    return shard


def _refuse_taken(name: str) -> None:
    try:
        existing = ray.get_actor(leader_actor_name(name), namespace=NAMESPACE)
    except ValueError:
        return
    address = fetch(existing.info.remote(), timeout_s=10.0).get("address", "?")
    raise ValueError(
        f"a gradsync coordinator named {name!r} already runs (at {address}, actor "
        f"{leader_actor_name(name)!r} in namespace {NAMESPACE!r}): stop it "
        f"(gradsync.ray.get_coordinator({name!r}).stop()) or choose another name"
    )


def get_coordinator(name: str = "default", timeout_s: float = 30.0) -> Coordinator:
    """The handle of a coordinator that any driver started with `start_coordinator`.

    Raises:
        LookupError: no coordinator of that name runs in the cluster.
    """
    try:
        leader = ray.get_actor(leader_actor_name(name), namespace=NAMESPACE)
    except ValueError as exc:
        raise LookupError(
            f"no gradsync coordinator named {name!r} runs in this Ray cluster "
            f"(no actor {leader_actor_name(name)!r} in namespace {NAMESPACE!r})"
        ) from exc
    info = fetch(leader.info.remote(), timeout_s=timeout_s)
    shards = tuple(
        ray.get_actor(shard_name, namespace=NAMESPACE) for shard_name in info["shard_names"]
    )
    return Coordinator.of(name, info, leader, shards)
