"""The flags of the coordinator's own subcommands, `gradsync serve` and `gradsync shard`.

They live with the coordinator, not with the worker, because they change
with it: limits, checkpointing, elasticity, sharding, and the TLS / token /
protected-mode flags that only a listening process has. The `gradsync`
command (`gradsync.arguments.build_parser`) still owns the parser and adds
these to its `serve` and `shard` subparsers, importing this module only when
it builds the parser, as it imports the rest of the server only to run it.
Each flag's type (`gradsync_proto.flags`, shared with the worker's flags, as
the server imports nothing of the client) checks its whole range, so a bad
value exits 2 naming the flag.
"""

from __future__ import annotations

import argparse

from gradsync_proto import auth, flags

from gradsync_server import defaults
from gradsync_server.defaults import MIB


def add_serve_flags(parser: argparse.ArgumentParser) -> None:
    """The flags of `gradsync serve` (the coordinator, or a sharded job's leader)."""
    parser.add_argument(
        "--world-size", type=flags.positive_int, required=True, help="ranks per job"
    )
    parser.add_argument(
        "--host",
        type=flags.non_empty,
        default=defaults.HOST,
        help="interface to bind (default %(default)s; 0.0.0.0 for all, which needs a token, "
        "client certificates or --insecure)",
    )
    parser.add_argument(
        "--port",
        type=flags.port,
        default=defaults.PORT,
        help="TCP port; 0 picks a free one and prints it (default %(default)s)",
    )
    parser.add_argument(
        "--chunk-mb",
        type=flags.chunk_mb,
        default=None,
        help=f"wire chunk size in MiB (default {defaults.CHUNK_BYTES / MIB:g}; "
        f"{defaults.SHARDED_CHUNK_BYTES / MIB:g} with --shards or --wait-for-shards)",
    )
    parser.add_argument(
        "--max-buffered-mb",
        type=flags.positive_number,
        default=defaults.MAX_BUFFERED_BYTES / MIB,
        help="cap on gradient bytes held in partial reductions (default %(default)g)",
    )
    parser.add_argument(
        "--max-job-buffered-mb",
        type=flags.positive_number,
        default=None,
        help="the most of --max-buffered-mb one job may hold, so that one job cannot starve "
        "the others (default: half of --max-buffered-mb)",
    )
    _add_peer_limit_flags(parser, "streams of all kinds", "Join (or shard hello)")
    parser.add_argument(
        "--max-checkpoint-mb",
        type=flags.positive_number,
        default=defaults.MAX_CHECKPOINT_BYTES / MIB,
        help="largest checkpoint (or rejoining rank's state) accepted (default %(default)g)",
    )
    parser.add_argument(
        "--assembly-timeout-s",
        type=flags.positive_number,
        default=defaults.ASSEMBLY_TIMEOUT_S,
        help="a job whose ranks have not all joined within this many seconds is refused, "
        "freeing its slot (default %(default)g)",
    )
    parser.add_argument(
        "--max-jobs",
        type=flags.positive_int,
        default=defaults.MAX_JOBS,
        help="concurrent jobs accepted (default %(default)s)",
    )
    parser.add_argument(
        "--shutdown-grace-s",
        type=flags.seconds_or_zero,
        default=defaults.SHUTDOWN_GRACE_S,
        help="how long SIGTERM lets running streams finish (default %(default)g)",
    )
    parser.add_argument(
        "--heartbeat-interval",
        type=flags.seconds,
        default=defaults.HEARTBEAT_INTERVAL_S,
        help="seconds between worker heartbeats (default %(default)g)",
    )
    parser.add_argument(
        "--heartbeat-timeout",
        type=flags.seconds,
        default=defaults.HEARTBEAT_TIMEOUT_S,
        help="seconds of silence before a worker is declared dead (default %(default)g)",
    )
    parser.add_argument(
        "--stall-warning",
        type=flags.seconds,
        default=defaults.STALL_WARNING_S,
        help="log who a step waits for once it is this many seconds old (default %(default)g)",
    )
    parser.add_argument(
        "--checkpoint-store",
        default=None,
        help="where checkpoints go: redis://host:port/db, rediss://..., file:///dir or a "
        "directory that does not look like host:port (default: none)",
    )
    parser.add_argument(
        "--lease",
        action="store_true",
        help="take part in the Redis lease of a redis:// --checkpoint-store: serve only "
        "while holding it (another coordinator with --lease/--standby takes over)",
    )
    parser.add_argument(
        "--standby",
        action="store_true",
        help="start as a standby (implies --lease): answer UNAVAILABLE until the active "
        "coordinator's lease expires, then take over and resume the job from the store",
    )
    parser.add_argument(
        "--lease-ttl-s",
        type=flags.seconds,
        default=3.0,
        help="lease lifetime after each renewal (renewed every ttl/3; default %(default)g)",
    )
    parser.add_argument(
        "--advertise",
        default=None,
        help="host:port workers should use for this coordinator, shown by a standby "
        "(default: --host:--port)",
    )
    parser.add_argument(
        "--checkpoint-every",
        type=flags.integer(0),
        default=defaults.CHECKPOINT_EVERY_STEPS,
        help="rank 0 uploads a checkpoint every K steps (default %(default)s; 0: on request)",
    )
    parser.add_argument(
        "--require-checkpoint",
        action="store_true",
        help="fail the job when a checkpoint cannot be saved, instead of training on and retrying",
    )
    parser.add_argument(
        "--resume", action="store_true", help="refuse to start a job that has no stored checkpoint"
    )
    parser.add_argument(
        "--fresh-start",
        action="store_true",
        help="start every job at step 0 without reading its checkpoints (which are kept); "
        "without it a store that cannot be read refuses the job",
    )
    parser.add_argument(
        "--state-dir",
        default=None,
        help="the coordinator's own directory for each job's high-water mark (its newest "
        "acknowledged checkpoint), so that a rolled-back store is refused; keep it off the "
        "store's disk (default $GRADSYNC_STATE_DIR, else $XDG_STATE_HOME/gradsync, else "
        "~/.local/state/gradsync)",
    )
    parser.add_argument(
        "--store-timeout",
        type=flags.seconds,
        default=defaults.STORE_TIMEOUT_S,
        help="deadline of each checkpoint store call; a hung store fails it, other jobs "
        "train on (default %(default)gs)",
    )
    parser.add_argument(
        "--redis-password-file",
        default=None,
        help=f"file holding the password of a redis:// --checkpoint-store (or set "
        f"${defaults.ENV_REDIS_PASSWORD}); keeps it out of the URL and the process list",
    )
    parser.add_argument(
        "--metrics-port",
        type=flags.port,
        default=None,
        help="serve Prometheus metrics on this port (0 = a free one; default: off)",
    )
    parser.add_argument(
        "--on-failure",
        choices=["abort", "elastic"],
        default=defaults.ON_FAILURE,
        help="when a worker is lost: abort the step for everyone, or go on with the live "
        "ranks and let restarted ranks rejoin (default %(default)s)",
    )
    parser.add_argument(
        "--min-workers",
        type=flags.positive_int,
        default=defaults.MIN_WORKERS,
        help="elastic: the fewest live workers to go on with (default %(default)s)",
    )
    parser.add_argument(
        "--frame-port",
        type=int,
        default=None,
        help="serve workers' Sync streams also as frames on this TCP port (same host, TLS "
        "and token as --port), which costs far less per message than gRPC; workers find it "
        "through the gRPC port and fall back to gRPC where it is unreachable (default: "
        "--port + 1, --port + S with --shards S, or a free port when that is taken or "
        "--port is 0; -1 = off)",
    )
    parser.add_argument(
        "--no-payload-socket",
        dest="payload_socket",
        action="store_false",
        help="move every gradient payload over TCP, also those of local leaders on this "
        "coordinator's host (which otherwise go through their shared memory; for debugging)",
    )
    parser.add_argument(
        "--nonfinite",
        choices=defaults.NONFINITE_POLICIES,
        default=defaults.NONFINITE,
        help="a rank's NaN/Inf gradient: report it (log, metric, status; the step goes on "
        "as under DDP), abort the step for every rank (NonFiniteGradientError), or allow it "
        "unchecked, e.g. for GradScaler users (default %(default)s)",
    )
    parser.add_argument(
        "--max-collective-mb",
        type=flags.positive_number,
        default=defaults.MAX_COLLECTIVE_BYTES / MIB,
        help="cap on one rank's input to a collective (all_reduce, broadcast, ...) and on an "
        "all_gather's result, in MiB (default %(default)g)",
    )
    parser.add_argument(
        "--shards",
        type=flags.positive_int,
        default=None,
        help="coordinator shards on this host, this leader included: it starts S-1 "
        "`gradsync shard` processes on ports PORT+1.. and restarts any that dies (default 1)",
    )
    parser.add_argument(
        "--wait-for-shards",
        type=flags.integer(0),
        default=None,
        help="K shards run elsewhere (`gradsync shard --leader HOST:PORT`): jobs start once "
        "all K have registered (default 0)",
    )
    parser.add_argument(
        "--shard-wait-timeout",
        type=flags.seconds,
        default=defaults.SHARD_WAIT_TIMEOUT_S,
        help="seconds to wait at start-up for every shard to register before exiting 1 "
        "(default %(default)g)",
    )
    _add_server_security_flags(parser, "the coordinator")
    parser.add_argument(
        "--tls-ca",
        default=None,
        help="PEM CA that issued --tls-cert, given to the local shards of --shards to "
        "verify this leader (default: --tls-cert itself)",
    )


def add_shard_flags(parser: argparse.ArgumentParser) -> None:
    """The flags of `gradsync shard` (a coordinator shard that registers with a leader)."""
    parser.add_argument(
        "--leader",
        type=flags.coordinator,
        required=True,
        help="the leader's host:port, or a comma list: an active leader and its standbys (--lease)",
    )
    parser.add_argument(
        "--host",
        type=flags.non_empty,
        default="127.0.0.1",
        help="interface to bind (default %(default)s; 0.0.0.0 for all)",
    )
    parser.add_argument(
        "--port",
        type=flags.port,
        default=defaults.PORT,
        help="TCP port workers reach the shard at; 0 picks a free one (default %(default)s)",
    )
    parser.add_argument(
        "--advertise",
        type=flags.non_empty,
        default=None,
        help="host:port workers reach the shard at (default HOST:PORT, or ':PORT' = the "
        "host they reach the leader at when --host is 0.0.0.0)",
    )
    parser.add_argument(
        "--chunk-mb",
        type=flags.chunk_mb,
        default=None,
        help="wire chunk size in MiB; if given, must equal the leader's (default: the leader's)",
    )
    parser.add_argument(
        "--max-buffered-mb",
        type=flags.positive_number,
        default=defaults.MAX_BUFFERED_BYTES / MIB,
        help="cap on gradient bytes held in partial reductions (default %(default)g)",
    )
    parser.add_argument(
        "--checkpoint-store",
        default=None,
        help="where this shard saves its range of every DiLoCo job's outer state (the "
        "leader's --checkpoint-store, which `serve --shards` passes on; password from "
        f"--redis-password-file or ${defaults.ENV_REDIS_PASSWORD}; default: none)",
    )
    parser.add_argument(
        "--store-timeout",
        type=flags.seconds,
        default=defaults.STORE_TIMEOUT_S,
        help="deadline of each store call (default %(default)gs)",
    )
    parser.add_argument(
        "--redis-password-file",
        default=None,
        help=f"file holding the password of a redis:// --checkpoint-store (or set "
        f"${defaults.ENV_REDIS_PASSWORD})",
    )
    _add_peer_limit_flags(parser, "data streams", "ShardHello")
    parser.add_argument(
        "--parent-pid",
        type=int,
        default=None,
        help="stop (as on SIGTERM) when the process PID is no longer this shard's parent; "
        "`serve --shards` passes its own pid so its shards never outlive it (default: off)",
    )
    parser.add_argument(
        "--metrics-port",
        type=flags.port,
        default=None,
        help="serve Prometheus metrics on this port (0 = a free one; default: off)",
    )
    _add_server_security_flags(parser, "the shard")
    parser.add_argument(
        "--tls-ca",
        default=None,
        help="PEM CA that issued the leader's certificate: reach the leader over TLS, "
        "presenting --tls-cert if it asks for a client certificate (default: plaintext)",
    )
    parser.add_argument(
        "--log-level",
        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
        default=argparse.SUPPRESS,  # keeps `gradsync --log-level X shard` working too
        help="as `gradsync --log-level` (default INFO)",
    )


def _add_peer_limit_flags(parser: argparse.ArgumentParser, streams: str, first: str) -> None:
    """The limits on slow or silent peers that `serve` and `shard` share (issue 11)."""
    parser.add_argument(
        "--max-outbox-mb",
        type=flags.positive_number,
        default=defaults.MAX_OUTBOX_BYTES / MIB,
        help="cap on results queued for one worker that does not read them; beyond it the "
        "worker is dropped with RESOURCE_EXHAUSTED (default %(default)g)",
    )
    parser.add_argument(
        "--max-connections",
        type=flags.positive_int,
        default=defaults.MAX_CONNECTIONS,
        help=f"concurrent {streams}; beyond it RESOURCE_EXHAUSTED (default %(default)s)",
    )
    parser.add_argument(
        "--first-message-timeout-s",
        type=flags.positive_number,
        default=defaults.FIRST_MESSAGE_TIMEOUT_S,
        help=f"a stream that sends no {first} within this many seconds is ended with "
        "DEADLINE_EXCEEDED (default %(default)g)",
    )


def _add_server_security_flags(parser: argparse.ArgumentParser, who: str) -> None:
    """TLS, token, protected-mode and metrics-interface flags of `serve` and `shard`."""
    parser.add_argument(
        "--tls-cert", default=None, help=f"PEM certificate of {who}: serve over TLS"
    )
    parser.add_argument("--tls-key", default=None, help="PEM private key of --tls-cert")
    parser.add_argument(
        "--tls-client-ca",
        default=None,
        help="PEM CA of the client certificates: every caller must present one (mTLS)",
    )
    parser.add_argument(
        "--token-file",
        default=None,
        help=f"file holding the shared token every call must present (default "
        f"${auth.ENV_TOKEN_FILE}, or the token itself in ${auth.ENV_TOKEN}; "
        "make one with `gradsync token FILE`)",
    )
    parser.add_argument(
        "--shard-token-file",
        default=None,
        help=f"file holding the shard token, which shards present to their leader instead of "
        f"the workers' token (default ${auth.ENV_SHARD_TOKEN_FILE}, or the token itself in "
        f"${auth.ENV_SHARD_TOKEN}); needed by --wait-for-shards and by every shard when a "
        "token or client certificates are set; --shards makes one for its own shards",
    )
    parser.add_argument(
        "--insecure",
        action="store_true",
        help="listen beyond loopback with neither a token nor client certificates "
        "(trusted networks only)",
    )
    parser.add_argument(
        "--metrics-host",
        type=flags.non_empty,
        default=None,
        help="interface the metrics server binds (default: --host)",
    )


def frame_port_of(flag: int | None, port: int, local_shards: int = 1) -> int | None:
    """The frame port `--frame-port` asks for: -1 = off (None); unset = the first port after
    `port` that `--shards S` leaves free (`port` + S; `port` + 1 unsharded), or 0 (a free
    one) with `--port 0` or past 65535."""
    if flag is None:
        candidate = port + max(1, local_shards)
        return candidate if port > 0 and candidate <= 65535 else 0
    if flag < 0:
        return None
    return flag
