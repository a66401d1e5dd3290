"""The `gradsync` command: serve, shard, worker, demo, bench, status, token.

Configuration flows one way: flags (`gradsync.arguments`, with env-var
defaults read there, at run time) -> a frozen config object -> constructors.
Default values come from `gradsync_proto.defaults` and help texts show them
with `%(default)s`, so no number is written twice. Checks that involve two
flags are made before anything starts and name both flags: the worker's
here, the coordinator's by `CoordinatorConfig`.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import secrets
import signal
import sys
from collections.abc import Iterator, Sequence
from typing import Any

from gradsync_proto import auth

from gradsync import flags
from gradsync.arguments import build_parser, client_security
from gradsync.config import ENV_COORDINATOR, ENV_RANK, ENV_WORLD_SIZE

__all__ = ["build_parser", "main"]


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `gradsync` console script; returns the exit code.

    Flag errors exit 2 naming the flag (argparse). SIGINT and SIGTERM stop any
    subcommand with one line and status 128 + the signal number, after the
    usual cleanup (a worker leaves its job, a demo stops its processes);
    `serve` handles both itself once it runs, draining for the grace period.
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        with _stopped_by_signals():
            return _run(args)
    except _Stopped as stopped:
        name = signal.Signals(stopped.signum).name
        print(f"gradsync {args.command}: stopped by {name}", file=sys.stderr, flush=True)
        return 128 + stopped.signum


def _run(args: argparse.Namespace) -> int:
    # Errors that involve several flags go through the subcommand's own parser,
    # so the usage line printed with them is the subcommand's.
    parser: argparse.ArgumentParser = args.command_parser
    if args.command in ("serve", "shard"):
        return _coordinator(parser, args)
    if args.command == "worker":
        return _worker(parser, args)
    if args.command == "bench":
        return _bench(args)
    if args.command == "status":
        return _status(parser, args)
    if args.command == "token":
        return _token(args)
    return _demo(parser, args)


#: Exit status of a server refused by protected mode (a flag must change, as for a bad flag).
EXIT_EXPOSED = 2


def _token(args: argparse.Namespace) -> int:
    """Write a fresh token to a new file only its owner can read (or keep a usable one)."""
    path = args.file
    if args.keep and os.path.exists(path):
        try:
            auth.read_token_file(path)
        except auth.TokenError as exc:
            print(f"gradsync token: {exc}", file=sys.stderr)
            return 1
        print(f"gradsync token: kept the token in {path}", file=sys.stderr)
        return 0
    try:
        # O_EXCL: never overwrite (a running server may use it); 0600: the owner only.
        descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError as exc:
        print(f"gradsync token: cannot create {path}: {exc.strerror or exc}", file=sys.stderr)
        return 1
    with os.fdopen(descriptor, "w", encoding="utf-8") as handle:
        handle.write(secrets.token_urlsafe(32) + "\n")
    print(f"gradsync token: wrote a new token to {path}", file=sys.stderr)
    return 0


class _Stopped(BaseException):
    """SIGINT or SIGTERM arrived: unwinds like KeyboardInterrupt, so `with` blocks close."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


@contextlib.contextmanager
def _stopped_by_signals() -> Iterator[None]:
    """Turn the first SIGINT/SIGTERM into `_Stopped`; a second one kills at once.

    Without this, SIGTERM killed a worker without leaving its job, and SIGINT
    printed a KeyboardInterrupt traceback from wherever the main thread was.
    """
    signums = (signal.SIGINT, signal.SIGTERM)

    def handler(signum: int, frame: object) -> None:
        for each in signums:
            signal.signal(each, signal.SIG_DFL)
        raise _Stopped(signum)

    previous = {signum: signal.signal(signum, handler) for signum in signums}
    try:
        yield
    finally:
        for signum, action in previous.items():
            signal.signal(signum, action)


def _coordinator(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """`gradsync serve` (a leader) and `gradsync shard`: flags -> `CoordinatorConfig` -> run.

    A flag the config refuses, alone or with others, exits 2 naming it (via the parser);
    protected mode exits 2 with the message of
    `gradsync_server.rpc.auth_check.exposure_refusal`.
    """
    from gradsync_proto.flags import config_from_flags
    from gradsync_server.app import run
    from gradsync_server.config import CoordinatorConfig
    from gradsync_server.rpc.auth_check import exposure_refusal, server_credentials

    try:
        config = config_from_flags(CoordinatorConfig, args, os.environ)
        server_credentials(config.tls_cert, config.tls_key, config.tls_client_ca)
        if config.tls_ca is not None:
            auth.read_pem_file(config.tls_ca, "--tls-ca")
    except ValueError as exc:  # auth.TokenError included
        parser.error(str(exc))
    refusal = exposure_refusal(
        args.command,
        config.host,
        token=config.token is not None,
        client_ca=config.tls_client_ca is not None,
        insecure=config.insecure,
    )
    if refusal is not None:
        print(refusal, file=sys.stderr)
        raise SystemExit(EXIT_EXPOSED)
    _configure_logging(args.log_level, "coordinator" if args.command == "serve" else "shard")
    try:
        return run(config)
    except (OSError, RuntimeError) as exc:
        # A port in use or an interface that does not exist: the flags were
        # well-formed, the host refused them (status 1, not 2).
        print(
            f"gradsync {args.command}: cannot listen on --host {args.host} --port {args.port}: "
            f"{exc}",
            file=sys.stderr,
        )
        return 1


def _worker(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    if not args.coordinator:
        parser.error(f"worker needs --coordinator HOST:PORT (or ${ENV_COORDINATOR})")
    if args.rank is None or args.world_size is None:
        parser.error(f"worker needs --rank and --world-size (or ${ENV_RANK} / ${ENV_WORLD_SIZE})")
    if not 0 <= args.rank < args.world_size:
        parser.error(f"--rank {args.rank} is out of range for --world-size {args.world_size}")
    from gradsync.example import train_samples

    _check_batches(parser, args.batch_size, args.world_size, "--world-size", train_samples())
    save_path = None
    if args.save is not None:
        try:
            save_path = flags.output_file(args.save.format(rank=args.rank))
        except (KeyError, IndexError) as exc:
            parser.error(f"--save {args.save!r}: unknown field {exc} (only {{rank}} is replaced)")
        except (ValueError, argparse.ArgumentTypeError) as exc:
            parser.error(f"--save {args.save!r}: {exc}")
    security = client_security(parser, args)
    _configure_logging(args.log_level, f"rank {args.rank}")
    from gradsync.errors import GradSyncError
    from gradsync.example import train_worker

    settings = _train_settings(args, args.world_size)
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
            save_path=save_path,
            metrics_port=args.metrics_port,
            trace_path=args.trace,
            log_every_steps=args.log_every_steps,
            metrics_host=args.metrics_host,
            tls_ca=security.ca_path,
            tls_cert=security.cert_path,
            tls_key=security.key_path,
            token=security.token,
        )
    except GradSyncError as exc:
        print(f"gradsync worker rank {args.rank}: {exc}", file=sys.stderr)
        return 1
    print(f"rank {args.rank}: test accuracy {test_accuracy:.4f}", flush=True)
    return 0


def _train_settings(args: argparse.Namespace, world_size: int) -> Any:
    from gradsync.example import TrainSettings

    return TrainSettings(world_size, args.epochs, args.batch_size, args.lr, 0, args.diloco or 0)


def _check_batches(
    parser: argparse.ArgumentParser, batch_size: int, ranks: int, ranks_flag: str, samples: int
) -> None:
    """Refuse a global batch larger than the data set: it would train zero steps."""
    if batch_size * ranks > samples:
        parser.error(
            f"--batch-size {batch_size} x {ranks_flag} {ranks} = {batch_size * ranks} "
            f"samples per step, more than the {samples} training samples"
        )


def _demo(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    if args.ray_address is not None and not args.ray:
        parser.error("--ray-address needs --ray")
    from gradsync.demo import run_demo
    from gradsync.example import train_samples

    _check_batches(parser, args.batch_size, args.workers, "--workers", train_samples())
    _configure_logging("WARNING", "demo")
    settings = _train_settings(args, args.workers)
    if args.ray:
        try:
            from gradsync.ray.demo import run_ray_demo
        except ImportError as exc:
            parser.error(f"--ray: {exc}")
        return run_ray_demo(settings, timeout_s=args.timeout_s, address=args.ray_address)
    return run_demo(settings, timeout_s=args.timeout_s)


def _bench(args: argparse.Namespace) -> int:
    from gradsync_bench import runner
    from gradsync_bench.plan_args import plan_from_args

    plan = plan_from_args(args)
    _configure_logging("WARNING", "bench")
    document = runner.run(plan)
    runner.write(document, args.out)
    print(runner.markdown(document))
    print(f"wrote {args.out / 'latest.json'}, latest.md, latest.png")
    return 0


def _status(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    if not args.coordinator:
        parser.error(f"status needs --coordinator HOST:PORT (or ${ENV_COORDINATOR})")
    from gradsync.status import format_status, query_status, status_json

    security = client_security(parser, args)
    try:
        reply = query_status(args.coordinator, args.job_id, args.timeout_s, security)
    except ConnectionError as exc:
        print(f"gradsync status: {exc}", file=sys.stderr)
        return 1
    print(status_json(reply) if args.json else format_status(reply))
    return 0


def _configure_logging(level: str, who: str) -> None:
    logging.basicConfig(
        level=level,
        format=f"%(asctime)s [{who}] %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )


if __name__ == "__main__":
    sys.exit(main())
