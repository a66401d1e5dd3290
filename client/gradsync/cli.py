"""The `gradsync` command: serve, worker, demo, bench, status.

Configuration flows one way: flags (with env-var defaults read here, at run
time) -> a frozen config object -> constructors. Default values come from
`gradsync.protocol.defaults` and help texts show them with `%(default)s`, so
no number is written twice.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from gradsync import __version__
from gradsync.config import ENV_COORDINATOR, ENV_JOB_ID, ENV_RANK, ENV_WORLD_SIZE
from gradsync.protocol import defaults
from gradsync.protocol.defaults import MIB


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _port(text: str) -> int:
    value = int(text)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be in 0..65535, got {value}")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def _env_int(name: str) -> int | None:
    raw = os.environ.get(name)
    return int(raw) if raw and raw.isdigit() else None


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
    serve.add_argument("--world-size", type=_positive_int, required=True, help="ranks per job")
    serve.add_argument("--host", default="0.0.0.0", help="interface to bind (default all)")
    serve.add_argument(
        "--port",
        type=_port,
        default=defaults.PORT,
        help="TCP port; 0 picks a free one and prints it (default %(default)s)",
    )
    serve.add_argument(
        "--chunk-mb",
        type=_positive_float,
        default=defaults.CHUNK_BYTES / MIB,
        help="wire chunk size in MiB (default %(default)g)",
    )
    serve.add_argument(
        "--max-buffered-mb",
        type=_positive_float,
        default=defaults.MAX_BUFFERED_BYTES / MIB,
        help="cap on gradient bytes held in partial reductions (default %(default)g)",
    )
    serve.add_argument(
        "--max-jobs",
        type=_positive_int,
        default=defaults.MAX_JOBS,
        help="concurrent jobs accepted (default %(default)s)",
    )
    serve.add_argument(
        "--shutdown-grace-s",
        type=float,
        default=defaults.SHUTDOWN_GRACE_S,
        help="how long SIGTERM lets running streams finish (default %(default)g)",
    )
    serve.add_argument(
        "--heartbeat-interval",
        type=_positive_float,
        default=defaults.HEARTBEAT_INTERVAL_S,
        help="seconds between worker heartbeats (default %(default)g)",
    )
    serve.add_argument(
        "--heartbeat-timeout",
        type=_positive_float,
        default=defaults.HEARTBEAT_TIMEOUT_S,
        help="seconds of silence before a worker is declared dead (default %(default)g)",
    )
    serve.add_argument(
        "--stall-warning",
        type=_positive_float,
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
        type=int,
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
        "--metrics-port",
        type=int,
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
        type=_positive_int,
        default=defaults.MIN_WORKERS,
        help="elastic: the fewest live workers to go on with (default %(default)s)",
    )

    status = commands.add_parser("status", help="show jobs, membership, progress and late ranks")
    status.add_argument(
        "--coordinator",
        default=os.environ.get(ENV_COORDINATOR),
        help=f"coordinator host:port (default ${ENV_COORDINATOR})",
    )
    status.add_argument("--job-id", default="", help="only this job")
    status.add_argument("--json", action="store_true", help="machine-readable output")
    status.add_argument(
        "--timeout-s",
        type=_positive_float,
        default=defaults.STATUS_TIMEOUT_S,
        help="bound on the query (default %(default)g)",
    )

    worker = commands.add_parser("worker", help="run the example training job as one rank")
    worker.add_argument(
        "--coordinator",
        default=os.environ.get(ENV_COORDINATOR),
        help=f"coordinator host:port (default ${ENV_COORDINATOR})",
    )
    worker.add_argument(
        "--rank",
        type=int,
        default=_env_int(ENV_RANK),
        help=f"this worker's rank (default ${ENV_RANK})",
    )
    worker.add_argument(
        "--world-size",
        type=_positive_int,
        default=_env_int(ENV_WORLD_SIZE),
        help=f"number of ranks (default ${ENV_WORLD_SIZE})",
    )
    worker.add_argument(
        "--job-id",
        default=os.environ.get(ENV_JOB_ID),
        help=f"job id shared by all ranks (default ${ENV_JOB_ID} or {defaults.JOB_ID!r})",
    )
    _add_training_flags(worker)
    worker.add_argument(
        "--init-seed",
        type=int,
        default=None,
        help="seed of this rank's initial weights (default 1000 + rank; rank 0's "
        "weights are broadcast to all)",
    )
    worker.add_argument(
        "--save",
        type=Path,
        default=None,
        help="write the final parameters to this .npz file ({rank} is replaced by the rank)",
    )
    worker.add_argument("--no-progress", action="store_true", help="no progress bar on rank 0")
    worker.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        help="serve this worker's Prometheus metrics on PORT + $LOCAL_RANK "
        "(default $GRADSYNC_METRICS_PORT; 0 = a free port; unset = off)",
    )
    worker.add_argument(
        "--trace",
        type=Path,
        default=None,
        help="write a Chrome trace (Perfetto) of every step to this file",
    )

    demo = commands.add_parser(
        "demo", help="start a coordinator and local workers, train, check against one process"
    )
    demo.add_argument(
        "--workers",
        type=_positive_int,
        default=3,
        help="number of worker processes (default %(default)s)",
    )
    _add_training_flags(demo)

    bench = commands.add_parser(
        "bench", help="benchmark against gloo / torchrun + DDP and the network's bound"
    )
    bench.add_argument("--quick", action="store_true", help="a run of under two minutes")
    bench.add_argument(
        "--out",
        type=Path,
        default=Path("bench/results"),
        help="where latest.json / .md / .png go (default bench/results)",
    )
    bench.add_argument(
        "--suites",
        default="loopback,train,netns",
        help="comma-separated subset of loopback,train,netns",
    )
    bench.add_argument("--sizes-mb", default=None, help="override: sync sizes, e.g. 1,25")
    bench.add_argument("--worlds", default=None, help="override: world sizes, e.g. 2,4")
    bench.add_argument("--reps", type=_positive_int, default=None, help="override: repetitions")
    bench.add_argument(
        "--train-model-mb",
        type=_positive_float,
        default=None,
        help="override: model size of the training suite",
    )
    bench.add_argument(
        "--train-steps",
        type=_positive_int,
        default=None,
        help="override: timed steps of the training suite",
    )
    bench.add_argument(
        "--netns-rate-mbit",
        type=_positive_float,
        default=None,
        help="override: emulated link bandwidth (default 1000)",
    )
    return parser


def _add_training_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--epochs", type=_positive_int, default=5, help="epochs (default %(default)s)"
    )
    parser.add_argument(
        "--batch-size",
        type=_positive_int,
        default=32,
        help="samples per rank per step (default %(default)s)",
    )
    parser.add_argument(
        "--lr", type=_positive_float, default=0.5, help="SGD learning rate (default %(default)s)"
    )
    parser.add_argument(
        "--timeout-s",
        type=_positive_float,
        default=defaults.EXAMPLE_TIMEOUT_S,
        help="bound on every wait for other ranks (default %(default)g)",
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `gradsync` console script; returns the exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "serve":
        return _serve(parser, args)
    if args.command == "worker":
        return _worker(parser, args)
    if args.command == "bench":
        return _bench(parser, args)
    if args.command == "status":
        return _status(parser, args)
    return _demo(args)


def _serve(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    from gradsync.server.app import run
    from gradsync.server.config import ServerConfig

    if args.checkpoint_store is not None:
        from gradsync.server.stores import parse_store_url

        try:
            parse_store_url(args.checkpoint_store)
        except ValueError as exc:
            parser.error(f"--checkpoint-store: {exc}")
    _configure_logging(args.log_level, "coordinator")
    try:
        config = ServerConfig(
            world_size=args.world_size,
            host=args.host,
            port=args.port,
            chunk_bytes=int(args.chunk_mb * MIB),
            max_buffered_bytes=int(args.max_buffered_mb * MIB),
            max_jobs=args.max_jobs,
            shutdown_grace_s=args.shutdown_grace_s,
            heartbeat_interval_s=args.heartbeat_interval,
            heartbeat_timeout_s=args.heartbeat_timeout,
            stall_warning_s=args.stall_warning,
            checkpoint_store=args.checkpoint_store,
            checkpoint_every=args.checkpoint_every,
            require_checkpoint=args.require_checkpoint,
            resume=args.resume,
            metrics_port=args.metrics_port,
            on_failure=args.on_failure,
            min_workers=args.min_workers,
        )
    except ValueError as exc:
        parser.error(str(exc))
    try:
        return run(config)
    except OSError as exc:
        print(f"gradsync serve: {exc}", file=sys.stderr)
        return 1


def _worker(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    if not args.coordinator:
        parser.error(f"worker needs --coordinator HOST:PORT (or ${ENV_COORDINATOR})")
    if args.rank is None or args.world_size is None:
        parser.error(f"worker needs --rank and --world-size (or ${ENV_RANK} / ${ENV_WORLD_SIZE})")
    if not 0 <= args.rank < args.world_size:
        parser.error(f"--rank {args.rank} is out of range for --world-size {args.world_size}")
    _configure_logging(args.log_level, f"rank {args.rank}")
    from gradsync.errors import GradSyncError
    from gradsync.example import TrainSettings, train_worker

    settings = TrainSettings(
        world_size=args.world_size, epochs=args.epochs, batch_size=args.batch_size, lr=args.lr
    )
    init_seed = args.init_seed if args.init_seed is not None else 1000 + args.rank
    try:
        test_accuracy = train_worker(
            args.coordinator,
            args.rank,
            settings,
            init_seed=init_seed,
            job_id=args.job_id,
            timeout_s=args.timeout_s,
            progress=args.rank == 0 and not args.no_progress,
            save_path=Path(str(args.save).format(rank=args.rank)) if args.save else None,
            metrics_port=args.metrics_port,
            trace_path=args.trace,
        )
    except GradSyncError as exc:
        print(f"gradsync worker rank {args.rank}: {exc}", file=sys.stderr)
        return 1
    print(f"rank {args.rank}: test accuracy {test_accuracy:.4f}", flush=True)
    return 0


def _demo(args: argparse.Namespace) -> int:
    from gradsync.demo import run_demo
    from gradsync.example import TrainSettings

    _configure_logging("WARNING", "demo")
    settings = TrainSettings(
        world_size=args.workers, epochs=args.epochs, batch_size=args.batch_size, lr=args.lr
    )
    return run_demo(settings, timeout_s=args.timeout_s)


def _bench(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    import dataclasses

    from gradsync.bench import runner

    plan = runner.BenchPlan.quick() if args.quick else runner.BenchPlan()
    suites = tuple(s.strip() for s in args.suites.split(",") if s.strip())
    unknown = set(suites) - {"loopback", "train", "netns"}
    if unknown:
        parser.error(f"--suites: unknown suite(s) {sorted(unknown)}")
    try:
        overrides: dict[str, Any] = {"suites": suites}
        if args.sizes_mb:
            overrides["sizes_mb"] = [float(x) for x in args.sizes_mb.split(",")]
            overrides["netns_sizes_mb"] = overrides["sizes_mb"]
        if args.worlds:
            worlds = [int(x) for x in args.worlds.split(",")]
            overrides.update(worlds=worlds, train_worlds=worlds, netns_worlds=worlds)
    except ValueError as exc:
        parser.error(f"--sizes-mb / --worlds must be comma-separated numbers: {exc}")
    if args.reps:
        overrides.update(reps=args.reps, netns_reps=args.reps)
    if args.train_model_mb:
        overrides["train_model_mb"] = args.train_model_mb
    if args.train_steps:
        overrides["train_steps"] = args.train_steps
    if args.netns_rate_mbit:
        overrides["netns_rate_mbit"] = args.netns_rate_mbit
    plan = dataclasses.replace(plan, **overrides)
    _configure_logging("WARNING", "bench")
    document = runner.run(plan)
    runner.write(document, args.out)
    print(runner.markdown(document))
    print(f"wrote {args.out / 'latest.json'}, latest.md, latest.png")
    return 0


def _status(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    if not args.coordinator:
        parser.error(f"status needs --coordinator HOST:PORT (or ${ENV_COORDINATOR})")
    from gradsync.status import format_status, query_status

    try:
        reply = query_status(args.coordinator, args.job_id, args.timeout_s)
    except ConnectionError as exc:
        print(f"gradsync status: {exc}", file=sys.stderr)
        return 1
    if args.json:
        from google.protobuf.json_format import MessageToJson

        print(MessageToJson(reply, always_print_fields_with_no_presence=True))
    else:
        print(format_status(reply))
    return 0


def _configure_logging(level: str, who: str) -> None:
    logging.basicConfig(
        level=level,
        format=f"%(asctime)s [{who}] %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )


if __name__ == "__main__":
    sys.exit(main())
