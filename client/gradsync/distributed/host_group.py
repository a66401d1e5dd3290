"""A process group's host group: its ranks on one host sum an all-reduce in shared memory.

The ranks of a "gradsync" group that share a host (the same host id,
`gradsync_proto.host`) form a host group when the group is created;
the lowest of them leads. Each all-reduce it takes (`HostGroup.takes`: float32
or float64, SUM, AVG, PREMUL_SUM, MIN or MAX, at most `HOST_OP_MAX_BYTES`)
goes through it: every member copies its input into a block of its own arena
of the host's segment and tells the leader where; the leader reduces the
inputs in ascending rank (its own first) into its own tensor and uploads that
one input, naming the ranks it covers (`CollectiveChunk.covered_ranks`); it
writes the result into a block of its own arena and tells its members where,
which copy it out and say so (DONE), after which the block is free again. AVG
travels as a SUM that every rank divides by the group's size (the division
the coordinator would make, so the same bits). docs/backend.md says what
stays flat and how the sums compare with the flat path's.

Why not the model wrapper's `LocalGroup`: that one is shaped by steps and a
fixed bucket layout, summed share by share by every member. A process group
has neither: ops of any size come one after another, numbered by the group's
collective sequence, several in flight. So this module keeps a thin protocol
of its own on the same primitives (the abstract-socket rendezvous with its
secret and uid check, one unnamed segment handed over by fd): the segment is
a sparse file of one arena per member (`gradsync.distributed.host_arena`),
whose pages are reserved as the blocks of the ops in flight first reach them,
so a rank holds about what it has in flight (DDP over a 32 MB model: about
32 MB per rank) rather than `slots` regions of the largest op. SOCK_SEQPACKET
messages say "my input of op k is at offset o" (POSTED, with the op's
sequence number, op, dtype and element count), "the result of op k is at
offset o" (RESULT), "I copied the result of op k out" (DONE), "my input of op
k found no shared memory, because ..." (REFUSED) or "op k failed, because
..." (FAILED).

Checks: the leader checks each member's sequence number, op, dtype and
element count against its own and fails the op on every rank of the host
naming both values; the coordinator checks the leaders against each other as
for any input. The coordinator still numbers every rank's collectives (a
member reserves each op's number without sending it, so the flat ops that
follow stay paired) and still hears every rank's heartbeats on its own
stream, so a lost or slow rank is named as before: a member's lag reaches
the coordinator as the time its leader waited for it.

Faults: a member whose process ends closes its socket; its leader uploads
the ops it had not posted without it, so the coordinator, which lost the rank
too, fails them naming it (`--on-failure abort`) or completes them with fewer
contributors, which the process group refuses (`elastic`). A leader whose
process ends fails every pending op of its members at once ("local leader
rank 0 disconnected"). A result that does not come fails within the group's
timeout. A coordinator restart: the leader's link reconnects and sends its
uploads in flight again (with the ranks they cover); it tells its members,
whose links have nothing in flight to notice the loss by, to rejoin too. A
shared segment that cannot be made makes the host's ranks units of one, with
a warning: the op mapping stays the same on every rank, only without shared
memory. A block that the shared-memory directory cannot back later (too
small a /dev/shm for the ops in flight) fails that op on every rank of the
host, naming the bytes and the directory.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import secrets
import selectors
import socket
import struct
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from gradsync_proto.host import host_id
from gradsync_proto.v1 import gradsync_pb2 as pb

from gradsync.distributed.host_arena import Arena, arena_bytes
from gradsync.distributed.reconnect import ResumingLink
from gradsync.errors import GradSyncError, SharedMemoryError, SyncTimeoutError
from gradsync.local.local_rendezvous import Formed, follow, lead
from gradsync.local.local_segment import SegmentLayout, shm_dir

log = logging.getLogger("gradsync.client")

__all__ = [
    "ENV_HIERARCHICAL",
    "HOST_OP_MAX_BYTES",
    "HostGroup",
    "form_host_group",
    "resolve_hierarchical",
]

#: Environment variable giving `GradsyncOptions.hierarchical` when it is not passed.
ENV_HIERARCHICAL = "GRADSYNC_HIERARCHICAL"
_VALUES: dict[str, str] = {"auto": "auto", "1": "on", "true": "on", "0": "off", "false": "off"}
#: The largest all-reduce input a host group sums (larger ones stay flat): DDP's default
#: 25 MiB buckets, and a bucket of one parameter up to this size.
HOST_OP_MAX_BYTES = 64 << 20
#: The dtypes a host group sums, and their codes on the wire.
HOST_DTYPES: dict[torch.dtype, int] = {
    torch.float32: pb.DTYPE_FLOAT32,
    torch.float64: pb.DTYPE_FLOAT64,
}
#: The reduce ops a host group takes (the process group's names), and what the hosts send.
HOST_OPS: dict[str, int] = {
    "sum": pb.COLLECTIVE_OP_SUM,
    "avg": pb.COLLECTIVE_OP_SUM,
    "min": pb.COLLECTIVE_OP_MIN,
    "max": pb.COLLECTIVE_OP_MAX,
}
_OP_NAMES = {"sum": 1, "avg": 2, "min": 3, "max": 4}
#: How the leader folds a member's input into its own, by op.
_COMBINE: dict[str, Callable[..., torch.Tensor]] = {
    "sum": torch.add,
    "avg": torch.add,
    "min": torch.minimum,
    "max": torch.maximum,
}
_NAME_OF = {code: name for name, code in _OP_NAMES.items()}
_ITEMSIZE: dict[int, int] = {pb.DTYPE_FLOAT32: 4, pb.DTYPE_FLOAT64: 8}
#: kind, op, dtype, then host op number, sequence, element count / contributors, the
#: block's offset in the segment; a tail.
_MESSAGE = struct.Struct("<BBBxxxxxQQQQ")
_POSTED, _RESULT, _FAILED, _LOST, _DONE, _REFUSED = 1, 2, 3, 4, 5, 6
_MAX_MESSAGE = 1 << 16


def _message(kind: int, number: int = 0, sequence: int = 0, text: str = "") -> bytes:
    """A message without op, dtype, count and offset, with `text` (cut short) as its tail."""
    return _MESSAGE.pack(kind, 0, 0, number, sequence, 0, 0) + text.encode()[: _MAX_MESSAGE // 2]


def _tail(raw: bytes) -> str:
    """A message's text."""
    return raw[_MESSAGE.size :].decode(errors="replace")


#: How often a wait looks again at a failure recorded meanwhile.
_POLL_S = 0.5


def resolve_hierarchical(value: str | bool | None, environ: Mapping[str, str] | None = None) -> str:
    """ "auto", "on" or "off": `value`, else $GRADSYNC_HIERARCHICAL, else "auto".

    Raises:
        ValueError: another value.
    """
    if isinstance(value, bool):
        return "on" if value else "off"
    env = os.environ if environ is None else environ
    raw = value if value is not None else env.get(ENV_HIERARCHICAL, "auto")
    resolved = _VALUES.get(str(raw).strip().lower())
    if resolved is None:
        where = "GradsyncOptions.hierarchical" if value is not None else f"${ENV_HIERARCHICAL}"
        raise ValueError(f"{where}={raw!r}: expected one of {', '.join(_VALUES)}")
    return resolved


@dataclass
class _Op:
    """One all-reduce of this rank through the host group."""

    number: int
    sequence: int
    op: str
    dtype: torch.dtype
    numel: int
    #: The caller's tensor, and where the op works (it, or a contiguous CPU copy).
    tensor: torch.Tensor
    work: torch.Tensor
    ready: Callable[[], None]
    divide_by: int | None
    posted_at: float = field(default_factory=time.monotonic)
    launched: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None
    contributors: int = 0
    #: A member's input block; where the leader put the result (segment offsets).
    block: int | None = None
    result_at: int = 0


class HostGroup:
    """This rank's side of its host group (see the module docstring).

    Args:
        members: the group ranks on this host, ascending (members[0] leads).
        rank, world_size: this rank in the process group, and its size.
        link: the group's link (numbers and sends the collectives).
        formed: the rendezvous's sockets and segment (None for a group of one).
        slots: the process group's ops in flight, at most (sizes each arena).
        timeout_s: bound on every wait.
    """

    def __init__(
        self,
        members: list[int],
        rank: int,
        world_size: int,
        link: ResumingLink,
        formed: Formed | None,
        slots: int,
        timeout_s: float,
    ) -> None:
        self.members = members
        self.rank = rank
        self.world_size = world_size
        self.index = members.index(rank)
        self.leads = self.index == 0
        self._link = link
        self._timeout_s = timeout_s
        self._lock = threading.RLock()
        self._next = 0
        self._ops: dict[int, _Op] = {}
        self._failure: str | None = None
        self._closed = False
        #: Ops this rank took through the host group; bytes it uploaded for the host.
        self.ops = 0
        self.uploaded_bytes = 0
        self._peers = dict(formed.peers) if formed is not None else {}
        self._fd: int | None = None
        self._arena: Arena | None = None
        if formed is not None:
            # Every rank sizes the sparse file to all arenas before mapping it (the same
            # size on each: whichever comes first grows it; nothing is reserved by it).
            size = arena_bytes(slots, HOST_OP_MAX_BYTES)
            total = size * len(members)
            if os.fstat(formed.segment_fd).st_size < total:
                os.ftruncate(formed.segment_fd, total)
            self._fd = formed.segment_fd
            self._arena = Arena(self._fd, self.index * size, size, shm_dir())
            # (The array holds the mapping: it lives as long as the host group.)
            self._whole = np.frombuffer(mmap.mmap(self._fd, total, mmap.MAP_SHARED), dtype=np.uint8)
        # Leader: each member's POSTED ops by number (time, sequence, op, dtype, numel,
        # offset), and why a member's input found no shared memory, by op number.
        self._posted: dict[int, dict[int, tuple[float, int, int, int, int, int]]] = {
            i: {} for i in range(1, len(members))
        }
        self._refused: dict[int, str] = {}
        # Leader: each result block handed out, by op number: (offset, members yet to copy).
        self._results: dict[int, tuple[int, set[int]]] = {}
        self._gone: set[int] = set()
        self._next_launch = 0
        self._thread: threading.Thread | None = None
        if self._peers and self.leads:
            link.on_lost = self._pass_lost
        if self._peers:
            self._thread = threading.Thread(
                target=self._serve_leader if self.leads else self._serve_member,
                name=f"gradsync-host-r{rank}",
                daemon=True,
            )
            self._thread.start()

    # ------------------------------------------------------------ issuing
    @staticmethod
    def takes(tensor: torch.Tensor, op: str) -> bool:
        """Whether an all-reduce of `tensor` with `op` goes through the host group (the
        same answer on every rank of a group whose calls agree)."""
        return (
            tensor.dtype in HOST_DTYPES
            and op in HOST_OPS
            and tensor.numel() * tensor.element_size() <= HOST_OP_MAX_BYTES
        )

    def start(self, tensor: torch.Tensor, op: str, ready: Callable[[], None]) -> Callable[[], int]:
        """Issue an all-reduce of `tensor` (never blocks); return `finish`, which waits
        (bounded) for the result, writes it into `tensor` and returns the contributors.
        `ready` is told once `finish` would not block.

        Raises:
            GradSyncError: the host group failed before (named), or the leader is gone.
        """
        with self._lock:
            if self._failure is not None:
                raise GradSyncError(self._failure, rank=self.rank)
            sequence = self._link.reserve_collective(carried=not self.leads)
            number = self._next
            self._next += 1
            self.ops += 1
        staged = tensor.device.type == "cpu" and tensor.is_contiguous()
        work = tensor.detach() if staged else tensor.detach().to("cpu").contiguous()
        divide_by = self.world_size if op == "avg" else None
        item = _Op(
            number, sequence, op, tensor.dtype, tensor.numel(), tensor, work, ready, divide_by
        )
        if self.leads:
            with self._lock:
                self._ops[number] = item
            self._launch_ready()
            return lambda: self._finish_leader(item)
        try:
            with self._lock:
                item.block = self._allocate(item.numel * tensor.element_size())
        except SharedMemoryError as exc:
            refused = _message(_REFUSED, number, sequence, f"local rank {self.rank}: {exc}")
            with contextlib.suppress(OSError):
                self._peers[0].send(refused)
            raise SharedMemoryError(str(exc), rank=self.rank) from None
        self._at(item.block, item)[: item.numel].copy_(work.reshape(-1))
        with self._lock:
            self._ops[number] = item
        kinds = (_OP_NAMES[op], HOST_DTYPES[item.dtype])
        message = _MESSAGE.pack(_POSTED, *kinds, number, sequence, item.numel, item.block)
        try:
            self._peers[0].send(message)
        except OSError as exc:
            with self._lock:
                self._ops.pop(number, None)
                self._free(item.block)
            raise GradSyncError(
                f"local leader rank {self.members[0]} disconnected ({exc}); this host's "
                "ranks sum their all-reduces through it",
                rank=self.rank,
            ) from exc
        return lambda: self._finish_member(item)

    # ------------------------------------------------------------ the leader
    def _launch_ready(self) -> None:
        """Upload, in order, every op whose inputs are all in the segment (any thread)."""
        told: list[Callable[[], None]] = []
        with self._lock:
            while True:
                item = self._ops.get(self._next_launch)
                if item is None or item.launched.is_set():
                    break
                # A member that is gone still counts where it posted before it went.
                live = [
                    i
                    for i in range(1, len(self.members))
                    if i not in self._gone or item.number in self._posted[i]
                ]
                if any(item.number not in self._posted[i] for i in live):
                    break
                self._next_launch += 1
                try:
                    self._upload(item, live)
                except Exception as exc:  # a mismatch, or the link refused it
                    item.error = exc
                    self._tell_failed(item.number, str(exc))
                    told.append(item.ready)
                finally:
                    for i in live:
                        self._posted[i].pop(item.number, None)
                    item.launched.set()
        for ready in told:
            ready()

    def _upload(self, item: _Op, live: list[int]) -> None:
        """Reduce the host's inputs of `item` (ascending rank) and send them (lock held)."""
        mine = (item.sequence, _OP_NAMES[item.op], HOST_DTYPES[item.dtype], item.numel)
        now = time.monotonic()
        waited = [now - item.posted_at]
        acc = item.work.view(-1)
        refused = self._refused.pop(item.number, None)
        if refused is not None:
            raise GradSyncError(refused, rank=self.rank)
        for i in live:
            posted_at, *theirs, offset = self._posted[i][item.number]
            if tuple(theirs) != mine:
                raise GradSyncError(
                    f"local rank {self.members[i]} issued collective {theirs[0]} as "
                    f"{_describe(*theirs[1:])}, but rank {self.rank} issued collective "
                    f"{mine[0]} as {_describe(*mine[1:])} (every rank must issue the same "
                    "collectives in the same order)",
                    rank=self.rank,
                )
            other = self._at(offset, item)[: item.numel]
            with torch.no_grad():
                _COMBINE[item.op](acc, other, out=acc)
            waited.append(now - posted_at)
        covered = [self.members[0], *(self.members[i] for i in live)]
        template = pb.CollectiveChunk(covered_ranks=covered, covered_waited_s=waited)
        payload = acc.view(torch.uint8).numpy()
        self._link.issue_collective(
            HOST_OPS[item.op],
            HOST_DTYPES[item.dtype],
            payload,
            0,
            template=template,
            on_ready=item.ready,
            sequence=item.sequence,
        )
        self.uploaded_bytes += payload.nbytes

    def _finish_leader(self, item: _Op) -> int:
        deadline = time.monotonic() + self._timeout_s
        try:
            self._await_launch(item, deadline, self._missing_inputs)
            if item.error is not None:
                raise item.error
            result, count = self._link.wait_collective(
                item.sequence, max(0.0, deadline - time.monotonic())
            )
            values = torch.frombuffer(result, dtype=item.dtype) if len(result) else item.work
            with torch.no_grad():
                flat = item.work.view(-1)
                flat.copy_(values)
                if item.divide_by is not None:
                    flat.div_(item.divide_by)
            if self._peers:
                with self._lock:
                    block = self._allocate(item.numel * item.work.element_size())
                    waiting = {i for i in self._peers if i not in self._gone}
                    if waiting:
                        self._results[item.number] = (block, waiting)
                    else:
                        self._free(block)
                self._at(block, item)[: item.numel].copy_(flat)
                self._tell(_MESSAGE.pack(_RESULT, 0, 0, item.number, item.sequence, count, block))
            if item.work is not item.tensor:
                with torch.no_grad():
                    item.tensor.copy_(item.work.reshape(item.tensor.shape))
            return int(count)
        except Exception as exc:
            self._tell_failed(item.number, str(exc))
            raise
        finally:
            with self._lock:
                self._ops.pop(item.number, None)

    def _pass_lost(self, why: str) -> None:
        """The leader's link lost the coordinator: the members' links reconnect too (their
        heartbeats alone would not notice, and the restarted job waits for every rank)."""
        text = f"local leader rank {self.members[0]} lost the coordinator: {why}"
        self._tell(_message(_LOST, text=text))

    def _tell_failed(self, number: int, why: str) -> None:
        self._tell(_message(_FAILED, number, text=f"local leader rank {self.members[0]}: {why}"))

    def _tell(self, message: bytes) -> None:
        for i, conn in list(self._peers.items()):
            if i in self._gone:
                continue
            try:
                conn.send(message)
            except OSError:
                self._lost_member(i)

    def _serve_leader(self) -> None:
        selector = selectors.DefaultSelector()
        for i, conn in self._peers.items():
            selector.register(conn, selectors.EVENT_READ, i)
        try:
            while not self._closed and len(self._gone) < len(self._peers):
                for key, _ in selector.select(_POLL_S):
                    i = int(key.data)
                    try:
                        raw = key.fileobj.recv(_MAX_MESSAGE)  # type: ignore[union-attr]
                    except OSError:
                        raw = b""
                    if len(raw) < _MESSAGE.size:
                        selector.unregister(key.fileobj)
                        self._lost_member(i)
                        continue
                    kind, op, dtype, number, sequence, numel, offset = _MESSAGE.unpack_from(raw)
                    with self._lock:
                        if kind == _DONE:
                            self._copied(number, i)
                            continue
                        if kind == _REFUSED:
                            self._refused.setdefault(number, _tail(raw))
                            offset = -1
                        elif kind != _POSTED:
                            continue
                        posted = (time.monotonic(), sequence, op, dtype, numel, offset)
                        self._posted[i][number] = posted
                    self._launch_ready()
        finally:
            selector.close()

    def _lost_member(self, index: int) -> None:
        """A member's process ended: the ops it did not post go up without it."""
        with self._lock:
            if index in self._gone:
                return
            self._gone.add(index)
            for number in list(self._results):
                self._copied(number, index)
        log.warning(
            "rank %d: local rank %d of this host's group disconnected; its host's "
            "all-reduces go to the coordinator without it",
            self.rank,
            self.members[index],
        )
        self._launch_ready()

    # ------------------------------------------------------------ a member
    def _finish_member(self, item: _Op) -> int:
        deadline = time.monotonic() + self._timeout_s
        try:
            self._await_launch(item, deadline, self._missing_result)
            if item.error is not None:
                with self._lock:  # (the leader read it before it failed the op)
                    self._free(item.block)
                raise item.error
            with torch.no_grad():
                item.tensor.copy_(
                    self._at(item.result_at, item)[: item.numel].reshape(item.tensor.shape)
                )
            with self._lock:
                self._free(item.block)
            with contextlib.suppress(OSError):  # (a leader gone fails what is left anyway)
                self._peers[0].send(_message(_DONE, item.number, item.sequence))
            return item.contributors
        finally:
            with self._lock:
                self._ops.pop(item.number, None)

    def _serve_member(self) -> None:
        conn = self._peers[0]
        conn.settimeout(_POLL_S)
        while not self._closed:
            try:
                raw = conn.recv(_MAX_MESSAGE)
            except TimeoutError:
                continue
            except OSError:
                raw = b""
            if len(raw) < _MESSAGE.size:
                self._fail_all(
                    f"local leader rank {self.members[0]} disconnected (its process ended?); "
                    "this host's ranks sum their all-reduces through it"
                )
                return
            kind, _, _, number, _, count, offset = _MESSAGE.unpack_from(raw)
            if kind == _LOST:
                self._link.reconnect(_tail(raw))
                continue
            with self._lock:
                item = self._ops.get(number)
            if item is None:
                continue
            if kind == _FAILED:
                item.error = GradSyncError(_tail(raw), rank=self.rank)
            item.contributors = int(count)
            item.result_at = int(offset)
            item.launched.set()
            item.ready()

    def _fail_all(self, why: str) -> None:
        with self._lock:
            if self._closed:
                return
            self._failure = why
            pending = [item for item in self._ops.values() if not item.launched.is_set()]
            for item in pending:
                item.error = GradSyncError(why, rank=self.rank)
                item.launched.set()
        for item in pending:
            item.ready()

    # ------------------------------------------------------------ helpers
    def _await_launch(self, item: _Op, deadline: float, awaited: Callable[[_Op], str]) -> None:
        """Wait until `item` was launched; past `deadline`, fail naming what was `awaited`."""
        while not item.launched.wait(min(_POLL_S, max(0.0, deadline - time.monotonic()))):
            if time.monotonic() >= deadline:
                raise SyncTimeoutError(
                    f"timed out after {self._timeout_s:g}s waiting for {awaited(item)}",
                    rank=self.rank,
                )

    def _missing_inputs(self, item: _Op) -> str:
        with self._lock:
            missing = [
                self.members[i]
                for i in self._posted
                if i not in self._gone and item.number not in self._posted[i]
            ]
        return f"local ranks {missing} to post their input of collective {item.sequence}"

    def _missing_result(self, item: _Op) -> str:
        leader = self.members[0]
        return f"local leader rank {leader} to hand out the result of collective {item.sequence}"

    def _at(self, offset: int, item: _Op) -> torch.Tensor:
        """The segment's bytes at `offset` for `item`, as its dtype."""
        nbytes = item.numel * item.work.element_size()
        if offset < 0 or offset + nbytes > len(self._whole):
            raise GradSyncError(
                f"a block of {nbytes} bytes at offset {offset} lies outside this host's "
                f"segment of {len(self._whole)} bytes",
                rank=self.rank,
            )
        return torch.from_numpy(self._whole[offset : offset + nbytes]).view(item.dtype)

    def _allocate(self, nbytes: int) -> int:
        """A block of this rank's arena (lock held; see `host_arena`)."""
        if self._arena is None:
            raise GradSyncError("this host group has no shared segment", rank=self.rank)
        return self._arena.allocate(nbytes)

    def _free(self, block: int | None) -> None:
        if block is not None and self._arena is not None:
            self._arena.free(block)

    def _copied(self, number: int, index: int) -> None:
        """Member `index` copied the result of host op `number` out, or is gone (lock held)."""
        held = self._results.get(number)
        if held is None:
            return
        held[1].discard(index)
        if not held[1]:
            del self._results[number]
            self._free(held[0])

    @property
    def reserved_bytes(self) -> int:
        """Shared memory this rank's arena holds (its blocks' high-water mark, in steps)."""
        return self._arena.reserved if self._arena is not None else 0

    def close(self) -> None:
        """Stop the host group's thread and close its sockets and segment. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        for conn in self._peers.values():
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
            conn.close()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(2 * _POLL_S)
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def _describe(op: int, dtype: int, numel: int) -> str:
    """'all_reduce sum of 3 float32 (12 bytes)'."""
    name = pb.DType.Name(dtype).removeprefix("DTYPE_").lower() if dtype in _ITEMSIZE else dtype
    size = numel * _ITEMSIZE.get(dtype, 0)
    return f"all_reduce {_NAME_OF.get(op, op)} of {numel} {name} ({size} bytes)"


def form_host_group(
    store: Any,
    rank: int,
    world_size: int,
    job_id: str,
    setting: str,
    link: ResumingLink,
    slots: int,
    timeout_s: float,
) -> HostGroup | None:
    """Find this rank's host group through the c10d `store` and form it; None when the
    group runs flat (`setting` "off", or "auto" with no two ranks on one host).

    Every rank publishes its host id and setting; all must name the same setting.

    Raises:
        ValueError: the ranks' settings differ.
    """
    me = host_id()
    store.set(f"gradsync/host/{rank}", f"{setting}|{me}")
    hosts: dict[str, list[int]] = {}
    settings: dict[int, str] = {}
    for other in range(world_size):
        raw = store.get(f"gradsync/host/{other}")
        text = raw.decode() if isinstance(raw, bytes) else str(raw)
        setting_of, _, host = text.partition("|")
        settings[other] = setting_of
        hosts.setdefault(host, []).append(other)
    if len(set(settings.values())) != 1:
        raise ValueError(
            f"gradsync backend: the ranks of job '{job_id}' disagree on hierarchical "
            f"(rank {rank}: {setting!r}; {sorted(settings.items())}): set "
            "$GRADSYNC_HIERARCHICAL the same on every rank"
        )
    if setting == "off" or (setting == "auto" and max(len(r) for r in hosts.values()) < 2):
        return None
    members = sorted(hosts[me])
    formed: Formed | None = None
    if len(members) > 1:
        formed = _rendezvous(store, rank, members, job_id, slots, timeout_s)
        if formed is None:
            members = [rank]
    log.info(
        "rank %d: job '%s' sums its all-reduces on this host with ranks %s (leader %d)",
        rank,
        job_id,
        members,
        members[0],
    )
    return HostGroup(members, rank, world_size, link, formed, slots, timeout_s)


def _rendezvous(
    store: Any, rank: int, members: list[int], job_id: str, slots: int, timeout_s: float
) -> Formed | None:
    """The host group's sockets and segment; None (a warning) when they cannot be made."""
    key = f"gradsync/host-secret/{members[0]}"
    deadline = time.monotonic() + timeout_s
    # The file starts with one page; each rank sizes it and reserves its own arena's pages
    # as its ops need them (`host_arena`), so nothing more is taken up front.
    layout = SegmentLayout((0,), len(members) - 1)
    try:
        if rank == members[0]:
            secret = secrets.token_bytes(16)
            store.set(key, secret.hex())
            return lead(job_id, members, secret, layout, deadline, shm_dir())
        raw = store.get(key)
        secret = bytes.fromhex(raw.decode() if isinstance(raw, bytes) else str(raw))
        return follow(job_id, rank, members, secret, deadline)
    except GradSyncError as exc:
        log.warning(
            "rank %d: this host's ranks %s sum nothing in shared memory (%s); each "
            "sends its own input",
            rank,
            members,
            exc,
        )
        return None
