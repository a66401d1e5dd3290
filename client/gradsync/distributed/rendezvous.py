"""The `gradsync://host:port` rendezvous: c10d's store, served by the coordinator.

`dist.init_process_group("gradsync", init_method="gradsync://host:50051")`
needs a key-value store that every rank reaches; with this handler it is the
coordinator's (`gradsync.distributed.store.CoordinatorStore`), so workers
keep needing only an outbound connection and nothing listens on rank 0. Rank
and world size come from the URL's query (`?rank=0&world_size=2`, which c10d
adds when `init_process_group` is given them) or from $RANK / $WORLD_SIZE,
as torchrun sets them. The store's namespace is the job id ($GRADSYNC_JOB_ID,
default "default"); TLS and the token are resolved as for the model wrapper
(`ChannelSecurity.resolve`: $GRADSYNC_TLS_CA, $GRADSYNC_TOKEN, ...).

The handler also remembers the coordinator it was given, so that the
backend's groups join that coordinator (`coordinator_of_rendezvous`) without
$GRADSYNC_COORDINATOR being set as well.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any
from urllib.parse import parse_qs, urlparse

from gradsync_proto.net.address import parse_address
from gradsync_proto.net.channels import ChannelSecurity

from gradsync import defaults
from gradsync.config import ENV_JOB_ID, ENV_RANK, ENV_WORLD_SIZE
from gradsync.distributed.store import CoordinatorStore

#: The URL scheme c10d hands to this module's handler.
SCHEME = "gradsync"


@dataclass(frozen=True)
class RendezvousTarget:
    """What a `gradsync://` URL names: the coordinator, this rank and the world."""

    address: str
    rank: int
    world_size: int


_lock = threading.Lock()
_remembered: str | None = None


def parse_url(url: str, environ: Mapping[str, str] | None = None) -> RendezvousTarget:
    """The coordinator, rank and world size a `gradsync://host:port[?rank=..&world_size=..]`
    URL names (rank and world size from $RANK / $WORLD_SIZE when the query has none).

    Raises:
        ValueError: not a gradsync:// URL, no host:port, or no rank / world size anywhere.
    """
    env = os.environ if environ is None else environ
    parsed = urlparse(url)
    if parsed.scheme != SCHEME or not parsed.netloc:
        raise ValueError(f"expected gradsync://host:port, got {url!r}")
    address = parsed.netloc
    try:
        parse_address(address)
    except ValueError as exc:
        raise ValueError(f"gradsync:// rendezvous: {url!r}: {exc}") from None
    query = {key: values[-1] for key, values in parse_qs(parsed.query).items()}
    numbers = {}
    for key, variable in (("rank", ENV_RANK), ("world_size", ENV_WORLD_SIZE)):
        raw = query.get(key) or env.get(variable)
        if raw is None:
            raise ValueError(
                f"gradsync:// rendezvous: no {key}: pass it to init_process_group or set "
                f"{variable} (torchrun does)"
            )
        try:
            numbers[key] = int(raw)
        except ValueError:
            raise ValueError(f"gradsync:// rendezvous: {key} {raw!r} is not an integer") from None
    return RendezvousTarget(address, numbers["rank"], numbers["world_size"])


def coordinator_of_rendezvous() -> str | None:
    """The coordinator of this process's latest gradsync:// rendezvous, or None."""
    with _lock:
        return _remembered


def handler(url: str, timeout: timedelta = timedelta(minutes=30), **_: Any) -> Iterator[Any]:
    """c10d's rendezvous handler for gradsync:// (a generator of (store, rank, world size))."""
    global _remembered
    target = parse_url(url)
    security = ChannelSecurity.resolve()
    namespace = os.environ.get(ENV_JOB_ID) or defaults.JOB_ID
    store = CoordinatorStore(
        target.address, namespace=namespace, security=security, timeout=timeout
    )
    with _lock:
        _remembered = target.address
    yield (store, target.rank, target.world_size)
    raise RuntimeError("gradsync:// rendezvous cannot be repeated in one process group's life")
