"""Readers of the coordinator's flags that are not one field's value as given.

The flags of `gradsync serve` and `gradsync shard` are declared on the fields
of `gradsync_server.config.CoordinatorConfig` (`gradsync_proto.flags.Flag`).
Most set their field as parsed (times a unit); the readers here are the
`read` of the others: values that combine flags (`--shards` and
`--wait-for-shards`), come from files or the environment (tokens, the Redis
password, the state directory), or default from another flag (the chunk
size from the shard count, the frame port from `--port`). They run when the
CLI builds the config, at run time, never at import; a `ValueError` names
the flag, and the CLI reports it as a flag error (exit status 2).
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping

from gradsync_proto import auth

from gradsync_server import defaults


def shard_count(args: argparse.Namespace, environ: Mapping[str, str]) -> int:
    """`--shards S` (S), `--wait-for-shards K` (K + 1), neither (1).

    Raises:
        ValueError: both are given.
    """
    if args.shards is not None and args.wait_for_shards is not None:
        raise ValueError(
            f"--shards {args.shards} and --wait-for-shards {args.wait_for_shards} cannot be "
            "combined: --shards starts the shards on this host, --wait-for-shards waits for "
            "shards started elsewhere"
        )
    if args.wait_for_shards is not None:
        return int(args.wait_for_shards) + 1
    return int(args.shards or 1)


def local_shards(args: argparse.Namespace, environ: Mapping[str, str]) -> bool:
    """The shards are this leader's children unless `--wait-for-shards` expects others."""
    return args.wait_for_shards is None


def chunk_bytes(args: argparse.Namespace, environ: Mapping[str, str]) -> int:
    """`--chunk-mb` in bytes; unset, a sharded leader's smaller default (0 = the role's)."""
    if args.chunk_mb is not None:
        return int(args.chunk_mb * defaults.MIB)
    if args.role == "leader" and shard_count(args, environ) > 1:
        return defaults.SHARDED_CHUNK_BYTES
    return 0


def frame_port(args: argparse.Namespace, environ: Mapping[str, str]) -> int | None:
    """The frame port `--frame-port` asks for: a leader's past the ports of `--shards`
    (`frame_port_of`); a shard's a free one unless named (its neighbours' ports are taken
    by a leader's other local shards)."""
    if args.role == "shard":  # (`Role.SHARD`: config.py imports this module)
        return 0 if args.frame_port is None else frame_port_of(args.frame_port, args.port)
    return frame_port_of(args.frame_port, args.port, args.shards or 1)


def frame_port_required(args: argparse.Namespace, environ: Mapping[str, str]) -> bool:
    """A frame port the operator named must be bound; the default one may move."""
    return args.frame_port is not None and args.frame_port >= 0


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


def lease(args: argparse.Namespace, environ: Mapping[str, str]) -> bool:
    """`--standby` implies `--lease`."""
    return bool(args.lease or args.standby)


def token(args: argparse.Namespace, environ: Mapping[str, str]) -> str | None:
    """The workers' token from `--token-file`, else `$GRADSYNC_TOKEN(_FILE)`."""
    return auth.resolve_token(args.token_file, environ)


def shard_token(args: argparse.Namespace, environ: Mapping[str, str]) -> str | None:
    """The shards' token from `--shard-token-file`, else `$GRADSYNC_SHARD_TOKEN(_FILE)`."""
    return auth.resolve_shard_token(args.shard_token_file, environ)


def state_dir(args: argparse.Namespace, environ: Mapping[str, str]) -> str | None:
    """--state-dir, else the XDG default; None without a checkpoint store (nothing to mark)."""
    if args.checkpoint_store is None:
        return None
    from gradsync_server.store.high_water_file import default_state_dir

    return str(args.state_dir or default_state_dir(environ))


def redis_password(args: argparse.Namespace, environ: Mapping[str, str]) -> str | None:
    """The Redis password from --redis-password-file, else $GRADSYNC_REDIS_PASSWORD.

    Never from a flag's value or the URL alone: both show in the process list.

    Raises:
        ValueError: the file cannot be read or does not hold one line.
    """
    path = args.redis_password_file
    if path is None:
        return environ.get(defaults.ENV_REDIS_PASSWORD) or None
    try:
        with open(os.fspath(path), encoding="utf-8") as handle:
            password = handle.read(4097).rstrip("\r\n")
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"--redis-password-file: cannot read {path!r}: {exc}") from None
    if not password or len(password) > 4096 or "\n" in password:
        raise ValueError(
            f"--redis-password-file: {path!r} must hold one line of 1..4096 characters"
        )
    return password
