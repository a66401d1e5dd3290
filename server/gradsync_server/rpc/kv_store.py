"""A key-value store on the coordinator's gRPC port, for torch.distributed's rendezvous.

`torch.distributed.init_process_group` and everything after it (`new_group`,
DeviceMesh, barriers by store, a launcher's rendezvous) meet through a c10d
`Store`: set, blocking get, atomic add, compare-and-set, check, wait,
delete, count. Served here (`Coordinator.Store`, one unary call per
operation), the ranks need only their outbound connection to the coordinator,
so nothing listens on rank 0.

Keys live in a namespace, the job id the ranks share. Every call passes the
server's token check first (the interceptor in `auth_check`), so without the
token nothing is read or stored. Everything is bounded and refused with
RESOURCE_EXHAUSTED (or INVALID_ARGUMENT for a malformed request) naming the
limit: key and value sizes, keys and bytes per namespace, namespaces (an idle
one, with no waiter, is evicted to make room for a new one), waiters blocked
at once, and how long one may wait. A blocking GET or WAIT waits on an
asyncio future (no thread is held) and ends with DEADLINE_EXCEEDED naming the
keys still missing; a caller that goes away cancels its wait. The store lives
in the coordinator's memory: a restarted coordinator starts it empty (ranks
rendezvous again, as they would with a restarted TCPStore).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc
from gradsync_proto.v1 import gradsync_pb2 as pb

log = logging.getLogger("gradsync.server")

__all__ = ["KeyValueStore", "StoreLimits", "StoreRefused"]


@dataclass(frozen=True)
class StoreLimits:
    """What one coordinator's store holds at most (every size is in bytes)."""

    max_key_bytes: int = 4096
    max_value_bytes: int = 1 << 20
    max_keys_per_namespace: int = 65536
    max_namespace_bytes: int = 64 << 20
    max_namespaces: int = 1024
    max_namespace_name_bytes: int = 256
    #: Callers blocked in GET or WAIT at once, over all namespaces.
    max_waiters: int = 4096
    #: Longest a GET or WAIT may wait (longer timeouts are cut to it).
    max_wait_s: float = 3600.0
    #: A namespace with no waiter untouched this long may be evicted for a new one.
    idle_eviction_s: float = 600.0


class StoreRefused(Exception):
    """A request the store refuses: a gRPC status and words naming the key and limit."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass
class _Namespace:
    values: dict[str, bytes] = field(default_factory=dict)
    used_bytes: int = 0
    #: Futures of blocked callers, by the key each waits for next.
    waiters: dict[str, set[asyncio.Future[None]]] = field(default_factory=dict)
    touched_at: float = 0.0

    def waiting(self) -> int:
        return sum(len(futures) for futures in self.waiters.values())


class KeyValueStore:
    """Namespaced keys and values with blocking reads, on one asyncio loop (no locks).

    Args:
        limits: the bounds above.
        clock: monotonic seconds (for idle eviction).
    """

    def __init__(self, limits: StoreLimits | None = None, clock: Callable[[], float] | None = None):
        self.limits = limits or StoreLimits()
        self._clock = clock or (lambda: asyncio.get_running_loop().time())
        self._namespaces: dict[str, _Namespace] = {}
        self._waiters = 0

    def namespace_count(self) -> int:
        """Namespaces held now."""
        return len(self._namespaces)

    def waiting(self) -> int:
        """Callers blocked in GET or WAIT now."""
        return self._waiters

    # ---------------------------------------------------------------- RPC
    async def serve(self, raw: bytes, context: grpc.aio.ServicerContext) -> pb.StoreReply:
        """`Coordinator.Store`: parse, carry out, answer; a refusal aborts with its status."""
        request = pb.StoreRequest.FromString(raw)  # bad bytes: INVALID_ARGUMENT (`guarded`)
        try:
            return await self.handle(request)
        except StoreRefused as refused:
            await context.abort(refused.code, refused.message)
            raise  # not reached: abort raises

    async def handle(self, request: pb.StoreRequest) -> pb.StoreReply:
        """Carry out one request.

        Raises:
            StoreRefused: malformed, over a limit, or (GET, WAIT) the keys did not
                appear within the timeout.
        """
        op = request.op
        keys = list(request.keys)
        self._check_request(request, keys)
        held = self._namespaces.get(request.namespace)
        if op == pb.STORE_OP_NUM_KEYS:
            return pb.StoreReply(number=len(held.values) if held else 0)
        if op == pb.STORE_OP_CHECK:
            return pb.StoreReply(found=held is not None and all(k in held.values for k in keys))
        if op in (pb.STORE_OP_GET, pb.STORE_OP_WAIT):
            await self._wait(request.namespace, keys, request.timeout_ms / 1000)
            if op == pb.STORE_OP_WAIT:
                return pb.StoreReply(found=True)
            return pb.StoreReply(value=self._namespaces[request.namespace].values[keys[0]])
        if op == pb.STORE_OP_DELETE_KEY:
            return pb.StoreReply(found=self._delete(request.namespace, keys[0]))
        space = self._namespace_for_write(request.namespace)
        key = keys[0]
        if op == pb.STORE_OP_SET:
            self._put(request.namespace, space, key, request.value)
            return pb.StoreReply()
        if op == pb.STORE_OP_ADD:
            current = space.values.get(key, b"0")
            try:
                number = int(current.decode("ascii")) + request.amount
            except (UnicodeDecodeError, ValueError):
                raise StoreRefused(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"store add: key {key!r} in namespace {request.namespace!r} holds "
                    f"{current[:32]!r}, not an integer",
                ) from None
            self._put(request.namespace, space, key, str(number).encode("ascii"))
            return pb.StoreReply(number=number)
        # COMPARE_SET, as torch's stores: an absent key is set only when `expected` is
        # empty (else `expected` comes back); a present one only when it matches.
        current_value = space.values.get(key)
        if current_value is None and request.expected:
            self._forget_if_empty(request.namespace)
            return pb.StoreReply(value=request.expected)
        if current_value is None or current_value == request.expected:
            self._put(request.namespace, space, key, request.value)
            return pb.StoreReply(value=request.value)
        return pb.StoreReply(value=current_value)

    # ------------------------------------------------------------- checks
    def _check_request(self, request: pb.StoreRequest, keys: list[str]) -> None:
        limits = self.limits
        what = f"store {_op_name(request.op)}"
        if request.op == pb.STORE_OP_UNSPECIFIED or request.op not in pb.StoreOp.values():
            raise StoreRefused(grpc.StatusCode.INVALID_ARGUMENT, f"unknown store op {request.op}")
        name_bytes = len(request.namespace.encode())
        if not request.namespace or name_bytes > limits.max_namespace_name_bytes:
            raise StoreRefused(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"{what}: the namespace must be 1 to {limits.max_namespace_name_bytes} bytes "
                f"(the job id), got {name_bytes}",
            )
        single = request.op not in (pb.STORE_OP_CHECK, pb.STORE_OP_WAIT, pb.STORE_OP_NUM_KEYS)
        if single and len(keys) != 1:
            raise StoreRefused(
                grpc.StatusCode.INVALID_ARGUMENT, f"{what} takes one key, got {len(keys)}"
            )
        if len(keys) > limits.max_keys_per_namespace:
            raise StoreRefused(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"{what} names {len(keys)} keys, above the {limits.max_keys_per_namespace} a "
                "namespace may hold",
            )
        for key in keys:
            size = len(key.encode())
            if not size or size > limits.max_key_bytes:
                raise StoreRefused(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"{what}: key {key[:64]!r} is {size} bytes; keys must be 1 to "
                    f"{limits.max_key_bytes} bytes",
                )
        if len(request.value) > limits.max_value_bytes:
            raise StoreRefused(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"{what}: the value for key {keys[0][:64]!r} is {len(request.value)} bytes, "
                f"above the limit of {limits.max_value_bytes} bytes",
            )

    def _namespace_for_write(self, name: str) -> _Namespace:
        space = self._namespaces.get(name) or self._new_namespace(name)
        space.touched_at = self._clock()
        return space

    def _new_namespace(self, name: str) -> _Namespace:
        limits = self.limits
        if len(self._namespaces) >= limits.max_namespaces:
            now = self._clock()
            idle = [
                (held.touched_at, other)
                for other, held in self._namespaces.items()
                if not held.waiting() and now - held.touched_at >= limits.idle_eviction_s
            ]
            if not idle:
                raise StoreRefused(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"the store holds {len(self._namespaces)} namespaces (the limit), none "
                    f"idle for {limits.idle_eviction_s:.0f} s; namespace {name!r} refused",
                )
            _, oldest = min(idle)
            log.info("store: evicting namespace %r (idle) for %r", oldest, name)
            del self._namespaces[oldest]
        space = self._namespaces[name] = _Namespace(touched_at=self._clock())
        return space

    def _put(self, name: str, space: _Namespace, key: str, value: bytes) -> None:
        limits = self.limits
        old = space.values.get(key)
        if old is None and len(space.values) >= limits.max_keys_per_namespace:
            raise StoreRefused(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"store: namespace {name!r} holds {len(space.values)} keys (the limit); "
                f"key {key[:64]!r} refused",
            )
        grown = space.used_bytes - _size(key, old) + _size(key, value)
        if grown > limits.max_namespace_bytes:
            raise StoreRefused(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"store: namespace {name!r} would hold {grown} bytes with key {key[:64]!r}, "
                f"above the limit of {limits.max_namespace_bytes} bytes",
            )
        space.values[key] = value
        space.used_bytes = grown
        for future in space.waiters.pop(key, set()):
            if not future.done():
                future.set_result(None)

    def _delete(self, name: str, key: str) -> bool:
        space = self._namespaces.get(name)
        if space is None or key not in space.values:
            return False
        space.used_bytes -= _size(key, space.values.pop(key))
        self._forget_if_empty(name)
        return True

    def _forget_if_empty(self, name: str) -> None:
        space = self._namespaces.get(name)
        if space is not None and not space.values and not space.waiting():
            del self._namespaces[name]

    # -------------------------------------------------------------- waits
    async def _wait(self, name: str, keys: list[str], timeout_s: float) -> None:
        """Return once every key of `keys` is set in `name`; refuse past `timeout_s`."""
        limits = self.limits
        loop = asyncio.get_running_loop()
        deadline = loop.time() + min(max(timeout_s, 0.0), limits.max_wait_s)
        while True:
            space = self._namespaces.get(name)
            missing = [k for k in keys if space is None or k not in space.values]
            if not missing:
                return
            left = deadline - loop.time()
            if left <= 0:
                raise StoreRefused(
                    grpc.StatusCode.DEADLINE_EXCEEDED,
                    f"store: keys {[k[:64] for k in missing[:8]]} of namespace {name!r} were "
                    f"not set within {timeout_s:.3f} s",
                )
            if self._waiters >= limits.max_waiters:
                raise StoreRefused(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"store: {self._waiters} callers already wait for keys (the limit); "
                    f"a wait for {missing[0][:64]!r} in namespace {name!r} refused",
                )
            if space is None:
                space = self._new_namespace(name)
            future: asyncio.Future[None] = loop.create_future()
            space.waiters.setdefault(missing[0], set()).add(future)
            self._waiters += 1
            try:
                await asyncio.wait_for(asyncio.shield(future), left)
            except TimeoutError:
                pass
            finally:
                self._waiters -= 1
                waiting = space.waiters.get(missing[0])
                if waiting is not None:
                    waiting.discard(future)
                    if not waiting:
                        del space.waiters[missing[0]]
                self._forget_if_empty(name)


def _size(key: str, value: bytes | None) -> int:
    return 0 if value is None else len(key.encode()) + len(value)


def _op_name(op: int) -> str:
    try:
        return str(pb.StoreOp.Name(op)).removeprefix("STORE_OP_").lower()
    except ValueError:
        return f"<op {op}>"
