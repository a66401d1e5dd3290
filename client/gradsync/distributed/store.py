"""`CoordinatorStore`: torch.distributed's c10d Store, served by the gradsync coordinator.

c10d meets through a key-value store: `init_process_group` publishes and reads
each rank's address (gloo) or unique id (NCCL) there, `new_group`, DeviceMesh
and store-based barriers count arrivals there. With this store the
coordinator serves it (`Coordinator.Store` on its gRPC port, one call per
operation), so ranks need only their outbound connection to the coordinator
and nothing listens on rank 0::

    store = CoordinatorStore("coordinator-host:50051", namespace="my-job",
                             security=ChannelSecurity.resolve(), timeout=timedelta(minutes=5))
    torch.distributed.init_process_group("gloo", store=store, rank=rank, world_size=world)

Keys live in `namespace` (the job id every rank uses). The token and TLS of
`security` go with every call, as for every other gradsync RPC. A blocking
`get` or `wait` waits on the coordinator (no thread held there) for at most
the store's timeout and then raises `torch.distributed.DistStoreError`
naming the keys; every failure raises it, with the coordinator's words (a
wrong token, a limit: key and value sizes, keys and bytes per namespace). A
coordinator that is not up yet is waited for, within the same timeout. The
store lives in the coordinator's memory: a restarted coordinator starts with
an empty one.

The `gradsync://host:port` rendezvous (`handler`) hands c10d this store:
`dist.init_process_group("gradsync", init_method="gradsync://host:50051")`. Rank
and world size come from the URL's query (`?rank=0&world_size=2`, which c10d
adds when `init_process_group` is given them) or from $RANK / $WORLD_SIZE, as
torchrun sets them; the namespace is the job id ($GRADSYNC_JOB_ID, default
"default"); TLS and the token are resolved as for the model wrapper
(`ChannelSecurity.resolve`). The handler also remembers the coordinator it was
given, so that the backend's groups join that coordinator
(`coordinator_of_rendezvous`) without $GRADSYNC_COORDINATOR being set as well.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any
from urllib.parse import parse_qs, urlparse

import grpc
import torch.distributed as dist
from gradsync_proto.net.address import parse_address
from gradsync_proto.net.channels import ChannelSecurity
from gradsync_proto.v1 import gradsync_pb2 as pb
from torch._C._distributed_c10d import Store  # the class torch.distributed.Store names

from gradsync import defaults
from gradsync.config import ENV_JOB_ID, ENV_RANK, ENV_WORLD_SIZE

__all__ = ["CoordinatorStore", "coordinator_of_rendezvous", "handler", "parse_url"]

#: The coordinator's store method.
STORE_METHOD = "/gradsync.v1.Coordinator/Store"
#: Beyond a blocking call's own timeout, how long the reply may take to come back.
REPLY_MARGIN_S = 5.0
#: Largest reply accepted (a value is at most 1 MiB at the coordinator).
MAX_REPLY_BYTES = 4 << 20


class CoordinatorStore(Store):
    """A c10d Store whose keys live on the gradsync coordinator, in one namespace.

    Args:
        address: the coordinator's "host:port" (a "gradsync://" prefix is allowed).
        namespace: where the keys live: the job id every rank of the job passes.
        security: TLS and token for the calls (`ChannelSecurity.resolve()` reads
            the GRADSYNC_TLS_* / GRADSYNC_TOKEN* environment).
        timeout: how long `get` and `wait` wait for keys, and every call for a reply.

    Raises:
        ValueError: an empty address or namespace, or a timeout that is not positive.
    """

    #: How long `get` and `wait` wait (torch's own property, set by `set_timeout`).
    timeout: timedelta

    def __init__(
        self, address: str, *, namespace: str, security: ChannelSecurity, timeout: timedelta
    ) -> None:
        super().__init__()  # the pybind trampoline needs its base initialised
        target = address.removeprefix("gradsync://")
        if not target:
            raise ValueError("CoordinatorStore needs the coordinator's address (host:port)")
        if not namespace:
            raise ValueError("CoordinatorStore needs a namespace (the job id)")
        if timeout.total_seconds() <= 0:
            raise ValueError(f"CoordinatorStore's timeout must be positive, got {timeout}")
        self.address = target
        self.namespace = namespace
        self._metadata = security.metadata
        self._channel = security.channel(
            target, options=[("grpc.max_receive_message_length", MAX_REPLY_BYTES)]
        )
        self._call = self._channel.unary_unary(
            STORE_METHOD,
            request_serializer=pb.StoreRequest.SerializeToString,
            response_deserializer=pb.StoreReply.FromString,
        )
        self.set_timeout(timeout)

    # ------------------------------------------------------- c10d's Store API
    def set(self, key: str, value: bytes | str) -> None:
        """Set `key` to `value`, waking every rank waiting for it."""
        self._request(pb.STORE_OP_SET, [key], value=_bytes(value))

    def get(self, key: str) -> bytes:
        """The value of `key`, waiting (at most the store's timeout) until it is set."""
        return bytes(self._blocking(pb.STORE_OP_GET, [key], self.timeout).value)

    def add(self, key: str, amount: int) -> int:
        """Add `amount` to the integer at `key` (0 when absent), atomically; return the sum."""
        return int(self._request(pb.STORE_OP_ADD, [key], amount=int(amount)).number)

    def compare_set(
        self, key: str, expected_value: bytes | str, desired_value: bytes | str
    ) -> bytes:
        """Set `key` to `desired_value` if it holds `expected_value` (or is absent and
        `expected_value` is empty); return the value it holds afterwards (an absent key
        with a non-empty `expected_value` returns `expected_value`, as torch's stores do)."""
        reply = self._request(
            pb.STORE_OP_COMPARE_SET,
            [key],
            expected=_bytes(expected_value),
            value=_bytes(desired_value),
        )
        return bytes(reply.value)

    def check(self, keys: list[str]) -> bool:
        """Whether every key of `keys` is set now (does not wait)."""
        return bool(self._request(pb.STORE_OP_CHECK, list(keys)).found)

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        """Wait until every key of `keys` is set, for at most `timeout` (default: the
        store's timeout)."""
        self._blocking(pb.STORE_OP_WAIT, list(keys), self.timeout if timeout is None else timeout)

    def delete_key(self, key: str) -> bool:
        """Delete `key`; whether it existed."""
        return bool(self._request(pb.STORE_OP_DELETE_KEY, [key]).found)

    def num_keys(self) -> int:
        """How many keys the namespace holds."""
        return int(self._request(pb.STORE_OP_NUM_KEYS, []).number)

    def close(self) -> None:
        """Close the channel to the coordinator (later calls fail)."""
        self._channel.close()

    # ------------------------------------------------------------- the calls
    def _blocking(self, op: int, keys: list[str], timeout: timedelta) -> pb.StoreReply:
        wait_s = max(timeout.total_seconds(), 0.0)
        return self._request(
            op, keys, timeout_ms=int(wait_s * 1000), deadline_s=wait_s + REPLY_MARGIN_S
        )

    def _request(
        self, op: int, keys: list[str], *, deadline_s: float | None = None, **fields: object
    ) -> pb.StoreReply:
        request = pb.StoreRequest(
            op=op,  # type: ignore[arg-type]
            namespace=self.namespace,
            keys=keys,
            **fields,  # type: ignore[arg-type]
        )
        if deadline_s is None:
            deadline_s = self.timeout.total_seconds()
        try:
            reply: pb.StoreReply = self._call(
                request, timeout=deadline_s, metadata=self._metadata, wait_for_ready=True
            )
        except grpc.RpcError as exc:
            raise dist.DistStoreError(self._describe(op, keys, exc, deadline_s)) from None
        return reply

    def _describe(self, op: int, keys: list[str], exc: grpc.RpcError, deadline_s: float) -> str:
        what = str(pb.StoreOp.Name(op)).removeprefix("STORE_OP_").lower()
        if keys:
            what += f" {keys[:4]}{' ...' if len(keys) > 4 else ''}"
        code = exc.code() if callable(getattr(exc, "code", None)) else None
        details = exc.details() if callable(getattr(exc, "details", None)) else str(exc)
        if code == grpc.StatusCode.DEADLINE_EXCEEDED and details == "Deadline Exceeded":
            details = (
                f"no reply from the coordinator at {self.address} within {deadline_s:.1f} s "
                "(not running, or unreachable?)"
            )
        name = code.name if code is not None else "error"
        return (
            f"gradsync store {what} in namespace {self.namespace!r} at {self.address} "
            f"failed ({name}): {details}"
        )


def _bytes(value: bytes | str) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)


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
