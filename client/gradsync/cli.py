"""The `gradsync` command: serve, shard, worker, demo, bench, status, token.

Configuration flows one way: flags (`gradsync.arguments`, with env-var
defaults read there, at run time) -> a frozen config object -> constructors.
Default values come from `gradsync_proto.defaults` and help texts show them
with `%(default)s`, so no number is written twice. Checks that involve two
flags (a rank and the world size, a heartbeat interval and its timeout) are
made here, before anything starts, and name both flags.
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

from gradsync import defaults, flags
from gradsync.arguments import build_parser
from gradsync.config import ENV_COORDINATOR, ENV_RANK, ENV_WORLD_SIZE
from gradsync.defaults import MIB

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
    if args.command == "serve":
        return _serve(parser, args)
    if args.command == "shard":
        return _shard(parser, args)
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


def _server_security(
    parser: argparse.ArgumentParser, args: argparse.Namespace, command: str
) -> tuple[str | None, str | None]:
    """The token and shard token of `serve` / `shard` after checking every security flag.

    Bad files exit 2 naming the flag (via the parser); protected mode exits 2 with
    the message of `gradsync_server.rpc.auth_check.exposure_refusal`.
    """
    from gradsync_server.rpc.auth_check import exposure_refusal, server_credentials

    try:
        token = auth.resolve_token(args.token_file, os.environ)
        shard_token = auth.resolve_shard_token(args.shard_token_file, os.environ)
        server_credentials(args.tls_cert, args.tls_key, args.tls_client_ca)
        if args.tls_ca is not None:
            auth.read_pem_file(args.tls_ca, "--tls-ca")
    except auth.TokenError as exc:
        parser.error(str(exc))
    refusal = exposure_refusal(
        command,
        args.host,
        token=token is not None,
        client_ca=args.tls_client_ca is not None,
        insecure=args.insecure,
    )
    if refusal is not None:
        print(refusal, file=sys.stderr)
        raise SystemExit(EXIT_EXPOSED)
    return token, shard_token


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


def _serve(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    from gradsync_server.app import run
    from gradsync_server.arguments import frame_port_of
    from gradsync_server.config import ServerConfig

    if args.checkpoint_store is not None:
        from gradsync_server.store.stores import parse_store_url

        try:
            parse_store_url(args.checkpoint_store)
        except ValueError as exc:
            parser.error(f"--checkpoint-store: {exc}")
    if args.heartbeat_interval >= args.heartbeat_timeout:
        parser.error(
            f"--heartbeat-interval {args.heartbeat_interval:g} must be below "
            f"--heartbeat-timeout {args.heartbeat_timeout:g}"
        )
    if args.min_workers > args.world_size:
        parser.error(
            f"--min-workers {args.min_workers} is more than --world-size {args.world_size}"
        )
    if int(args.max_collective_mb * MIB) < 1:
        parser.error(f"--max-collective-mb {args.max_collective_mb:g} is below one byte")
    if args.shards is not None and args.wait_for_shards is not None:
        parser.error(
            f"--shards {args.shards} and --wait-for-shards {args.wait_for_shards} cannot be "
            "combined: --shards starts the shards on this host, --wait-for-shards waits for "
            "shards started elsewhere"
        )
    tokens = _server_security(parser, args, "serve")
    if args.wait_for_shards is not None:
        shard_count, local_shards = args.wait_for_shards + 1, False
    else:
        shard_count, local_shards = args.shards or 1, True
    if args.chunk_mb is not None:
        chunk_bytes = int(args.chunk_mb * MIB)
    else:
        chunk_bytes = defaults.SHARDED_CHUNK_BYTES if shard_count > 1 else defaults.CHUNK_BYTES
    if args.max_buffered_mb * MIB < chunk_bytes:
        parser.error(
            f"--max-buffered-mb {args.max_buffered_mb:g} must hold at least one chunk "
            f"(--chunk-mb {chunk_bytes / MIB:g})"
        )
    try:
        config = ServerConfig(
            world_size=args.world_size,
            host=args.host,
            port=args.port,
            chunk_bytes=chunk_bytes,
            max_buffered_bytes=int(args.max_buffered_mb * MIB),
            max_job_buffered_bytes=(
                None if args.max_job_buffered_mb is None else int(args.max_job_buffered_mb * MIB)
            ),
            max_outbox_bytes=int(args.max_outbox_mb * MIB),
            max_checkpoint_bytes=int(args.max_checkpoint_mb * MIB),
            max_connections=args.max_connections,
            first_message_timeout_s=args.first_message_timeout_s,
            assembly_timeout_s=args.assembly_timeout_s,
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
            nonfinite=args.nonfinite,
            payload_socket=args.payload_socket,
            frame_port=frame_port_of(
                args.frame_port, args.port, shard_count if local_shards else 1
            ),
            frame_port_required=args.frame_port is not None and args.frame_port >= 0,
            min_workers=args.min_workers,
            max_collective_bytes=int(args.max_collective_mb * MIB),
            shard_count=shard_count,
            local_shards=local_shards,
            shard_wait_timeout_s=args.shard_wait_timeout,
            **_security_settings(args, tokens),
            fresh_start=args.fresh_start,
            store_timeout_s=args.store_timeout,
            state_dir=_state_dir(args),
            redis_password=_redis_password(parser, args),
            lease=args.lease or args.standby,
            standby=args.standby,
            lease_ttl_s=args.lease_ttl_s,
            advertise=args.advertise,
        )
    except ValueError as exc:
        parser.error(str(exc))
    _configure_logging(args.log_level, "coordinator")
    try:
        return run(config)
    except (OSError, RuntimeError) as exc:
        # A port in use or an interface that does not exist: the flags were
        # well-formed, the host refused them (status 1, not 2).
        print(
            f"gradsync serve: cannot listen on --host {args.host} --port {args.port}: {exc}",
            file=sys.stderr,
        )
        return 1


def _security_settings(
    args: argparse.Namespace, tokens: tuple[str | None, str | None]
) -> dict[str, Any]:
    """The config fields of the TLS, token and exposure flags `serve` and `shard` share."""
    token, shard_token = tokens
    return {
        "shard_token": shard_token,
        "tls_cert": args.tls_cert,
        "tls_key": args.tls_key,
        "tls_client_ca": args.tls_client_ca,
        "tls_ca": args.tls_ca,
        "token": token,
        "insecure": args.insecure,
        "metrics_host": args.metrics_host,
    }


def _state_dir(args: argparse.Namespace) -> str | None:
    """--state-dir, else the XDG default; None without a checkpoint store (nothing to mark)."""
    if args.checkpoint_store is None:
        return None
    from gradsync_server.store.high_water_file import default_state_dir

    return args.state_dir or default_state_dir(os.environ)


def _redis_password(parser: argparse.ArgumentParser, args: argparse.Namespace) -> str | None:
    """The Redis password from --redis-password-file, else $GRADSYNC_REDIS_PASSWORD.

    Never from a flag's value or the URL alone: both show in the process list.
    """
    path = args.redis_password_file
    if path is None:
        return os.environ.get(defaults.ENV_REDIS_PASSWORD) or None
    try:
        with open(path, encoding="utf-8") as handle:
            password = handle.read(4097).rstrip("\r\n")
    except (OSError, UnicodeDecodeError) as exc:
        parser.error(f"--redis-password-file: cannot read {path!r}: {exc}")
    if not password or len(password) > 4096 or "\n" in password:
        parser.error(f"--redis-password-file: {path!r} must hold one line of 1..4096 characters")
    return password


def _shard(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    from gradsync_server.app import run_shard as run
    from gradsync_server.shard_config import ShardConfig, store_settings

    chunk_bytes = None if args.chunk_mb is None else int(args.chunk_mb * MIB)
    if chunk_bytes is not None and args.max_buffered_mb * MIB < chunk_bytes:
        parser.error(
            f"--max-buffered-mb {args.max_buffered_mb:g} must hold at least one chunk "
            f"(--chunk-mb {args.chunk_mb:g})"
        )
    if args.advertise is not None:
        try:
            # ":PORT" means the leader's host; anything else must be a full host:port.
            flags.coordinator(
                f"localhost{args.advertise}" if args.advertise.startswith(":") else args.advertise
            )
        except argparse.ArgumentTypeError as exc:
            parser.error(f"--advertise {args.advertise}: {exc}")
    tokens = _server_security(parser, args, "shard")
    try:
        config = ShardConfig(
            leader=args.leader,
            host=args.host,
            port=args.port,
            advertise=args.advertise,
            chunk_bytes=chunk_bytes,
            max_buffered_bytes=int(args.max_buffered_mb * MIB),
            max_outbox_bytes=int(args.max_outbox_mb * MIB),
            max_connections=args.max_connections,
            first_message_timeout_s=args.first_message_timeout_s,
            metrics_port=args.metrics_port,
            parent_pid=args.parent_pid,
            **store_settings(args, _redis_password(parser, args)),
            **_security_settings(args, tokens),
        )
    except ValueError as exc:
        parser.error(str(exc))
    _configure_logging(args.log_level, "shard")
    try:
        return run(config)
    except (OSError, RuntimeError) as exc:
        print(
            f"gradsync shard: cannot listen on --host {args.host} --port {args.port}: {exc}",
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
    from gradsync_proto.net.channels import security_from_args

    try:
        security = security_from_args(args)
    except ValueError as exc:
        parser.error(str(exc))
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
    from gradsync_proto.net.channels import security_from_args

    from gradsync.status import format_status, query_status, status_json

    try:
        security = security_from_args(args)
    except ValueError as exc:
        parser.error(str(exc))
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
