"""The coordinator's configuration: flags -> this frozen object -> constructors."""

from __future__ import annotations

import hmac
import math
import os
from dataclasses import dataclass, field

from gradsync_proto import chunking

from gradsync_server import defaults
from gradsync_server.control.settings import JobSettings, NonFinitePolicy, OnFailure
from gradsync_server.dataplane.budget import outbox_pool_bytes
from gradsync_server.defaults import MIB
from gradsync_server.store.stores import parse_store_url

__all__ = ["MIB", "ServerConfig"]


@dataclass(frozen=True)
class ServerConfig:
    """Everything the coordinator needs to start.

    Attributes:
        world_size: ranks per job.
        host: interface to bind ("0.0.0.0" for all); loopback by default, since without
            a token or client certificates anything beyond loopback is refused
            unless `insecure` (protected mode, see `gradsync_server.rpc.auth_check`).
        port: TCP port; 0 picks a free one (reported in the banner).
        chunk_bytes: wire chunk size every worker must use.
        max_buffered_bytes: cap on gradient bytes held in partial reductions,
            across all jobs; beyond it uploads get RESOURCE_EXHAUSTED.
        max_outbox_bytes: cap on averaged bytes queued for one worker that is
            not reading them; beyond it that worker's stream is ended. All outboxes
            together are also capped, by `outbox_pool_bytes`.
        max_job_buffered_bytes: the most of `max_buffered_bytes` one job may hold
            (None: half), so one job cannot starve the others.
        max_checkpoint_bytes: the largest checkpoint or healing state accepted; its
            bytes count in the job's share as they arrive.
        max_connections: concurrent streams of all kinds; beyond it RESOURCE_EXHAUSTED.
        first_message_timeout_s: a stream that sends no first message (Join,
            ShardHello, ShardRegister) within this is ended with DEADLINE_EXCEEDED.
        assembly_timeout_s: a job still assembling after this is refused
            (DEADLINE_EXCEEDED), so quick Joins cannot hold job slots forever.
        max_jobs: concurrent jobs the coordinator accepts.
        shutdown_grace_s: how long SIGTERM lets running streams finish.
        heartbeat_interval_s: how often workers send a sign of life.
        heartbeat_timeout_s: silence after which a worker is declared dead.
        stall_warning_s: a step older than this logs who it waits for.
        checkpoint_store: store URL (redis://, rediss://, file:// or a path that cannot be
            mistaken for host:port; see `gradsync_server.store.stores`), or None.
        checkpoint_every: rank 0 uploads a checkpoint every this many steps (0 = on request).
        require_checkpoint: fail the job instead of training on when saving fails.
        resume: refuse to start a job from scratch: it must have a stored checkpoint.
        metrics_port: serve Prometheus metrics on this port (0 = a free one, None = off).
        on_failure: "abort" (survivors get PeerLostError) or "elastic" (go on without
            the lost rank; restarted ranks rejoin).
        min_workers: under the elastic policy, the fewest live ranks to go on with.
        max_collective_bytes: cap on one rank's input to a collective on user tensors
            (and on an all_gather's whole result); larger claims get RESOURCE_EXHAUSTED.
        shard_count: coordinator shards, the leader (shard 0) included; 1 = not sharded.
            Jobs start only once the other `shard_count - 1` have registered.
        local_shards: the leader starts (and restarts) the other shards itself, as child
            processes on this host (`--shards`); False: they register from elsewhere
            (`--wait-for-shards`).
        shard_wait_timeout_s: how long `gradsync serve` waits at start-up for every shard
            to register before it exits 1 naming the missing ones.
        tls_cert, tls_key: PEM files of the server's certificate and key (TLS); None =
            plaintext.
        tls_client_ca: PEM file of the CA that issued the clients' certificates: clients
            must present one (mTLS). None = no client certificates asked for.
        tls_ca: PEM file of the CA that issued `tls_cert`, handed to the local shard
            children (`--shards`) to verify the leader; None = `tls_cert` itself.
        token: the shared secret every call must present (loaded by the CLI from
            --token-file / $GRADSYNC_TOKEN / $GRADSYNC_TOKEN_FILE; never printed).
        shard_token: the secret shards present on `ShardLink` instead of `token`, which
            workers hold too (a worker must not pose as a shard: shards learn every
            member of every job). Required to expect remote shards (`--wait-for-shards`)
            with a token or client certificates; `--shards N` makes one for its own
            children when none is given. None = no shard may register unless the
            server has no credentials at all (loopback development).
        insecure: listen beyond loopback with neither a token nor client certificates.
        metrics_host: interface the metrics server binds; None = `host`.
        fresh_start: start new jobs at step 0 without reading their checkpoints (which are
            kept: saves never delete a checkpoint newer than the one a job resumed from).
            Without it a store that cannot be read refuses the job.
        store_timeout_s: deadline of every checkpoint store call (load at the first Join,
            save); the call runs in a worker thread, so a hung store stalls no other job.
        state_dir: the coordinator's own state directory, where it keeps each job's
            high-water mark (the newest checkpoint it had acknowledged), out of the
            store's reach (`gradsync_server.store.high_water_file`); `gradsync serve`
            defaults it to `$GRADSYNC_STATE_DIR` / `$XDG_STATE_HOME/gradsync` /
            `~/.local/state/gradsync`. None: no marks (only the chain recorded in the
            checkpoints themselves guards against a rolled-back store).
        redis_password: password for a redis:// store (from --redis-password-file or
            $GRADSYNC_REDIS_PASSWORD, so it is not in the process list); never printed.
        nonfinite: what a NaN/Inf gradient contribution does: "report" (log, metric,
            status; the step goes on, as under DDP), "abort" (the step is aborted for
            every rank, which raise NonFiniteGradientError) or "allow" (no check).
            Shards learn it from the leader (`ShardAccepted.nonfinite`).
        payload_socket: same-host local leaders move gradient payloads through their
            shared-memory segments instead of TCP (`gradsync_server.rpc.segments`);
            unsharded only. False (`--no-payload-socket`): everything over TCP.
        frame_port: where workers' Sync streams are also served as frames on a plain
            (or TLS) socket (`gradsync_server.rpc.frame_server`), which costs far less
            per message than gRPC: 0 = a free port, None = off (workers use gRPC).
            Told to workers by the FramePort RPC. Served by a leader, sharded or not
            (shards' data streams stay on gRPC); a `--lease` coordinator serves none.
        frame_port_required: a frame port that cannot be bound is an error; False
            (`--frame-port` not given) takes a free port instead, with a warning.
        host_id: this coordinator's host id, which a local leader's Join.host_id must
            equal for the payload path; "" = `gradsync_proto.host.host_id()`
            ($GRADSYNC_HOST_ID, else the machine and network namespace).
    """

    world_size: int
    host: str = defaults.HOST
    port: int = defaults.PORT
    chunk_bytes: int = defaults.CHUNK_BYTES
    max_buffered_bytes: int = defaults.MAX_BUFFERED_BYTES
    max_outbox_bytes: int = defaults.MAX_OUTBOX_BYTES
    max_job_buffered_bytes: int | None = None
    max_checkpoint_bytes: int = defaults.MAX_CHECKPOINT_BYTES
    max_connections: int = defaults.MAX_CONNECTIONS
    first_message_timeout_s: float = defaults.FIRST_MESSAGE_TIMEOUT_S
    assembly_timeout_s: float = defaults.ASSEMBLY_TIMEOUT_S
    max_jobs: int = defaults.MAX_JOBS
    shutdown_grace_s: float = defaults.SHUTDOWN_GRACE_S
    heartbeat_interval_s: float = defaults.HEARTBEAT_INTERVAL_S
    heartbeat_timeout_s: float = defaults.HEARTBEAT_TIMEOUT_S
    stall_warning_s: float = defaults.STALL_WARNING_S
    checkpoint_store: str | None = None
    checkpoint_every: int = defaults.CHECKPOINT_EVERY_STEPS
    require_checkpoint: bool = False
    resume: bool = False
    metrics_port: int | None = None
    on_failure: str = defaults.ON_FAILURE
    min_workers: int = defaults.MIN_WORKERS
    max_collective_bytes: int = defaults.MAX_COLLECTIVE_BYTES
    shard_count: int = defaults.SHARDS
    local_shards: bool = False
    shard_wait_timeout_s: float = defaults.SHARD_WAIT_TIMEOUT_S
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_client_ca: str | None = None
    tls_ca: str | None = None
    token: str | None = field(default=None, repr=False)
    shard_token: str | None = field(default=None, repr=False)
    insecure: bool = False
    metrics_host: str | None = None
    fresh_start: bool = False
    store_timeout_s: float = defaults.STORE_TIMEOUT_S
    state_dir: str | None = None
    redis_password: str | None = field(default=None, repr=False)
    nonfinite: str = defaults.NONFINITE
    payload_socket: bool = True
    frame_port: int | None = 0
    frame_port_required: bool = False
    host_id: str = ""
    lease: bool = False
    standby: bool = False
    lease_ttl_s: float = 3.0
    advertise: str | None = None

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"world size must be at least 1, got {self.world_size}")
        if self.frame_port is not None and not 0 <= self.frame_port <= 65535:
            raise ValueError(f"frame port must be in 0..65535 (or None), got {self.frame_port}")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in 0..65535, got {self.port}")
        if not 4096 <= self.chunk_bytes <= 64 * MIB:
            raise ValueError(f"chunk size must be 4 KiB..64 MiB, got {self.chunk_bytes} bytes")
        if self.max_buffered_bytes < self.chunk_bytes:
            raise ValueError(
                f"max buffered bytes ({self.max_buffered_bytes}) must be at least one chunk "
                f"({self.chunk_bytes})"
            )
        if self.max_job_buffered_bytes is not None and not (
            self.chunk_bytes <= self.max_job_buffered_bytes <= self.max_buffered_bytes
        ):
            raise ValueError(
                f"max job buffered bytes ({self.max_job_buffered_bytes}) must be between one "
                f"chunk ({self.chunk_bytes}) and max buffered bytes ({self.max_buffered_bytes})"
            )
        if self.max_outbox_bytes < self.max_message_bytes:
            raise ValueError(
                f"max outbox bytes ({self.max_outbox_bytes}) must hold at least one message "
                f"({self.max_message_bytes})"
            )
        if self.max_checkpoint_bytes < 1:
            raise ValueError(f"max checkpoint bytes must be >= 1, got {self.max_checkpoint_bytes}")
        if self.max_connections < 1:
            raise ValueError(f"max connections must be at least 1, got {self.max_connections}")
        if self.first_message_timeout_s <= 0 or self.assembly_timeout_s <= 0:
            raise ValueError(
                f"first message timeout ({self.first_message_timeout_s} s) and assembly "
                f"timeout ({self.assembly_timeout_s} s) must be > 0"
            )
        if self.max_jobs < 1:
            raise ValueError(f"max jobs must be at least 1, got {self.max_jobs}")
        if self.shutdown_grace_s < 0:
            raise ValueError(f"shutdown grace must be >= 0 s, got {self.shutdown_grace_s}")
        if not 0 < self.heartbeat_interval_s < self.heartbeat_timeout_s:
            raise ValueError(
                f"heartbeat interval ({self.heartbeat_interval_s} s) must be positive and "
                f"below the heartbeat timeout ({self.heartbeat_timeout_s} s)"
            )
        if self.nonfinite not in defaults.NONFINITE_POLICIES:
            raise ValueError(
                f"nonfinite must be one of {', '.join(defaults.NONFINITE_POLICIES)}, "
                f"got {self.nonfinite!r}"
            )
        if self.on_failure not in ("abort", "elastic"):
            raise ValueError(f"on failure must be 'abort' or 'elastic', got {self.on_failure!r}")
        if not 1 <= self.min_workers <= self.world_size:
            raise ValueError(
                f"min workers must be in 1..{self.world_size} (the world size), "
                f"got {self.min_workers}"
            )
        if self.max_collective_bytes < 1:
            raise ValueError(
                f"max collective bytes must be at least 1, got {self.max_collective_bytes}"
            )
        if self.stall_warning_s <= 0:
            raise ValueError(f"stall warning must be > 0 s, got {self.stall_warning_s}")
        if self.checkpoint_every < 0:
            raise ValueError(f"checkpoint every must be >= 0 steps, got {self.checkpoint_every}")
        if self.shard_count < 1:
            raise ValueError(f"shard count must be at least 1, got {self.shard_count}")
        check_shard_token(self.token, self.shard_token)
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
        if self.shard_wait_timeout_s <= 0:
            raise ValueError(f"shard wait timeout must be > 0 s, got {self.shard_wait_timeout_s}")
        if self.checkpoint_store is not None:
            location = parse_store_url(self.checkpoint_store)  # an ambiguous URL: refused now
            if location.kind == "file" and self.state_dir is not None:
                _check_state_dir_outside(self.state_dir, location.target)
        if not self.store_timeout_s > 0:
            raise ValueError(f"store timeout must be > 0 s, got {self.store_timeout_s}")
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

    def job_settings(self) -> JobSettings:
        """What every job of this coordinator is configured with."""
        return JobSettings(
            world_size=self.world_size,
            chunk_bytes=self.chunk_bytes,
            max_message_bytes=self.max_message_bytes,
            heartbeat_interval_s=self.heartbeat_interval_s,
            checkpoint_every=self.checkpoint_every,
            on_failure=OnFailure(self.on_failure),
            min_workers=self.min_workers,
            max_collective_bytes=self.max_collective_bytes,
            shard_count=self.shard_count,
            nonfinite=NonFinitePolicy(self.nonfinite),
            max_checkpoint_bytes=self.max_checkpoint_bytes,
        )

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
        """gRPC message size limit: one chunk plus room for the header fields."""
        return self.chunk_bytes + chunking.HEADER_SLACK_BYTES


def check_shard_token(token: str | None, shard_token: str | None) -> None:
    """Refuse a shard token equal to the workers' token (then it tells nobody apart).

    Raises:
        ValueError: the two are the same secret.
    """
    if (
        token is not None
        and shard_token is not None
        and hmac.compare_digest(token.encode(), shard_token.encode())
    ):
        raise ValueError(
            "the shard token is the same as the workers' token: a shard token must be a "
            "secret the workers do not hold (make one with `gradsync token FILE`)"
        )


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
