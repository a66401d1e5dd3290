"""Choosing a checkpoint backend from a URL, strictly.

A store URL that is silently read as something else loses checkpoints where
nobody looks: `10.213.0.3:6379/0` (a Redis address missing its `redis://`)
was once accepted as a relative directory, and a test "using Redis" wrote
into the repository instead. So a value is accepted only when its meaning is
unambiguous: `redis://…` / `rediss://…` for Redis, `file://…` (or
`file:relative/path`) for the file backend, or a filesystem path whose first
component cannot be mistaken for `host:port`. Everything else is a
`ValueError` naming the value, raised at start-up (`gradsync serve` turns it
into a usage error for `--checkpoint-store`).

This module sits above the format (`checkpoint`) and both backends, which is
what keeps the three free of an import circle.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from urllib.parse import unquote, urlsplit

from gradsync_server.store.checkpoint import CheckpointStore
from gradsync_server.store.checkpoint_file import FileCheckpointStore
from gradsync_server.store.checkpoint_redis import RedisCheckpointStore

# `host:port` or `[v6]:port` as the first path component of a scheme-less value.
_HOST_PORT = re.compile(r"(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9._-]+):\d+")
_EXPECTED = (
    "expected redis://host:port/db, rediss://host:port/db, file:///abs/path, "
    "file:relative/path or a filesystem path"
)


@dataclass(frozen=True)
class StoreLocation:
    """Where a store URL points: `kind` is "redis" (with the URL) or "file" (with a path)."""

    kind: str
    target: str


def parse_store_url(url: str) -> StoreLocation:
    """Decide which backend `url` names, without touching the store.

    Raises:
        ValueError: the value is empty, names an unsupported scheme or a remote
            file host, or looks like a Redis address without its scheme.
    """
    if not url:
        raise ValueError(f"empty checkpoint store URL: {_EXPECTED}")
    if "://" not in url:
        first = url.split("/", 1)[0]
        if _HOST_PORT.fullmatch(first):
            raise ValueError(
                f"checkpoint store {url!r} looks like a network address ({first}), not a "
                f"directory; write redis://{url} for Redis, or ./{url} if it really is a path"
            )
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme in ("redis", "rediss") and "://" in url:
        return StoreLocation("redis", url)
    if scheme == "file":
        if parts.netloc not in ("", "localhost"):
            raise ValueError(
                f"checkpoint URL {url!r} names host {parts.netloc!r}; use a local path"
            )
        if not parts.path:
            raise ValueError(f"checkpoint URL {url!r} has no path")
        return StoreLocation("file", unquote(parts.path))
    if not scheme:
        return StoreLocation("file", url)
    raise ValueError(f"unsupported checkpoint store URL {url!r}: {_EXPECTED}")


def open_store(
    url: str, *, keep: int = 3, password: str | None = None, timeout_s: float | None = None
) -> CheckpointStore:
    """Open the store named by `url`, keeping the newest `keep` checkpoints per job.

    Args:
        url: see `parse_store_url` and the module docstring.
        keep: checkpoints kept per job, at least 1.
        password: the Redis password (from a file or the environment, so that it is not
            in the URL, which the process list shows); overrides one in the URL.
        timeout_s: bound on every Redis network wait (the Redis default when None).

    Raises:
        ValueError: the URL names no supported backend unambiguously, or `keep` < 1.
    """
    location = parse_store_url(url)
    if location.kind == "redis":
        if timeout_s is None:
            return RedisCheckpointStore(location.target, keep=keep, password=password)
        return RedisCheckpointStore(
            location.target, keep=keep, password=password, socket_timeout_s=timeout_s
        )
    return FileCheckpointStore(location.target, keep=keep)


def redacted_store_url(url: str) -> str:
    """`url` with any password replaced by `***`, fit for banners and logs."""
    return re.sub(r"(//[^/@]*?:)[^/@]*@", r"\1***@", url)
