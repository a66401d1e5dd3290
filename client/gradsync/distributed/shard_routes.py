"""A process group's all-reduces spread over a sharded coordinator's shards.

With `gradsync serve --shards S` (or `--wait-for-shards`), a group's Welcome
lists the S shards, and the group's transport opens a `Shard.Data` stream to
each of shards 1..S-1 (`gradsync.path.shard_streams`). An all-reduce of at
least `MIN_SPREAD_BYTES` (and of at least S elements) is then cut into S
contiguous element ranges, the longer ones first, as the wrapper cuts a bucket
(`gradsync_proto.chunking.shard_ranges`): range 0 goes to the leader as the
group's collective (its sequence number, its checks), range i to shard i as a
collective of that range alone, numbered 0, 1, 2, ... per shard. Every rank
issues the same all-reduces in the same order, so the ranks' numbers agree on
every shard. Each shard reduces its range in ascending rank order with the
leader's code, so the result is bitwise the one a single coordinator computes,
whatever the order in which the ranks' inputs arrive. A 25 MB gradient bucket
thus travels on every shard's link at once, each carrying 1/S of it.

Everything else stays on the leader: small all-reduces, every other op
(broadcast, the all-gathers, reduce-scatter and the hub's per-rank ops,
barrier) and the rendezvous store.

Faults: a shard whose stream fails (killed, lost its leader, refused a chunk)
fails every range pending on it at once with the stream's error, which names
the shard and its address; the group's `OpQueue` then fails the operation
(naming the op and its number) and every later one. Ranks that disagree (op,
dtype, size) are told by the leader for range 0, naming both values, as
without shards. A group whose coordinator restarted cannot resume its ranges
on the shards (they forget the group's collectives with their leader): its
next spread all-reduce fails, saying so. Every wait is bounded by the group's
timeout.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from gradsync_proto.chunking import shard_ranges
from gradsync_proto.v1 import gradsync_pb2 as pb

from gradsync.collectives import Collectives
from gradsync.control.collective_results import CollectiveResults
from gradsync.control.worker_messages import CollectiveUpload
from gradsync.errors import GradSyncError, ShardUnavailableError
from gradsync.path.signature import WIRE_DTYPES

log = logging.getLogger("gradsync.client")

__all__ = ["MIN_SPREAD_BYTES", "ShardRoutes", "spread_ranges"]

#: An all-reduce smaller than this stays whole on the leader: one round trip to one
#: process costs less than S in parallel when there are few bytes to share out.
MIN_SPREAD_BYTES = 64 * 1024
#: The wire op of each reduction the group spreads (PREMUL_SUM arrives here as a SUM).
_WIRE_OPS = {
    "sum": pb.COLLECTIVE_OP_SUM,
    "avg": pb.COLLECTIVE_OP_AVG,
    "min": pb.COLLECTIVE_OP_MIN,
    "max": pb.COLLECTIVE_OP_MAX,
    "product": pb.COLLECTIVE_OP_PRODUCT,
}

#: What a spread all-reduce's `finish` returns: how many ranks contributed.
Finish = Callable[[], int]


def spread_ranges(numel: int, element_size: int, shard_count: int) -> list[tuple[int, int]] | None:
    """The element ranges [start, stop) of an all-reduce, one per shard, or None when it
    stays whole on the leader (no shards, fewer than `MIN_SPREAD_BYTES` or than
    `shard_count` elements)."""
    if shard_count < 2 or numel < shard_count or numel * element_size < MIN_SPREAD_BYTES:
        return None
    return shard_ranges(numel, shard_count)


class _Shard:
    """What one shard holds of this rank's spread all-reduces."""

    def __init__(self, index: int, rank: int) -> None:
        self.index = index
        self.results = CollectiveResults(rank)
        #: The next range's number on this shard (the same on every rank).
        self.next_sequence = 0
        #: Why the shard's stream failed; every range on it fails with it.
        self.failure: ShardUnavailableError | None = None


class ShardRoutes:
    """Spreads one group's large all-reduces over the coordinator's shards.

    Args:
        link_getter: the group's current link to the leader (a `Transport`).
        shard_count: S, the shards of the Welcome (the leader counted).
        rank, world_size: this rank of the group, and the group's size.
        chunk_bytes: the chunk size of the Welcome (results come back cut by it).
        timeout_s: bound on each wait for a range's result.
    """

    def __init__(
        self,
        link_getter: Callable[[], Any],
        shard_count: int,
        rank: int,
        world_size: int,
        chunk_bytes: int,
        timeout_s: float,
    ) -> None:
        if shard_count < 2:
            raise ValueError(f"shard routes need at least 2 shards, got {shard_count}")
        self._link_getter = link_getter
        self.shard_count = shard_count
        self.rank = rank
        self.world_size = world_size
        self._chunk_bytes = chunk_bytes
        self._timeout_s = timeout_s
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._shards = {index: _Shard(index, rank) for index in range(1, shard_count)}
        #: The link whose shard streams carry the ranges (set at the first spread op).
        self._link: Any = None
        #: Why no further op can be spread (the coordinator restarted), once it is so.
        self._lost: str | None = None
        #: Ranges sent to the shards so far (tests and status read it).
        self.ranges_sent = 0

    # ------------------------------------------------------------ issuing
    def start_all_reduce(
        self,
        collectives: Collectives,
        tensor: torch.Tensor,
        op: str,
        ranges: list[tuple[int, int]],
        on_ready: Callable[[], None] | None = None,
    ) -> Finish:
        """Issue `tensor`'s all-reduce as `ranges` (`spread_ranges`): range 0 on the
        leader, range i on shard i; return `finish`, which waits (bounded) for every
        range, writes the result into `tensor` in place and returns the contributors.

        `tensor` must be a contiguous CPU tensor that does not change until `finish`
        returned. `on_ready` is told once every range's result is in (or failed).

        Raises:
            GradSyncError: a range could not be issued (the coordinator restarted).
        """
        flat = tensor.detach().view(-1)
        deadline = time.monotonic() + self._timeout_s
        left = [len(ranges)]
        count_lock = threading.Lock()

        def part_ready() -> None:
            with count_lock:
                left[0] -= 1
                whole = left[0] == 0
            if whole and on_ready is not None:
                on_ready()

        link = self._attach()
        start, stop = ranges[0]
        finish_leader = collectives.start_all_reduce(flat[start:stop], op, on_ready=part_ready)
        wire_op, dtype = _WIRE_OPS[op], WIRE_DTYPES[tensor.dtype]
        issued: list[tuple[_Shard, int, int, int]] = []
        for index, (start, stop) in enumerate(ranges[1:], start=1):
            payload = _bytes_of(flat[start:stop])
            shard = self._shards[index]
            with self._lock:
                sequence = shard.next_sequence
                shard.next_sequence += 1
                shard.results.expect(
                    sequence,
                    wire_op,
                    dtype,
                    payload.nbytes,
                    world_size=self.world_size,
                    chunk_bytes=self._chunk_bytes,
                    on_ready=part_ready,
                )
                failed = shard.failure is not None
            issued.append((shard, sequence, start, stop))
            if failed:
                part_ready()  # (its wait raises the shard's failure)
                continue
            link.send_to_shard(index, CollectiveUpload(sequence, wire_op, dtype, 0, payload))
            self.ranges_sent += 1

        def finish() -> int:
            try:
                contributors = finish_leader()
            except BaseException:
                self._forget(issued)
                raise
            for position, (shard, sequence, start, stop) in enumerate(issued):
                try:
                    data, count = self._wait(shard, sequence, deadline, start, stop)
                except BaseException:
                    self._forget(issued[position + 1 :])
                    raise
                if count != contributors:
                    self._forget(issued[position + 1 :])
                    raise GradSyncError(
                        f"range {shard.index} (elements {start}..{stop}) of the all-reduce "
                        f"had {count} contributors on shard {shard.index}, range 0 had "
                        f"{contributors} on the leader",
                        rank=self.rank,
                    )
                _write_back(flat[start:stop], data)
            return contributors

        return finish

    def _attach(self) -> Any:
        """The current link, with this group's hooks on its shard streams.

        Raises:
            GradSyncError: the link was replaced (the coordinator restarted): the
                shards forgot the group's ranges, so its numbering cannot resume.
        """
        link = self._link_getter()
        with self._lock:
            if self._link is None:
                self._link = link
                link.on_shard_collective = self._on_chunk
                link.on_shard_failed = self._on_failed
            elif self._link is not link and self._lost is None:
                self._lost = (
                    "the coordinator restarted, and its shards do not keep a process "
                    "group's all-reduce ranges across a restart: restart the job"
                )
            lost = self._lost
        if lost is not None:
            raise GradSyncError(lost, rank=self.rank)
        return link

    # ------------------------------------------------------------ results (stream threads)
    def _on_chunk(self, index: int, chunk: pb.CollectiveChunk) -> None:
        """A result chunk of a range from shard `index` (a stream's reading thread)."""
        shard = self._shards.get(index)
        if shard is None:
            log.warning("rank %d: a collective result from unknown shard %d", self.rank, index)
            return
        with self._lock:
            problem = shard.results.on_chunk(chunk)
            hook = shard.results.take_ready_hook(chunk.sequence)
            self._changed.notify_all()
        if problem is not None:  # (a range this rank gave up on already)
            log.debug("rank %d: shard %d: %s", self.rank, index, problem)
        if hook is not None:
            _call(hook)

    def _on_failed(self, error: ShardUnavailableError) -> None:
        """A shard's stream failed: every range pending on it fails now."""
        shard = self._shards.get(error.shard_index if error.shard_index is not None else -1)
        if shard is None:
            return
        with self._lock:
            if shard.failure is None:
                shard.failure = error
            hooks = shard.results.take_all_hooks()
            self._changed.notify_all()
        for hook in hooks:
            _call(hook)

    def _wait(
        self, shard: _Shard, sequence: int, deadline: float, start: int, stop: int
    ) -> tuple[bytearray, int]:
        where = f"range {shard.index} (elements {start}..{stop}) on shard {shard.index}"
        with self._lock:
            while not shard.results.is_ready(sequence) and shard.failure is None:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    missing = shard.results.describe(sequence)
                    shard.results.forget(sequence)
                    raise TimeoutError(
                        f"{where} (its collective {sequence}) had no result within "
                        f"{self._timeout_s:g} s: {missing}"
                    )
                self._changed.wait(remaining)
            if not shard.results.is_ready(sequence):
                shard.results.forget(sequence)
                raise GradSyncError(f"{where}: {shard.failure}", rank=self.rank)
            try:
                return shard.results.take(sequence)
            except GradSyncError as exc:
                raise GradSyncError(f"{where}: {exc}", rank=self.rank) from exc

    def _forget(self, issued: list[tuple[_Shard, int, int, int]]) -> None:
        with self._lock:
            for shard, sequence, _, _ in issued:
                shard.results.forget(sequence)


def _bytes_of(part: torch.Tensor) -> np.ndarray[Any, np.dtype[np.uint8]]:
    """The raw bytes of a contiguous CPU tensor's slice, without a copy."""
    array: np.ndarray[Any, np.dtype[np.uint8]] = part.view(torch.uint8).numpy()
    return array


def _write_back(part: torch.Tensor, raw: bytearray) -> None:
    source = torch.frombuffer(raw, dtype=part.dtype, count=part.numel())
    with torch.no_grad():
        part.copy_(source)


def _call(hook: Callable[[], None]) -> None:
    try:
        hook()
    except Exception:  # a completion hook must never break a stream's reader
        log.exception("a collective's completion hook failed")
