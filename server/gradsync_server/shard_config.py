"""A coordinator shard's configuration: `gradsync shard` flags -> this frozen object.

A shard takes almost nothing from its own flags: membership, heartbeats and
the shard count come from its leader (`ShardAccepted`, `ShardJobView`). What
it does own is where it listens, what it advertises to workers, the chunk
size (checked against the leader's at registration, so a mismatch is refused
with both values instead of every chunk failing later) and its memory caps.
"""

from __future__ import annotations

import argparse
import contextlib
import socket
from dataclasses import dataclass, field
from typing import Any

from gradsync_proto import chunking
from gradsync_proto.net.addresses import parse_addresses

from gradsync_server import defaults
from gradsync_server.config import check_shard_token
from gradsync_server.store.stores import parse_store_url

#: Bound on the wait for the leader's answer to ShardRegister.
REGISTER_TIMEOUT_S = 10.0
#: Longest pause between two attempts to reach the leader.
RECONNECT_BACKOFF_MAX_S = 5.0
#: Hosts that bind every interface: a shard bound so advertises ":port".
_ALL_INTERFACES = frozenset({"0.0.0.0", "::", "[::]", ""})
#: How often a shard that cannot reach its leader says so.
UNREACHABLE_REPORT_PERIOD_S = 10.0


@dataclass(frozen=True)
class ShardConfig:
    """Everything a coordinator shard needs to start.

    Attributes:
        leader: the leader's "host:port".
        host: interface to bind.
        port: TCP port; 0 picks a free one (reported in the banner).
        advertise: "host:port" workers reach the shard at; None = "<host>:<bound port>"
            when bound to one interface (workers can reach it only there), and
            ":<bound port>" (the host workers reached the leader at) when bound to all.
        chunk_bytes: wire chunk size, checked against the leader's at registration;
            None = whatever the leader uses (every job's view carries it).
        max_buffered_bytes: cap on gradient bytes held in partial reductions.
        max_outbox_bytes: cap on averaged bytes queued for one worker that is not reading
            (all outboxes together: `max_buffered_bytes`).
        max_connections: concurrent data streams; beyond it RESOURCE_EXHAUSTED.
        first_message_timeout_s: a data stream that sends no ShardHello within this is
            ended with DEADLINE_EXCEEDED.
        metrics_port: serve Prometheus metrics on this port (0 = a free one, None = off).
        register_timeout_s: bound on the wait for the leader's answer to ShardRegister.
        reconnect_backoff_max_s: longest pause between two attempts to reach the leader.
        hello_wait_s: until the leader says its heartbeat timeout, how long a data
            stream's first message waits for the leader's view of its job.
        tls_cert, tls_key: PEM certificate and key: served to workers (TLS) and presented
            to the leader as this shard's client certificate when the leader asks (mTLS).
        tls_client_ca: PEM CA whose certificates workers must present (mTLS); None = none.
        tls_ca: PEM CA that issued the leader's certificate; set = reach the leader over
            TLS. None = plaintext to the leader.
        token: the shared secret required of workers.
        shard_token: the secret presented to the leader on `ShardLink` (the workers do
            not hold it); required when the shard has a token or client certificates.
        insecure: listen beyond loopback with neither a token nor client certificates.
        metrics_host: interface the metrics server binds; None = `host`.
        checkpoint_store: where this shard saves its range of the DiLoCo outer state (the
            leader's store; `serve --shards` passes it on); None = nowhere.
        store_timeout_s: deadline of every store call.
        redis_password: password of a redis:// store; never printed.
        parent_pid: stop when this process is no longer our parent (a leader's
            `--shards N` children die with it, `parent_watch`); None = never.
    """

    leader: str
    host: str = defaults.HOST
    port: int = defaults.PORT
    advertise: str | None = None
    chunk_bytes: int | None = None
    max_buffered_bytes: int = defaults.MAX_BUFFERED_BYTES
    max_outbox_bytes: int = defaults.MAX_OUTBOX_BYTES
    max_connections: int = defaults.MAX_CONNECTIONS
    first_message_timeout_s: float = defaults.FIRST_MESSAGE_TIMEOUT_S
    metrics_port: int | None = None
    register_timeout_s: float = REGISTER_TIMEOUT_S
    reconnect_backoff_max_s: float = RECONNECT_BACKOFF_MAX_S
    hello_wait_s: float = defaults.HEARTBEAT_TIMEOUT_S
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_client_ca: str | None = None
    tls_ca: str | None = None
    token: str | None = field(default=None, repr=False)
    shard_token: str | None = field(default=None, repr=False)
    insecure: bool = False
    metrics_host: str | None = None
    checkpoint_store: str | None = None
    store_timeout_s: float = defaults.STORE_TIMEOUT_S
    redis_password: str | None = field(default=None, repr=False)
    parent_pid: int | None = None

    def __post_init__(self) -> None:
        if self.checkpoint_store is not None:
            parse_store_url(self.checkpoint_store)  # an ambiguous URL: refused now
        if not self.leader:
            raise ValueError("a shard needs its leader's address (--leader HOST:PORT)")
        parse_addresses(self.leader)  # "a:1,b:2": an active leader and its standbys
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in 0..65535, got {self.port}")
        if self.chunk_bytes is None:
            pass
        elif not 4096 <= self.chunk_bytes <= defaults.MAX_CHUNK_BYTES:
            raise ValueError(f"chunk size must be 4 KiB..64 MiB, got {self.chunk_bytes} bytes")
        elif self.max_buffered_bytes < self.chunk_bytes:
            raise ValueError(
                f"max buffered bytes ({self.max_buffered_bytes}) must be at least one chunk "
                f"({self.chunk_bytes})"
            )
        check_shard_token(self.token, self.shard_token)
        if self.shard_token is None and (self.token is not None or self.tls_client_ca):
            raise ValueError(
                "a shard with a token or client certificates needs the leader's shard token "
                "(--shard-token-file FILE, $GRADSYNC_SHARD_TOKEN_FILE or "
                "$GRADSYNC_SHARD_TOKEN): the leader admits shards only with it"
            )
        if self.parent_pid is not None and self.parent_pid < 1:
            raise ValueError(f"parent pid must be >= 1, got {self.parent_pid}")
        for name in ("register_timeout_s", "reconnect_backoff_max_s", "hello_wait_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")

    @property
    def max_message_bytes(self) -> int:
        """gRPC message size limit: one chunk (the largest allowed, following the leader)
        plus room for the header fields."""
        return (self.chunk_bytes or defaults.MAX_CHUNK_BYTES) + chunking.HEADER_SLACK_BYTES

    def advertised(self, bound_port: int) -> str:
        """The address the shard registers with (see `advertise`)."""
        if self.advertise:
            return self.advertise
        host = self.host
        if host in _ALL_INTERFACES:
            # Bound to every interface: the one this host reaches its leader through is
            # the best guess of where workers reach it (":port", the leader's own host,
            # is right only for a shard that runs next to its leader).
            host = route_source(self.leader) or ""
        if not host:
            return f":{bound_port}"
        host = f"[{host}]" if ":" in host else host
        return f"{host}:{bound_port}"


def store_settings(args: argparse.Namespace, password: str | None) -> dict[str, Any]:
    """`ShardConfig`'s store fields from the flags of `gradsync shard`."""
    return {
        "checkpoint_store": args.checkpoint_store,
        "store_timeout_s": args.store_timeout,
        "redis_password": password,
    }


def route_source(target: str) -> str | None:
    """The local address this host sends from to reach `target` ("host:port"), or None.

    Connecting a UDP socket sends nothing: it only asks the kernel for a route.
    """
    host, _, port = target.rpartition(":")
    host = host.strip("[]")
    with contextlib.suppress(OSError, ValueError):
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect((host, int(port)))
            return str(probe.getsockname()[0])
    return None
