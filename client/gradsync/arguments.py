"""The flags of the `gradsync` command, one subparser per subcommand.

Kept apart from `gradsync.cli` (which runs the subcommands) because the flag
list is long and is read on its own: by `--help`, by the README and by the
tests that go through every flag. Each flag's type (`gradsync.flags`) checks
its whole range, so a bad value exits 2 naming the flag before anything
starts. Env-var defaults are read when the parser is built (at run time,
never at import); argparse checks a string default with the flag's type, so
a bad $RANK is reported like a bad --rank.
"""

from __future__ import annotations

import argparse
import os

from gradsync import __version__, flags
from gradsync.config import ENV_COORDINATOR, ENV_JOB_ID, ENV_RANK, ENV_WORLD_SIZE
from gradsync.protocol import auth, defaults
from gradsync.protocol.defaults import MIB

#: The benchmark suites `gradsync bench --suites` chooses from.
BENCH_SUITES = ("loopback", "train", "netns")
#: The coordinator layouts of the netns suite (`gradsync bench --layouts`).
BENCH_LAYOUTS = ("single", "dedicated", "colocated")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser (exposed for tests and docs)."""
    parser = argparse.ArgumentParser(
        prog="gradsync", description="Data-parallel gradient synchronization over gRPC."
    )
    parser.add_argument("--version", action="version", version=f"gradsync {__version__}")
    parser.add_argument(
        "--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"]
    )
    commands = parser.add_subparsers(dest="command", required=True)

    serve = commands.add_parser("serve", help="run the coordinator")
    serve.set_defaults(command_parser=serve)
    serve.add_argument("--world-size", type=flags.positive_int, required=True, help="ranks per job")
    serve.add_argument(
        "--host",
        type=flags.non_empty,
        default=defaults.HOST,
        help="interface to bind (default %(default)s; 0.0.0.0 for all, which needs a token, "
        "client certificates or --insecure)",
    )
    serve.add_argument(
        "--port",
        type=flags.port,
        default=defaults.PORT,
        help="TCP port; 0 picks a free one and prints it (default %(default)s)",
    )
    serve.add_argument(
        "--chunk-mb",
        type=flags.chunk_mb,
        default=None,
        help=f"wire chunk size in MiB (default {defaults.CHUNK_BYTES / MIB:g}; "
        f"{defaults.SHARDED_CHUNK_BYTES / MIB:g} with --shards or --wait-for-shards)",
    )
    serve.add_argument(
        "--max-buffered-mb",
        type=flags.positive_number,
        default=defaults.MAX_BUFFERED_BYTES / MIB,
        help="cap on gradient bytes held in partial reductions (default %(default)g)",
    )
    serve.add_argument(
        "--max-job-buffered-mb",
        type=flags.positive_number,
        default=None,
        help="the most of --max-buffered-mb one job may hold, so that one job cannot starve "
        "the others (default: half of --max-buffered-mb)",
    )
    serve.add_argument(
        "--max-outbox-mb",
        type=flags.positive_number,
        default=defaults.MAX_OUTBOX_BYTES / MIB,
        help="cap on results queued for one worker that does not read them; beyond it the "
        "worker is dropped with RESOURCE_EXHAUSTED (default %(default)g)",
    )
    serve.add_argument(
        "--max-checkpoint-mb",
        type=flags.positive_number,
        default=defaults.MAX_CHECKPOINT_BYTES / MIB,
        help="largest checkpoint (or rejoining rank's state) accepted (default %(default)g)",
    )
    serve.add_argument(
        "--max-connections",
        type=flags.positive_int,
        default=defaults.MAX_CONNECTIONS,
        help="concurrent streams of all kinds; beyond it RESOURCE_EXHAUSTED (default %(default)s)",
    )
    serve.add_argument(
        "--first-message-timeout-s",
        type=flags.positive_number,
        default=defaults.FIRST_MESSAGE_TIMEOUT_S,
        help="a stream that sends no Join (or shard hello) within this many seconds is "
        "ended with DEADLINE_EXCEEDED (default %(default)g)",
    )
    serve.add_argument(
        "--assembly-timeout-s",
        type=flags.positive_number,
        default=defaults.ASSEMBLY_TIMEOUT_S,
        help="a job whose ranks have not all joined within this many seconds is refused, "
        "freeing its slot (default %(default)g)",
    )
    serve.add_argument(
        "--max-jobs",
        type=flags.positive_int,
        default=defaults.MAX_JOBS,
        help="concurrent jobs accepted (default %(default)s)",
    )
    serve.add_argument(
        "--shutdown-grace-s",
        type=flags.seconds_or_zero,
        default=defaults.SHUTDOWN_GRACE_S,
        help="how long SIGTERM lets running streams finish (default %(default)g)",
    )
    serve.add_argument(
        "--heartbeat-interval",
        type=flags.seconds,
        default=defaults.HEARTBEAT_INTERVAL_S,
        help="seconds between worker heartbeats (default %(default)g)",
    )
    serve.add_argument(
        "--heartbeat-timeout",
        type=flags.seconds,
        default=defaults.HEARTBEAT_TIMEOUT_S,
        help="seconds of silence before a worker is declared dead (default %(default)g)",
    )
    serve.add_argument(
        "--stall-warning",
        type=flags.seconds,
        default=defaults.STALL_WARNING_S,
        help="log who a step waits for once it is this many seconds old (default %(default)g)",
    )
    serve.add_argument(
        "--checkpoint-store",
        default=None,
        help="where checkpoints go: redis://host:port/db, rediss://..., file:///dir or a "
        "directory that does not look like host:port (default: none)",
    )
    serve.add_argument(
        "--checkpoint-every",
        type=flags.integer(0),
        default=defaults.CHECKPOINT_EVERY_STEPS,
        help="rank 0 uploads a checkpoint every K steps (default %(default)s; 0: on request)",
    )
    serve.add_argument(
        "--require-checkpoint",
        action="store_true",
        help="fail the job when a checkpoint cannot be saved, instead of training on and retrying",
    )
    serve.add_argument(
        "--resume", action="store_true", help="refuse to start a job that has no stored checkpoint"
    )
    serve.add_argument(
        "--fresh-start",
        action="store_true",
        help="start every job at step 0 without reading its checkpoints (which are kept); "
        "without it a store that cannot be read refuses the job",
    )
    serve.add_argument(
        "--store-timeout",
        type=flags.seconds,
        default=defaults.STORE_TIMEOUT_S,
        help="deadline of each checkpoint store call; a hung store fails it, other jobs "
        "train on (default %(default)gs)",
    )
    serve.add_argument(
        "--redis-password-file",
        default=None,
        help=f"file holding the password of a redis:// --checkpoint-store (or set "
        f"${defaults.ENV_REDIS_PASSWORD}); keeps it out of the URL and the process list",
    )
    serve.add_argument(
        "--metrics-port",
        type=flags.port,
        default=None,
        help="serve Prometheus metrics on this port (0 = a free one; default: off)",
    )
    serve.add_argument(
        "--on-failure",
        choices=["abort", "elastic"],
        default=defaults.ON_FAILURE,
        help="when a worker is lost: abort the step for everyone, or go on with the live "
        "ranks and let restarted ranks rejoin (default %(default)s)",
    )
    serve.add_argument(
        "--min-workers",
        type=flags.positive_int,
        default=defaults.MIN_WORKERS,
        help="elastic: the fewest live workers to go on with (default %(default)s)",
    )
    serve.add_argument(
        "--nonfinite",
        choices=defaults.NONFINITE_POLICIES,
        default=defaults.NONFINITE,
        help="a rank's NaN/Inf gradient: report it (log, metric, status; the step goes on "
        "as under DDP), abort the step for every rank (NonFiniteGradientError), or allow it "
        "unchecked, e.g. for GradScaler users (default %(default)s)",
    )
    serve.add_argument(
        "--max-collective-mb",
        type=flags.positive_number,
        default=defaults.MAX_COLLECTIVE_BYTES / MIB,
        help="cap on one rank's input to a collective (all_reduce, broadcast, ...) and on an "
        "all_gather's result, in MiB (default %(default)g)",
    )
    serve.add_argument(
        "--shards",
        type=flags.positive_int,
        default=None,
        help="coordinator shards on this host, this leader included: it starts S-1 "
        "`gradsync shard` processes on ports PORT+1.. and restarts any that dies (default 1)",
    )
    serve.add_argument(
        "--wait-for-shards",
        type=flags.integer(0),
        default=None,
        help="K shards run elsewhere (`gradsync shard --leader HOST:PORT`): jobs start once "
        "all K have registered (default 0)",
    )
    serve.add_argument(
        "--shard-wait-timeout",
        type=flags.seconds,
        default=defaults.SHARD_WAIT_TIMEOUT_S,
        help="seconds to wait at start-up for every shard to register before exiting 1 "
        "(default %(default)g)",
    )
    _add_server_security_flags(serve, "the coordinator")
    serve.add_argument(
        "--tls-ca",
        default=None,
        help="PEM CA that issued --tls-cert, given to the local shards of --shards to "
        "verify this leader (default: --tls-cert itself)",
    )

    shard = commands.add_parser(
        "shard", help="run a coordinator shard that registers with a leader (`serve`)"
    )
    shard.set_defaults(command_parser=shard)
    shard.add_argument(
        "--leader", type=flags.coordinator, required=True, help="the leader's host:port"
    )
    shard.add_argument(
        "--host",
        type=flags.non_empty,
        default="127.0.0.1",
        help="interface to bind (default %(default)s; 0.0.0.0 for all)",
    )
    shard.add_argument(
        "--port",
        type=flags.port,
        default=defaults.PORT,
        help="TCP port workers reach the shard at; 0 picks a free one (default %(default)s)",
    )
    shard.add_argument(
        "--advertise",
        type=flags.non_empty,
        default=None,
        help="host:port workers reach the shard at (default HOST:PORT, or ':PORT' = the "
        "host they reach the leader at when --host is 0.0.0.0)",
    )
    shard.add_argument(
        "--chunk-mb",
        type=flags.chunk_mb,
        default=None,
        help="wire chunk size in MiB; if given, must equal the leader's (default: the leader's)",
    )
    shard.add_argument(
        "--max-buffered-mb",
        type=flags.positive_number,
        default=defaults.MAX_BUFFERED_BYTES / MIB,
        help="cap on gradient bytes held in partial reductions (default %(default)g)",
    )
    shard.add_argument(
        "--metrics-port",
        type=flags.port,
        default=None,
        help="serve Prometheus metrics on this port (0 = a free one; default: off)",
    )
    _add_server_security_flags(shard, "the shard")
    shard.add_argument(
        "--tls-ca",
        default=None,
        help="PEM CA that issued the leader's certificate: reach the leader over TLS, "
        "presenting --tls-cert if it asks for a client certificate (default: plaintext)",
    )
    shard.add_argument(
        "--log-level",
        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
        default=argparse.SUPPRESS,  # keeps `gradsync --log-level X shard` working too
        help="as `gradsync --log-level` (default INFO)",
    )

    status = commands.add_parser("status", help="show jobs, membership, progress and late ranks")
    status.set_defaults(command_parser=status)
    status.add_argument(
        "--coordinator",
        type=flags.coordinator,
        default=os.environ.get(ENV_COORDINATOR),
        help=f"coordinator host:port (default ${ENV_COORDINATOR})",
    )
    status.add_argument("--job-id", default="", help="only this job")
    status.add_argument("--json", action="store_true", help="machine-readable output")
    status.add_argument(
        "--timeout-s",
        type=flags.seconds,
        default=defaults.STATUS_TIMEOUT_S,
        help="bound on the query (default %(default)g)",
    )
    add_client_security_flags(status)

    worker = commands.add_parser("worker", help="run the example training job as one rank")
    worker.set_defaults(command_parser=worker)
    worker.add_argument(
        "--coordinator",
        type=flags.coordinator,
        default=os.environ.get(ENV_COORDINATOR),
        help=f"coordinator host:port (default ${ENV_COORDINATOR})",
    )
    worker.add_argument(
        "--rank",
        type=flags.integer(0),
        default=os.environ.get(ENV_RANK),
        help=f"this worker's rank (default ${ENV_RANK})",
    )
    worker.add_argument(
        "--world-size",
        type=flags.positive_int,
        default=os.environ.get(ENV_WORLD_SIZE),
        help=f"number of ranks (default ${ENV_WORLD_SIZE})",
    )
    worker.add_argument(
        "--job-id",
        type=flags.non_empty,
        default=os.environ.get(ENV_JOB_ID),
        help=f"job id shared by all ranks (default ${ENV_JOB_ID} or {defaults.JOB_ID!r})",
    )
    _add_training_flags(worker)
    worker.add_argument(
        "--init-seed",
        type=flags.integer(0, 2**63 - 1),
        default=None,
        help="seed of this rank's initial weights (default 1000 + rank; rank 0's "
        "weights are broadcast to all)",
    )
    worker.add_argument(
        "--save",
        type=flags.non_empty,
        default=None,
        help="write the final parameters to this .npz file ({rank} is replaced by the rank)",
    )
    worker.add_argument("--no-progress", action="store_true", help="no progress bar on rank 0")
    worker.add_argument(
        "--log-every-steps",
        type=flags.integer(0),
        default=defaults.STEP_LOG_EVERY_STEPS,
        help="rank 0 logs step time, exposed sync time and bytes every N steps at INFO "
        "(default %(default)s; 0 = never)",
    )
    worker.add_argument(
        "--metrics-port",
        type=flags.port,
        default=None,
        help="serve this worker's Prometheus metrics on PORT + $LOCAL_RANK "
        "(default $GRADSYNC_METRICS_PORT; 0 = a free port; unset = off)",
    )
    worker.add_argument(
        "--metrics-host",
        type=flags.non_empty,
        default=None,
        help="interface the metrics endpoint binds (default $GRADSYNC_METRICS_HOST or "
        f"{defaults.WORKER_METRICS_HOST}; 0.0.0.0 for a scraper on another host)",
    )
    add_client_security_flags(worker)
    worker.add_argument(
        "--trace",
        type=flags.output_file,
        default=None,
        help="write a Chrome trace (Perfetto) of every step to this file",
    )

    token = commands.add_parser(
        "token", help="write a new random token to a file (mode 0600) for --token-file"
    )
    token.set_defaults(command_parser=token)
    token.add_argument("file", help="where to write it")
    token.add_argument(
        "--keep",
        action="store_true",
        help="leave a file that already holds a usable token as it is (compose's init step)",
    )

    demo = commands.add_parser(
        "demo", help="start a coordinator and local workers, train, check against one process"
    )
    demo.set_defaults(command_parser=demo)
    demo.add_argument(
        "--workers",
        type=flags.positive_int,
        default=3,
        help="number of worker processes (default %(default)s)",
    )
    _add_training_flags(demo)

    bench = commands.add_parser(
        "bench", help="benchmark against gloo / torchrun + DDP and the network's bound"
    )
    bench.set_defaults(command_parser=bench)
    bench.add_argument("--quick", action="store_true", help="a run of under two minutes")
    bench.add_argument(
        "--out",
        type=flags.output_folder,
        default="bench/results",
        help="where latest.json / .md / .png go (default bench/results)",
    )
    bench.add_argument(
        "--suites",
        type=flags.choice_list(BENCH_SUITES),
        default=",".join(BENCH_SUITES),
        help="comma-separated subset of %(default)s",
    )
    bench.add_argument(
        "--sizes-mb",
        type=flags.number_list(flags.positive_number),
        default=None,
        help="override: sync sizes, e.g. 1,25",
    )
    bench.add_argument(
        "--worlds",
        type=flags.number_list(flags.positive_int),
        default=None,
        help="override: world sizes, e.g. 2,4",
    )
    bench.add_argument(
        "--reps", type=flags.positive_int, default=None, help="override: repetitions"
    )
    bench.add_argument(
        "--train-model-mb",
        type=flags.positive_number,
        default=None,
        help="override: model size of the training suite",
    )
    bench.add_argument(
        "--train-steps",
        type=flags.positive_int,
        default=None,
        help="override: timed steps of the training suite",
    )
    bench.add_argument(
        "--netns-rate-mbit",
        type=flags.positive_number,
        default=None,
        help="override: emulated link bandwidth (default 200)",
    )
    bench.add_argument(
        "--layouts",
        type=flags.choice_list(BENCH_LAYOUTS),
        default=None,
        help="netns suite: coordinator layouts, a subset of "
        f"{','.join(BENCH_LAYOUTS)} (default: all; single with --quick)",
    )
    bench.add_argument(
        "--shards",
        type=flags.number_list(flags.positive_int),
        default=None,
        help="shard counts S: the netns dedicated and colocated layouts (default S = W), "
        "and loopback rows with `serve --shards S` beside the unsharded ones",
    )
    return parser


def add_client_security_flags(parser: argparse.ArgumentParser) -> None:
    """--tls-ca, --tls-cert, --tls-key and --token-file (defaults from the environment).

    Shared by every command that calls a coordinator or shard (worker, status,
    shard, this probe). There is no flag for the token itself: a value on the
    command line is visible to every user of the host in the process list.
    """
    parser.add_argument(
        "--tls-ca",
        default=None,
        help="PEM CA that issued the server's certificate: connect over TLS "
        "(default $GRADSYNC_TLS_CA; unset = plaintext)",
    )
    parser.add_argument(
        "--tls-cert",
        default=None,
        help="PEM client certificate, for servers that require one (mTLS) "
        "(default $GRADSYNC_TLS_CERT)",
    )
    parser.add_argument(
        "--tls-key", default=None, help="PEM key of --tls-cert (default $GRADSYNC_TLS_KEY)"
    )
    parser.add_argument(
        "--token-file",
        default=None,
        help=f"file holding the shared token (default ${auth.ENV_TOKEN_FILE}, or the token "
        f"itself in ${auth.ENV_TOKEN})",
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


def _add_training_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--epochs", type=flags.positive_int, default=5, help="epochs (default %(default)s)"
    )
    parser.add_argument(
        "--batch-size",
        type=flags.positive_int,
        default=32,
        help="samples per rank per step (default %(default)s)",
    )
    parser.add_argument(
        "--lr",
        type=flags.positive_number,
        default=0.5,
        help="SGD learning rate (default %(default)s)",
    )
    parser.add_argument(
        "--timeout-s",
        type=flags.seconds,
        default=defaults.EXAMPLE_TIMEOUT_S,
        help="bound on every wait for other ranks (default %(default)g)",
    )
