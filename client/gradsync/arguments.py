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
from typing import TYPE_CHECKING

from gradsync_proto import auth

from gradsync import __version__, defaults, flags
from gradsync.config import ENV_COORDINATOR, ENV_JOB_ID, ENV_RANK, ENV_WORLD_SIZE

if TYPE_CHECKING:
    from gradsync_proto.net.channels import ChannelSecurity

#: The choices of --log-level (`gradsync --log-level`, and `gradsync shard --log-level`).
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
#: The benchmark suites `gradsync bench --suites` chooses from.
BENCH_SUITES = (
    "loopback",
    "train",
    "netns",
    "latency",
    "wan",
    "heal",
    "churn",
    "churn-torchft",
)
#: The suites `gradsync bench` runs without --suites (wan, 20-25 minutes, heal, and churn and
#: churn-torchft, two runs of --churn-duration-s each, only on request).
BENCH_DEFAULT_SUITES = BENCH_SUITES[:4]
#: The methods of the wan suite (`gradsync bench --wan-methods`; gradsync_bench.wan_worker).
BENCH_WAN_METHODS = (
    "nosync",
    "ddp-gloo",
    "gradsync-ddp",
    "diloco-h10-fp32",
    "diloco-h10-int8",
    "diloco-h50-fp32",
    "diloco-h50-int8",
    "streaming-f4-int8",
    "diloco-h50-int8x2",
    "streaming-f4-int8x2",
    "diloco-h100-int8x2",
    "diloco-h50-topk2",
    "torchft-h50-fp32",
    "torchft-h10-fp32",
)
#: The failures of the churn suite (`gradsync bench --churn-kinds`; gradsync_bench.churn_schedule).
BENCH_CHURN_KINDS = (
    "worker-kill",
    "worker-stop",
    "coordinator-kill",
    "shard-kill",
    "redis-restart",
)
#: The coordinator layouts of the netns suite (`gradsync bench --layouts`).
BENCH_LAYOUTS = ("single", "dedicated", "colocated")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser (exposed for tests and docs).

    The flags of `serve` and `shard` are declared on the coordinator's config
    (`gradsync_server.config.CoordinatorConfig`), imported here rather than at
    the top so that importing the client imports no server module.
    """
    from gradsync_server.config import CoordinatorConfig, Role

    parser = argparse.ArgumentParser(
        prog="gradsync", description="Data-parallel gradient synchronization over gRPC."
    )
    parser.add_argument("--version", action="version", version=f"gradsync {__version__}")
    parser.add_argument("--log-level", default="INFO", choices=LOG_LEVELS)
    commands = parser.add_subparsers(dest="command", required=True)

    for command, role, summary in (
        ("serve", Role.LEADER, "run the coordinator"),
        ("shard", Role.SHARD, "run a coordinator shard that registers with a leader (`serve`)"),
    ):
        coordinator = commands.add_parser(command, help=summary)
        coordinator.set_defaults(command_parser=coordinator, role=role)
        flags.add_flags(coordinator, CoordinatorConfig, role)
    coordinator.add_argument(  # the shard's, after its own flags
        "--log-level",
        choices=LOG_LEVELS,
        default=argparse.SUPPRESS,  # keeps `gradsync --log-level X shard` working too
        help="as `gradsync --log-level` (default INFO)",
    )

    status = commands.add_parser("status", help="show jobs, membership, progress and late ranks")
    status.set_defaults(command_parser=status)
    _add_coordinator_flag(status)
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
    _add_coordinator_flag(worker)
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
        help="seed of this rank's initial weights (default 1000 + rank; rank 0's "
        "weights are broadcast to all)",
    )
    worker.add_argument(
        "--save",
        type=flags.non_empty,
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
        help="serve this worker's Prometheus metrics on PORT + $LOCAL_RANK "
        "(default $GRADSYNC_METRICS_PORT; 0 = a free port; unset = off)",
    )
    worker.add_argument(
        "--metrics-host",
        type=flags.non_empty,
        help="interface the metrics endpoint binds (default $GRADSYNC_METRICS_HOST or "
        f"{defaults.WORKER_METRICS_HOST}; 0.0.0.0 for a scraper on another host)",
    )
    add_client_security_flags(worker)
    worker.add_argument(
        "--trace",
        type=flags.output_file,
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
    demo.add_argument(
        "--ray",
        action="store_true",
        help="run the coordinator and the workers as Ray actors (needs gradsync[ray])",
    )
    demo.add_argument(
        "--ray-address",
        help="with --ray: the Ray cluster to join (default $RAY_ADDRESS, else a local one)",
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
        default=",".join(BENCH_DEFAULT_SUITES),
        help=f"comma-separated subset of {','.join(BENCH_SUITES)} (default %(default)s; "
        "wan, the slow-link scorecard, takes 20-25 minutes; heal, a restarted rank healed "
        "over gRPC and directly, a few minutes; latency, a tiny model's steps/s against "
        "gloo DDP at W = 2, 8, 16, a few minutes)",
    )
    bench.add_argument(
        "--sizes-mb",
        type=flags.number_list(flags.positive_number),
        help="override: sync sizes (heal: state sizes), e.g. 1,25",
    )
    bench.add_argument(
        "--worlds",
        type=flags.number_list(flags.positive_int),
        help="override: world sizes, e.g. 2,4",
    )
    bench.add_argument("--reps", type=flags.positive_int, help="override: repetitions")
    bench.add_argument(
        "--train-model-mb",
        type=flags.positive_number,
        help="override: model size of the training suite",
    )
    bench.add_argument(
        "--train-steps", type=flags.positive_int, help="override: timed steps of the training suite"
    )
    bench.add_argument(
        "--netns-rate-mbit",
        type=flags.positive_number,
        help="override: emulated link bandwidth (default 200)",
    )
    bench.add_argument(
        "--layouts",
        type=flags.choice_list(BENCH_LAYOUTS),
        help="netns suite: coordinator layouts, a subset of "
        f"{','.join(BENCH_LAYOUTS)} (default: all; single with --quick)",
    )
    bench.add_argument(
        "--netns-wires",
        type=flags.choice_list(("bf16", "fp16")),
        help="netns suite: also time gradsync with these 16-bit wires and torch DDP's bf16 "
        "hook over gloo, e.g. bf16,fp16 (default: fp32 only)",
    )
    bench.add_argument(
        "--shards",
        type=flags.number_list(flags.positive_int),
        help="shard counts S: the netns dedicated and colocated layouts (default S = W), "
        "and loopback rows with `serve --shards S` beside the unsharded ones",
    )
    _add_wan_flags(bench)
    _add_churn_flags(bench)
    return parser


def _add_churn_flags(bench: argparse.ArgumentParser) -> None:
    """The churn suite's knobs (defaults in gradsync_bench.churn.ChurnPlan)."""
    bench.add_argument(
        "--churn-duration-s",
        type=flags.positive_number,
        help="churn: length of the churn run and of the churn-free run before it (default 600)",
    )
    bench.add_argument(
        "--churn-interval-s",
        type=flags.positive_number,
        help="churn: seconds between two failures (default 15)",
    )
    bench.add_argument(
        "--churn-kinds",
        type=flags.choice_list(BENCH_CHURN_KINDS),
        help=f"churn: the failures cycled over, a subset of {','.join(BENCH_CHURN_KINDS)} "
        "(default: all, in that order; churn-torchft injects worker-kill, worker-stop and "
        "coordinator-kill, the lighthouse's, and leaves the others out)",
    )
    bench.add_argument(
        "--churn-shards",
        type=flags.positive_int,
        help="churn: `serve --shards S` of each coordinator (default 2; 1: no shard-kill)",
    )
    bench.add_argument(
        "--churn-work-dir",
        help="churn: keep every process's log and the workers' step logs in this folder "
        "(churn-torchft: its torchft/ subfolder; default: a temporary folder, removed)",
    )


def _add_wan_flags(bench: argparse.ArgumentParser) -> None:
    """The wan suite's knobs (defaults in gradsync_bench.runner.BenchPlan)."""
    bench.add_argument(
        "--wan-steps",
        type=flags.positive_int,
        help="wan: inner steps of the no-sync reference and DiLoCo (default 50)",
    )
    bench.add_argument(
        "--wan-sync-steps",
        type=flags.positive_int,
        help="wan: steps of DDP / gradsync DDP at 100 Mbit/s, scaled down with the rate, "
        "at least 3 (default 6)",
    )
    bench.add_argument(
        "--wan-quality-steps",
        type=flags.integer(0),
        help="wan: inner steps of the loss comparison on unshaped links (0 = none; default 100)",
    )
    bench.add_argument(
        "--wan-rates",
        dest="wan_rates_mbit",
        type=flags.number_list(flags.positive_number),
        help="wan: link rates in Mbit/s (default 100,20)",
    )
    bench.add_argument(
        "--wan-delays",
        dest="wan_delays_ms",
        type=flags.number_list(flags.number(0.0, low_inclusive=True)),
        help="wan: one-way delay in ms of each link of --wan-rates, in the same order "
        "(0 = none; default: no delay)",
    )
    bench.add_argument(
        "--wan-hub",
        type=flags.number_list(flags.number(0.0, low_inclusive=True)),
        help="wan: a hub pass, WORKER_MBIT,DELAY_MS,COORDINATOR_MBIT (the coordinator host "
        "on a faster link than the workers'; default: none)",
    )
    bench.add_argument(
        "--wan-methods",
        type=flags.choice_list(BENCH_WAN_METHODS),
        help=f"wan: a subset of {','.join(BENCH_WAN_METHODS)} (default: all; nosync is "
        "needed for utilization)",
    )
    bench.add_argument(
        "--wan-world", type=flags.positive_int, help="wan: worker hosts W (default 4)"
    )


def _add_coordinator_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--coordinator",
        type=flags.coordinator,
        default=os.environ.get(ENV_COORDINATOR),
        help=f"coordinator host:port (default ${ENV_COORDINATOR})",
    )


def add_client_security_flags(parser: argparse.ArgumentParser) -> None:
    """--tls-ca, --tls-cert, --tls-key and --token-file (defaults from the environment).

    Shared by every command that calls a coordinator or shard (worker, status,
    shard, this probe). There is no flag for the token itself: a value on the
    command line is visible to every user of the host in the process list.
    """
    parser.add_argument(
        "--tls-ca",
        help="PEM CA that issued the server's certificate: connect over TLS "
        "(default $GRADSYNC_TLS_CA; unset = plaintext)",
    )
    parser.add_argument(
        "--tls-cert",
        help="PEM client certificate, for servers that require one (mTLS) "
        "(default $GRADSYNC_TLS_CERT)",
    )
    parser.add_argument("--tls-key", help="PEM key of --tls-cert (default $GRADSYNC_TLS_KEY)")
    parser.add_argument(
        "--token-file",
        help=f"file holding the shared token (default ${auth.ENV_TOKEN_FILE}, or the token "
        f"itself in ${auth.ENV_TOKEN})",
    )


def client_security(parser: argparse.ArgumentParser, args: argparse.Namespace) -> ChannelSecurity:
    """What `add_client_security_flags` parsed; a bad file or pair exits 2 (`parser.error`)."""
    from gradsync_proto.net.channels import security_from_args  # grpc, once a command runs

    try:
        return security_from_args(args)
    except ValueError as exc:
        parser.error(str(exc))


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
        "--diloco",
        type=flags.positive_int,
        metavar="H",
        help="low-communication training (gradsync.DiLoCo): synchronize every H steps "
        "through the coordinator's outer Nesterov optimizer instead of every step",
    )
    parser.add_argument(
        "--timeout-s",
        type=flags.seconds,
        default=defaults.EXAMPLE_TIMEOUT_S,
        help="bound on every wait for other ranks (default %(default)g)",
    )
