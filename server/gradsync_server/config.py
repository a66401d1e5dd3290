"""The coordinator's configuration: flags -> this frozen object -> constructors.

One `CoordinatorConfig` for both roles of a coordinator process: the leader
(`gradsync serve`, the control plane and byte range 0) and a shard
(`gradsync shard --leader HOST:PORT`, byte range i, following its leader).
What both do (listen, limit peers, check callers, serve metrics, reach a
store) is declared once; a field only one role reads is checked only for
that role. A shard takes almost nothing from its own flags: membership,
heartbeats and the shard count come from its leader (`ShardAccepted`,
`ShardJobView`).

Every field that has a flag declares it in its metadata
(`gradsync_proto.flags.Flag`: name, unit, type, help, roles), so
`gradsync_proto.flags.add_flags` builds the subcommands' flags and
`config_from_flags` builds this object from them; the flags that are not a
field's value as given are read by `gradsync_server.arguments`. Rules that
involve several fields are checked here only, with messages that name the
flags, which the CLI reports as flag errors (exit status 2).
"""

from __future__ import annotations

import contextlib
import functools
import hmac
import math
import os
import socket
from dataclasses import dataclass, fields
from enum import StrEnum
from typing import TYPE_CHECKING

from gradsync_proto import auth, chunking
from gradsync_proto.flags import (
    chunk_mb,
    coordinator,
    integer,
    non_empty,
    option,
    port as tcp_port,
    positive_int,
    positive_number,
    seconds,
    seconds_or_zero,
)
from gradsync_proto.net.address import parse_address
from gradsync_proto.net.addresses import parse_addresses

from gradsync_server import arguments as read, defaults
from gradsync_server.dataplane.budget import outbox_pool_bytes
from gradsync_server.defaults import MIB
from gradsync_server.store.stores import parse_store_url

if TYPE_CHECKING:
    from gradsync_server.control.settings import JobSettings

__all__ = ["MIB", "CoordinatorConfig", "Role"]


class Role(StrEnum):
    """What a coordinator process is: the leader (`gradsync serve`) or a shard."""

    LEADER = "leader"
    SHARD = "shard"


_LEADER = (Role.LEADER,)
_SHARD = (Role.SHARD,)
#: A field only the leader reads: a flag of `gradsync serve` alone.
_leader_option = functools.partial(option, roles=_LEADER)
#: Hosts that bind every interface: a shard bound so advertises ":port".
_ALL_INTERFACES = frozenset({"0.0.0.0", "::", "[::]", ""})


@dataclass(frozen=True, kw_only=True)
class CoordinatorConfig:
    """Everything a coordinator process (leader or shard) needs to start.

    A field's flag help says what it does; the notes here say what the help
    does not. `None` turns an optional feature off unless noted.

    Attributes:
        role: leader or shard; a shard needs `leader`, a leader `world_size`.
        chunk_bytes: 0 = the role's default: `defaults.CHUNK_BYTES` on a leader (a
            sharded one started by `gradsync serve` takes `SHARDED_CHUNK_BYTES`), the
            leader's on a shard, which checks a given size against the leader's at
            registration, so a mismatch is refused with both values.
        max_job_buffered_bytes: None = half of `max_buffered_bytes`.
        max_outbox_bytes: all outboxes together are capped too, by `outbox_pool_bytes`.
        checkpoint_store: a shard saves its range of the DiLoCo outer state there.
        state_dir: the leader's high-water marks, out of the store's reach
            (`gradsync_server.store.high_water_file`); None: no marks (only the chain
            recorded in the checkpoints themselves guards against a rolled-back store).
        frame_port: 0 = a free port, None = off; told to workers by the FramePort RPC;
            a `--lease` coordinator serves none.
        frame_port_required: a frame port that cannot be bound is an error; False: take
            a free one instead, with a warning.
        token: the secret every call must present; never printed.
        shard_token: the secret shards present on `ShardLink` instead of `token`, which
            workers hold too (a worker must not pose as a shard: shards learn every
            member of every job). A leader with local shards makes one when none is
            given; a shard presents it to its leader.
        tls_ca: a leader hands it to its local shards to verify it (None: `tls_cert`);
            a shard set with it reaches its leader over TLS.
        host_id: a leader's host id, which a local leader's Join.host_id must equal for
            the payload path; "" = `gradsync_proto.host.host_id()`.
        register_timeout_s, reconnect_backoff_max_s: a shard's bounds on registering
            with its leader and on the pause between two attempts to reach it.
        hello_wait_s: until the leader says its heartbeat timeout, how long a shard's
            data stream waits for the leader's view of its job.
    """

    role: Role = Role.LEADER
    world_size: int = _leader_option(0, "ranks per job", type=positive_int, required=True)
    leader: str = option(
        "",
        "the leader's host:port, or a comma list: an active leader and its standbys (--lease)",
        type=coordinator,
        required=True,
        roles=_SHARD,
    )
    host: str = option(
        defaults.HOST,
        "interface to bind (default %(default)s; 0.0.0.0 for all, which needs a token, "
        "client certificates or --insecure)",
        type=non_empty,
    )
    port: int = option(
        defaults.PORT,
        "TCP port; 0 picks a free one and prints it (default %(default)s)",
        type=tcp_port,
    )
    advertise: str | None = option(
        None,
        {
            Role.LEADER: "host:port workers should use for this coordinator, shown by a "
            "standby (default: --host:--port)",
            Role.SHARD: "host:port workers reach the shard at (default HOST:PORT, or "
            "':PORT' = the host they reach the leader at when --host is 0.0.0.0)",
        },
        type=non_empty,
    )
    chunk_bytes: int = option(
        0,
        {
            Role.LEADER: f"wire chunk size in MiB (default {defaults.CHUNK_BYTES / MIB:g}; "
            f"{defaults.SHARDED_CHUNK_BYTES / MIB:g} with --shards or --wait-for-shards)",
            Role.SHARD: "wire chunk size in MiB; if given, must equal the leader's "
            "(default: the leader's)",
        },
        name="--chunk-mb",
        type=chunk_mb,
        flag_default=None,
        read=read.chunk_bytes,
    )
    max_buffered_bytes: int = option(
        defaults.MAX_BUFFERED_BYTES,
        "cap on gradient bytes held in partial reductions (default %(default)g)",
        type=positive_number,
        unit=MIB,
    )
    max_job_buffered_bytes: int | None = _leader_option(
        None,
        "the most of --max-buffered-mb one job may hold, so that one job cannot starve "
        "the others (default: half of --max-buffered-mb)",
        type=positive_number,
        unit=MIB,
    )
    max_outbox_bytes: int = option(
        defaults.MAX_OUTBOX_BYTES,
        "cap on results queued for one worker that does not read them; beyond it the "
        "worker is dropped with RESOURCE_EXHAUSTED (default %(default)g)",
        type=positive_number,
        unit=MIB,
    )
    max_connections: int = option(
        defaults.MAX_CONNECTIONS,
        "concurrent streams (a shard's: data streams); beyond it RESOURCE_EXHAUSTED "
        "(default %(default)s)",
        type=positive_int,
    )
    first_message_timeout_s: float = option(
        defaults.FIRST_MESSAGE_TIMEOUT_S,
        "a stream that sends no first message (Join, ShardHello, ShardRegister) within "
        "this many seconds is ended with DEADLINE_EXCEEDED (default %(default)g)",
        type=positive_number,
    )
    max_checkpoint_bytes: int = _leader_option(
        defaults.MAX_CHECKPOINT_BYTES,
        "largest checkpoint (or rejoining rank's state) accepted (default %(default)g)",
        type=positive_number,
        unit=MIB,
    )
    assembly_timeout_s: float = _leader_option(
        defaults.ASSEMBLY_TIMEOUT_S,
        "a job whose ranks have not all joined within this many seconds is refused, "
        "freeing its slot (default %(default)g)",
        type=positive_number,
    )
    max_jobs: int = _leader_option(
        defaults.MAX_JOBS, "concurrent jobs accepted (default %(default)s)", type=positive_int
    )
    shutdown_grace_s: float = _leader_option(
        defaults.SHUTDOWN_GRACE_S,
        "how long SIGTERM lets running streams finish (default %(default)g)",
        type=seconds_or_zero,
    )
    heartbeat_interval_s: float = _leader_option(
        defaults.HEARTBEAT_INTERVAL_S,
        "seconds between worker heartbeats (default %(default)g)",
        name="--heartbeat-interval",
        type=seconds,
    )
    heartbeat_timeout_s: float = _leader_option(
        defaults.HEARTBEAT_TIMEOUT_S,
        "seconds of silence before a worker is declared dead (default %(default)g)",
        name="--heartbeat-timeout",
        type=seconds,
    )
    stall_warning_s: float = _leader_option(
        defaults.STALL_WARNING_S,
        "log who a step waits for once it is this many seconds old (default %(default)g)",
        name="--stall-warning",
        type=seconds,
    )
    checkpoint_store: str | None = option(
        None,
        {
            Role.LEADER: "where checkpoints go: redis://host:port/db, rediss://..., "
            "file:///dir or a directory that does not look like host:port (default: none)",
            Role.SHARD: "where this shard saves its range of every DiLoCo job's outer "
            "state (the leader's --checkpoint-store, which `serve --shards` passes on; "
            "default: none)",
        },
    )
    lease: bool = _leader_option(
        False,
        "take part in the Redis lease of a redis:// --checkpoint-store: serve only "
        "while holding it (another coordinator with --lease/--standby takes over)",
        action="store_true",
        read=read.lease,
    )
    standby: bool = _leader_option(
        False,
        "start as a standby (implies --lease): answer UNAVAILABLE until the active "
        "coordinator's lease expires, then take over and resume the job from the store",
        action="store_true",
    )
    lease_ttl_s: float = _leader_option(
        3.0,
        "lease lifetime after each renewal (renewed every ttl/3; default %(default)g)",
        type=seconds,
    )
    checkpoint_every: int = _leader_option(
        defaults.CHECKPOINT_EVERY_STEPS,
        "rank 0 uploads a checkpoint every K steps (default %(default)s; 0: on request)",
        type=integer(0),
    )
    require_checkpoint: bool = _leader_option(
        False,
        "fail the job when a checkpoint cannot be saved, instead of training on and retrying",
        action="store_true",
    )
    resume: bool = _leader_option(
        False, "refuse to start a job that has no stored checkpoint", action="store_true"
    )
    fresh_start: bool = _leader_option(
        False,
        "start every job at step 0 without reading its checkpoints (which are kept); "
        "without it a store that cannot be read refuses the job",
        action="store_true",
    )
    state_dir: str | None = _leader_option(
        None,
        "the coordinator's own directory for each job's high-water mark (its newest "
        "acknowledged checkpoint), so that a rolled-back store is refused; keep it off "
        "the store's disk (default $GRADSYNC_STATE_DIR, else $XDG_STATE_HOME/gradsync, "
        "else ~/.local/state/gradsync)",
        read=read.state_dir,
    )
    store_timeout_s: float = option(
        defaults.STORE_TIMEOUT_S,
        "deadline of each checkpoint store call; a hung store fails it, other jobs "
        "train on (default %(default)gs)",
        name="--store-timeout",
        type=seconds,
    )
    redis_password: str | None = option(
        None,
        f"file holding the password of a redis:// --checkpoint-store (or set "
        f"${defaults.ENV_REDIS_PASSWORD}); keeps it out of the URL and the process list",
        name="--redis-password-file",
        read=read.redis_password,
        repr=False,
    )
    metrics_port: int | None = option(
        None, "serve Prometheus metrics on this port (0 = a free one; default: off)", type=tcp_port
    )
    on_failure: str = _leader_option(
        defaults.ON_FAILURE,
        "when a worker is lost: abort the step for everyone, or go on with the live "
        "ranks and let restarted ranks rejoin (default %(default)s)",
        choices=("abort", "elastic"),
    )
    min_workers: int = _leader_option(
        defaults.MIN_WORKERS,
        "elastic: the fewest live workers to go on with (default %(default)s)",
        type=positive_int,
    )
    frame_port: int | None = option(
        0,
        {
            Role.LEADER: "serve workers' Sync streams also as frames on this TCP port (same "
            "host, TLS and token as --port), which costs far less per message than gRPC; "
            "workers find it through the gRPC port and fall back to gRPC where it is "
            "unreachable (default: --port + 1, --port + S with --shards S, or a free port "
            "when that is taken or --port is 0; -1 = off)",
            Role.SHARD: "serve workers' data streams also as frames on this TCP port (same "
            "host, TLS and token as --port); workers find it through the gRPC port and fall "
            "back to gRPC where it is unreachable (default: a free port; -1 = off)",
        },
        type=int,
        flag_default=None,
        read=read.frame_port,
    )
    frame_port_required: bool = option(False, name=None, read=read.frame_port_required)
    payload_socket: bool = _leader_option(
        True,
        "move every gradient payload over TCP, also those of local leaders on this "
        "coordinator's host (which otherwise go through their shared memory; for "
        "debugging)",
        name="--no-payload-socket",
        action="store_false",
    )
    nonfinite: str = _leader_option(
        defaults.NONFINITE,
        "a rank's NaN/Inf gradient: report it (log, metric, status; the step goes on "
        "as under DDP), abort the step for every rank (NonFiniteGradientError), or allow "
        "it unchecked, e.g. for GradScaler users (default %(default)s)",
        choices=defaults.NONFINITE_POLICIES,
    )
    screen: str = _leader_option(
        defaults.SCREEN,
        "the least every DiLoCo job's contribution screen does, in the order "
        "report < clip < exclude < trimmed_mean < median: a job's own screen= applies "
        "when it is stricter (default %(default)s)",
        choices=defaults.SCREEN_POLICIES,
    )
    max_collective_bytes: int = _leader_option(
        defaults.MAX_COLLECTIVE_BYTES,
        "cap on one rank's input to a collective (all_reduce, broadcast, ...) and on an "
        "all_gather's result, in MiB (default %(default)g)",
        type=positive_number,
        unit=MIB,
    )
    shard_count: int = _leader_option(
        defaults.SHARDS,
        "coordinator shards on this host, this leader included: it starts S-1 "
        "`gradsync shard` processes on ports PORT+1.. and restarts any that dies "
        "(default 1)",
        name="--shards",
        type=positive_int,
        flag_default=None,
        read=read.shard_count,
    )
    # Set by either flag: False when the shards are started elsewhere.
    local_shards: bool = _leader_option(
        False,
        "K shards run elsewhere (`gradsync shard --leader HOST:PORT`): jobs start once "
        "all K have registered (default 0)",
        name="--wait-for-shards",
        type=integer(0),
        flag_default=None,
        read=read.local_shards,
    )
    shard_wait_timeout_s: float = _leader_option(
        defaults.SHARD_WAIT_TIMEOUT_S,
        "seconds to wait at start-up for every shard to register before exiting 1 "
        "(default %(default)g)",
        name="--shard-wait-timeout",
        type=seconds,
    )
    parent_pid: int | None = option(
        None,
        "stop (as on SIGTERM) when the process PID is no longer this shard's parent; "
        "`serve --shards` passes its own pid so its shards never outlive it "
        "(default: off)",
        type=int,
        roles=_SHARD,
    )
    tls_cert: str | None = option(
        None,
        "PEM certificate: serve over TLS (a shard also presents it to a leader that "
        "asks for client certificates)",
    )
    tls_key: str | None = option(None, "PEM private key of --tls-cert")
    tls_client_ca: str | None = option(
        None, "PEM CA of the client certificates: every caller must present one (mTLS)"
    )
    token: str | None = option(
        None,
        f"file holding the shared token every call must present (default "
        f"${auth.ENV_TOKEN_FILE}, or the token itself in ${auth.ENV_TOKEN}; "
        "make one with `gradsync token FILE`)",
        name="--token-file",
        read=read.token,
        repr=False,
    )
    shard_token: str | None = option(
        None,
        f"file holding the shard token, which shards present to their leader instead "
        f"of the workers' token (default ${auth.ENV_SHARD_TOKEN_FILE}, or the token "
        f"itself in ${auth.ENV_SHARD_TOKEN}); needed by --wait-for-shards and by every "
        "shard when a token or client certificates are set; --shards makes one for its "
        "own shards",
        name="--shard-token-file",
        read=read.shard_token,
        repr=False,
    )
    insecure: bool = option(
        False,
        "listen beyond loopback with neither a token nor client certificates "
        "(trusted networks only)",
        action="store_true",
    )
    metrics_host: str | None = option(
        None, "interface the metrics server binds (default: --host)", type=non_empty
    )
    tls_ca: str | None = option(
        None,
        {
            Role.LEADER: "PEM CA that issued --tls-cert, given to the local shards of "
            "--shards to verify this leader (default: --tls-cert itself)",
            Role.SHARD: "PEM CA that issued the leader's certificate: reach the leader "
            "over TLS, presenting --tls-cert if it asks for a client certificate "
            "(default: plaintext)",
        },
    )
    host_id: str = ""
    register_timeout_s: float = defaults.REGISTER_TIMEOUT_S
    reconnect_backoff_max_s: float = defaults.RECONNECT_BACKOFF_MAX_S
    hello_wait_s: float = defaults.HEARTBEAT_TIMEOUT_S

    def __post_init__(self) -> None:
        object.__setattr__(self, "role", Role(self.role))
        if self.role is Role.LEADER and not self.chunk_bytes:
            object.__setattr__(self, "chunk_bytes", defaults.CHUNK_BYTES)
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in 0..65535, got {self.port}")
        if self.chunk_bytes and not 4096 <= self.chunk_bytes <= defaults.MAX_CHUNK_BYTES:
            raise ValueError(f"chunk size must be 4 KiB..64 MiB, got {self.chunk_bytes} bytes")
        if self.max_buffered_bytes < self.chunk_bytes:
            raise ValueError(
                f"--max-buffered-mb {self.max_buffered_bytes / MIB:g} must hold at least one "
                f"chunk (--chunk-mb {self.chunk_bytes / MIB:g})"
            )
        if (
            self.token is not None
            and self.shard_token is not None
            and hmac.compare_digest(self.token.encode(), self.shard_token.encode())
        ):  # a shard token equal to the workers' token tells nobody apart
            raise ValueError(
                "the shard token is the same as the workers' token: a shard token must be a "
                "secret the workers do not hold (make one with `gradsync token FILE`)"
            )
        if self.checkpoint_store is not None:
            try:
                location = parse_store_url(self.checkpoint_store)
            except ValueError as exc:  # an ambiguous URL: refused now
                raise ValueError(f"--checkpoint-store: {exc}") from None
            if location.kind == "file" and self.state_dir is not None:
                _check_state_dir_outside(self.state_dir, location.target)
        if not self.store_timeout_s > 0:
            raise ValueError(f"store timeout must be > 0 s, got {self.store_timeout_s}")
        if self.role is Role.LEADER:
            self._check_leader()
        else:
            self._check_shard()

    def _check_leader(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"world size must be at least 1, got {self.world_size}")
        if self.frame_port is not None and not 0 <= self.frame_port <= 65535:
            raise ValueError(f"frame port must be in 0..65535 (or None), got {self.frame_port}")
        if self.max_job_buffered_bytes is not None and not (
            self.chunk_bytes <= self.max_job_buffered_bytes <= self.max_buffered_bytes
        ):
            raise ValueError(
                f"--max-job-buffered-mb {self.max_job_buffered_bytes / MIB:g} must be between "
                f"one chunk (--chunk-mb {self.chunk_bytes / MIB:g}) and --max-buffered-mb "
                f"{self.max_buffered_bytes / MIB:g}"
            )
        if self.max_outbox_bytes < self.max_message_bytes:
            raise ValueError(
                f"--max-outbox-mb {self.max_outbox_bytes / MIB:g} must hold at least one "
                f"message ({self.max_message_bytes} bytes: --chunk-mb and its header)"
            )
        for what, value in (
            ("max checkpoint bytes (--max-checkpoint-mb)", self.max_checkpoint_bytes),
            ("max connections (--max-connections)", self.max_connections),
            ("max jobs (--max-jobs)", self.max_jobs),
            ("max collective bytes (--max-collective-mb)", self.max_collective_bytes),
            ("shard count (--shards)", self.shard_count),
        ):
            if value < 1:
                raise ValueError(f"{what} must be at least 1, got {value}")
        for what, duration in (
            ("first message timeout (--first-message-timeout-s)", self.first_message_timeout_s),
            ("assembly timeout (--assembly-timeout-s)", self.assembly_timeout_s),
            ("stall warning (--stall-warning)", self.stall_warning_s),
            ("shard wait timeout (--shard-wait-timeout)", self.shard_wait_timeout_s),
        ):
            if not duration > 0:
                raise ValueError(f"{what} must be > 0 s, got {duration}")
        if self.shutdown_grace_s < 0:
            raise ValueError(f"shutdown grace must be >= 0 s, got {self.shutdown_grace_s}")
        if not 0 < self.heartbeat_interval_s < self.heartbeat_timeout_s:
            raise ValueError(
                f"--heartbeat-interval {self.heartbeat_interval_s:g} must be positive and "
                f"below --heartbeat-timeout {self.heartbeat_timeout_s:g}"
            )
        for what, policy, policies in (
            ("nonfinite", self.nonfinite, defaults.NONFINITE_POLICIES),
            ("screen", self.screen, defaults.SCREEN_POLICIES),
        ):
            if policy not in policies:
                raise ValueError(f"{what} must be one of {', '.join(policies)}, got {policy!r}")
        if self.on_failure not in ("abort", "elastic"):
            raise ValueError(f"on failure must be 'abort' or 'elastic', got {self.on_failure!r}")
        if not 1 <= self.min_workers <= self.world_size:
            raise ValueError(
                f"--min-workers {self.min_workers} is more than --world-size {self.world_size}"
                if self.min_workers > self.world_size
                else f"min workers must be at least 1, got {self.min_workers}"
            )
        if self.checkpoint_every < 0:
            raise ValueError(f"checkpoint every must be >= 0 steps, got {self.checkpoint_every}")
        if (
            self.shard_count > 1
            and not self.local_shards
            and self.shard_token is None
            and (self.token is not None or self.tls_client_ca is not None)
        ):
            raise ValueError(
                f"{self.shards_flag} needs a shard token that the workers do not have "
                "(--shard-token-file FILE, $GRADSYNC_SHARD_TOKEN_FILE or "
                "$GRADSYNC_SHARD_TOKEN; make one with `gradsync token FILE`) and each shard "
                "started with the same one: otherwise any worker could register as a shard "
                "and read every job's sessions"
            )
        if self.lease or self.standby:
            # The lease and its fence live in Redis; a file store has no atomic fenced write.
            kind = parse_store_url(self.checkpoint_store).kind if self.checkpoint_store else None
            if kind != "redis":
                raise ValueError(
                    "--lease/--standby need a redis:// --checkpoint-store (the lease and the "
                    f"fenced writes live in Redis), got {self.checkpoint_store or 'none'}"
                )
            if not 0 < self.lease_ttl_s < math.inf:
                raise ValueError(f"--lease-ttl-s must be > 0 s, got {self.lease_ttl_s}")
        if self.fresh_start and self.resume:
            raise ValueError(
                "--fresh-start and --resume contradict each other: --resume refuses to start "
                "a job without a checkpoint, --fresh-start starts every job without one"
            )
        if (self.require_checkpoint or self.resume or self.checkpoint_every) and not (
            self.checkpoint_store
        ):
            raise ValueError(
                "--checkpoint-every, --require-checkpoint and --resume need --checkpoint-store"
            )

    def _check_shard(self) -> None:
        if not self.leader:
            raise ValueError("a shard needs its leader's address (--leader HOST:PORT)")
        parse_addresses(self.leader)  # "a:1,b:2": an active leader and its standbys
        if self.advertise is not None:
            # ":PORT" means the host workers reach the leader at; else a full host:port.
            shown = self.advertise
            try:
                parse_address(f"localhost{shown}" if shown.startswith(":") else shown)
            except ValueError as exc:
                raise ValueError(f"--advertise {shown}: {exc}") from None
        if self.shard_token is None and (self.token is not None or self.tls_client_ca):
            raise ValueError(
                "a shard with a token or client certificates needs the leader's shard token "
                "(--shard-token-file FILE, $GRADSYNC_SHARD_TOKEN_FILE or "
                "$GRADSYNC_SHARD_TOKEN): the leader admits shards only with it"
            )
        if self.parent_pid is not None and self.parent_pid < 1:
            raise ValueError(f"parent pid (--parent-pid) must be >= 1, got {self.parent_pid}")
        for name in ("register_timeout_s", "reconnect_backoff_max_s", "hello_wait_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")

    def job_settings(self) -> JobSettings:
        """What every job of this leader is configured with."""
        # Imported here: the CLI builds its parser from this module, without numpy.
        from gradsync_server.control.settings import JobSettings, NonFinitePolicy, OnFailure

        # Every setting is the field of the same name here; two are enums there.
        values = {field.name: getattr(self, field.name) for field in fields(JobSettings)}
        values["on_failure"] = OnFailure(self.on_failure)
        values["nonfinite"] = NonFinitePolicy(self.nonfinite)
        return JobSettings(**values)

    @property
    def shards_flag(self) -> str:
        """How the operator asked for the shards, for messages ("--shards 3")."""
        if self.local_shards:
            return f"--shards {self.shard_count}"
        return f"--wait-for-shards {self.shard_count - 1}"

    @property
    def outbox_pool_bytes(self) -> int:
        """What all outboxes together may queue (see `budget.outbox_pool_bytes`)."""
        return outbox_pool_bytes(self.max_buffered_bytes, self.max_outbox_bytes)

    @property
    def max_message_bytes(self) -> int:
        """gRPC message size limit: one chunk (on a shard that follows its leader's size,
        the largest allowed) plus room for the header fields."""
        return (self.chunk_bytes or defaults.MAX_CHUNK_BYTES) + chunking.HEADER_SLACK_BYTES

    def advertised(self, bound_port: int) -> str:
        """The address workers are told: `advertise`, else where this process listens.

        A shard bound to every interface advertises the address this host reaches its
        leader through, the best guess of where workers reach it (":port", the leader's
        own host, is right only for a shard that runs next to its leader).
        """
        if self.advertise:
            return self.advertise
        host = self.host
        if self.role is Role.LEADER:
            return f"{host}:{bound_port}"
        if host in _ALL_INTERFACES:
            host = route_source(self.leader) or ""
        if not host:
            return f":{bound_port}"
        host = f"[{host}]" if ":" in host else host
        return f"{host}:{bound_port}"


def _check_state_dir_outside(state_dir: str, store_dir: str) -> None:
    """Refuse a state directory inside the file store: whoever can write the store could then
    roll back the high-water marks along with the checkpoints, which is what they guard."""
    state, store = os.path.abspath(state_dir), os.path.abspath(store_dir)
    if os.path.commonpath([state, store]) == store:
        raise ValueError(
            f"--state-dir {state_dir} is inside the checkpoint store {store_dir}: whoever can "
            "write the store could roll back the high-water marks with it; keep the state "
            "directory elsewhere (default ~/.local/state/gradsync)"
        )


def route_source(target: str) -> str | None:
    """The local address this host sends from to reach `target` ("host:port"), or None.

    Connecting a UDP socket sends nothing: it only asks the kernel for a route.
    """
    host, _, port_text = target.rpartition(":")
    host = host.strip("[]")
    with contextlib.suppress(OSError, ValueError):
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect((host, int(port_text)))
            return str(probe.getsockname()[0])
    return None
