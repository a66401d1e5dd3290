"""A process group's bulk ops spread over a sharded coordinator's shards.

With `gradsync serve --shards S` (or `--wait-for-shards`), a group's Welcome
lists the S shards, and the group's transport opens a `Shard.Data` stream to
each of shards 1..S-1 (`gradsync.path.shard_streams`). An all-reduce of at
least `MIN_SPREAD_BYTES` (and of at least S elements) is then cut into S
contiguous element ranges, the longer ones first, as the wrapper cuts a bucket
(`gradsync_proto.chunking.shard_ranges`): range 0 goes to the leader as the
group's collective (its sequence number, its checks), range i to shard i as a
collective of that range alone, numbered 0, 1, 2, ... per shard. Every rank
issues the same ops in the same order, so the ranks' numbers agree on every
shard. An all-gather is cut the same way (shard i gathers range i of every
rank's input), and a reduce-scatter cuts each rank's part (shard i
reduce-scatters range i of every part, and each rank gets range i of its own).
Each shard reduces its range with the leader's code, so the result is bitwise
a single coordinator's. Everything else stays on the leader. Faults: a shard
whose stream fails fails every range pending on it at once with the stream's
error, which names the shard and its address; a group whose coordinator
restarted cannot resume its ranges on the shards (they forget them with their
leader). docs/backend.md (Sharded coordinators) lists what is spread and why.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
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

__all__ = [
    "MIN_SPREAD_BYTES",
    "ShardRoutes",
    "all_gather",
    "flat_copy",
    "reduce_scatter_parts",
    "spread_ranges",
    "start_all_reduce",
    "write_into",
]

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
#: An op's element ranges [start, stop), one per shard.
Ranges = list[tuple[int, int]]


def spread_ranges(numel: int, element_size: int, shard_count: int) -> Ranges | None:
    """The element ranges [start, stop) of an op, one per shard, or None when it stays
    whole on the leader (no shards, fewer than `MIN_SPREAD_BYTES` or than `shard_count`
    elements). `element_size`: the bytes each element of the cut carries (a
    reduce-scatter's cut runs through every rank's part: W elements each)."""
    if shard_count < 2 or numel < shard_count or numel * element_size < MIN_SPREAD_BYTES:
        return None
    return shard_ranges(numel, shard_count)


def flat_copy(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """The tensors' values, on the CPU, as one 1-D tensor (a copy)."""
    if not tensors:
        return torch.empty(0)
    return torch.cat([t.detach().reshape(-1).to("cpu") for t in tensors])


def write_into(target: torch.Tensor, values: torch.Tensor) -> None:
    with torch.no_grad():
        target.copy_(values.reshape(target.shape))


def _spread(routes: ShardRoutes, tensor: torch.Tensor, element_size: int) -> Ranges | None:
    """`spread_ranges` of `tensor` when it is a contiguous CPU tensor, else None."""
    if tensor.device.type != "cpu" or not tensor.is_contiguous():
        return None
    return spread_ranges(tensor.numel(), element_size, routes.shard_count)


def start_all_reduce(
    routes: ShardRoutes | None,
    collectives: Collectives,
    tensor: torch.Tensor,
    op: str,
    ready: Callable[[], None],
) -> Finish:
    """Issue an all-reduce: spread over the shards when `routes` (a sharded coordinator)
    and the tensor is a large enough contiguous CPU tensor, else whole on the leader;
    return its `finish` (see `Collectives.start_all_reduce`)."""
    if routes is not None and (ranges := _spread(routes, tensor, tensor.element_size())):
        return routes.start_all_reduce(collectives, tensor, op, ranges, ready)
    return collectives.start_all_reduce(tensor, op, on_ready=ready)


def all_gather(
    routes: ShardRoutes | None, collectives: Collectives, tensor: torch.Tensor
) -> list[torch.Tensor]:
    """Every contributing rank's `tensor`, spread over the shards as `start_all_reduce`."""
    if routes is not None and (ranges := _spread(routes, tensor, tensor.element_size())):
        return routes.all_gather(collectives, tensor, ranges)
    return collectives.all_gather(tensor)


def reduce_scatter_parts(
    routes: ShardRoutes | None,
    collectives: Collectives,
    output: torch.Tensor,
    parts: Sequence[torch.Tensor],
    op: str,
    wire: torch.dtype | None,
) -> None:
    """`output` = the reduction over ranks of every rank's `parts[my rank]`, spread over the
    shards (range i of every part on shard i) when `routes` and `output` is a contiguous
    CPU tensor whose parts are large, else whole on the leader.

    With `wire` (a 16-bit float type) the parts travel in it and the result comes back
    in it, then widens into `output`.
    """
    target = output if wire is None else torch.empty(output.numel(), dtype=wire)
    carried = (wire or output.dtype).itemsize * len(parts)
    if routes is not None and (ranges := _spread(routes, output, carried)):
        sent = list(parts) if wire is None else [part.detach().to("cpu", wire) for part in parts]
        routes.reduce_scatter(collectives, target, sent, op, ranges)
    else:
        flat = flat_copy(parts)
        collectives.reduce_scatter(target, flat if wire is None else flat.to(wire), op)
    if target is not output:
        write_into(output, target)


@dataclass
class _Shard:
    """What one shard holds of this rank's spread ops."""

    index: int
    results: CollectiveResults
    #: The next range's number on this shard (the same on every rank).
    next_sequence: int = 0
    #: Why the shard's stream failed; every range on it fails with it.
    failure: ShardUnavailableError | None = None


class ShardRoutes:
    """Spreads one group's bulk ops over the coordinator's shards.

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
        self._shards = {i: _Shard(i, CollectiveResults(rank)) for i in range(1, shard_count)}
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
        ranges: Ranges,
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
        issued = [
            self._issue(link, index, (a, b), wire_op, dtype, _bytes_of(flat[a:b]), part_ready)
            for index, (a, b) in enumerate(ranges[1:], start=1)
        ]

        def finish() -> int:
            try:
                contributors = finish_leader()
            except BaseException:
                self._forget(issued)
                raise
            for start, stop, data, _ in self._results(issued, deadline, contributors):
                _write_back(flat[start:stop], data)
            return contributors

        return finish

    def all_gather(
        self, collectives: Collectives, tensor: torch.Tensor, ranges: Ranges
    ) -> list[torch.Tensor]:
        """Every contributing rank's `tensor` (new tensors, in rank order), its `ranges`
        (`spread_ranges`) gathered on their shards: range 0 on the leader, range i on
        shard i. Blocks, bounded by the timeout; `tensor` is a contiguous CPU tensor.

        Raises:
            GradSyncError: a range failed (a shard lost, ranks that disagree).
        """
        flat = tensor.detach().view(-1)
        deadline = time.monotonic() + self._timeout_s
        link = self._attach()
        dtype = WIRE_DTYPES[tensor.dtype]
        gather = pb.COLLECTIVE_OP_ALL_GATHER
        issued = [
            self._issue(link, index, (a, b), gather, dtype, _bytes_of(flat[a:b]))
            for index, (a, b) in enumerate(ranges[1:], start=1)
        ]
        start, stop = ranges[0]
        try:
            leader = collectives.all_gather(flat[start:stop])
        except BaseException:
            self._forget(issued)
            raise
        gathered = [torch.empty_like(flat) for _ in leader]
        for output, part in zip(gathered, leader, strict=True):
            output[start:stop] = part
        for a, b, data, count in self._results(issued, deadline, len(leader)):
            parts = torch.frombuffer(data, dtype=tensor.dtype, count=count * (b - a))
            for rank, output in enumerate(gathered):
                output[a:b] = parts[rank * (b - a) : (rank + 1) * (b - a)]
        return [output.view(tensor.shape) for output in gathered]

    def reduce_scatter(
        self,
        collectives: Collectives,
        output: torch.Tensor,
        parts: list[torch.Tensor],
        op: str,
        ranges: Ranges,
    ) -> None:
        """`output` = the reduction over ranks of every rank's `parts[my rank]`, each
        part's `ranges` (`spread_ranges` of one part) reduced on their shards: shard i
        reduces range i of every part and sends each rank its own. `output` is a
        contiguous CPU tensor; the parts are of its size and dtype (in the type they
        travel in). Blocks, bounded by the timeout.

        Raises:
            GradSyncError: a range failed (a shard lost, ranks that disagree).
        """
        flat = output.detach().view(-1)
        pieces = [part.detach().reshape(-1) for part in parts]
        deadline = time.monotonic() + self._timeout_s
        link = self._attach()
        dtype, size = WIRE_DTYPES[output.dtype], output.element_size()
        template = pb.CollectiveChunk(reduce_op=_WIRE_OPS[op])
        issued = []
        for index, (a, b) in enumerate(ranges[1:], start=1):
            cut = torch.cat([piece[a:b] for piece in pieces])  # range i of every part
            issued.append(
                self._issue(
                    link,
                    index,
                    (a, b),
                    pb.COLLECTIVE_OP_REDUCE_SCATTER,
                    dtype,
                    _bytes_of(cut),
                    template=template,
                    result_bytes=(b - a) * size,
                )
            )
        start, stop = ranges[0]
        try:
            cut = torch.cat([piece[start:stop] for piece in pieces])
            collectives.reduce_scatter(flat[start:stop], cut, op)
        except BaseException:
            self._forget(issued)
            raise
        for a, b, data, _ in self._results(issued, deadline, collectives.world_size):
            _write_back(flat[a:b], data)

    def _issue(
        self,
        link: Any,
        index: int,
        elements: tuple[int, int],
        wire_op: int,
        dtype: int,
        payload: np.ndarray[Any, np.dtype[np.uint8]],
        on_ready: Callable[[], None] | None = None,
        *,
        template: pb.CollectiveChunk | None = None,
        result_bytes: int | None = None,
    ) -> tuple[_Shard, int, int, int]:
        """Number one range (of `elements` [start, stop)) for shard `index` and send it;
        return (the shard, its number, start, stop).

        A shard already failed is sent nothing: the range's wait raises its failure.
        """
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
                result_bytes=result_bytes,
                on_ready=on_ready,
            )
            failed = shard.failure is not None
        if failed:
            if on_ready is not None:
                on_ready()
            return shard, sequence, elements[0], elements[1]
        link.send_to_shard(index, CollectiveUpload(sequence, wire_op, dtype, 0, payload, template))
        self.ranges_sent += 1
        return shard, sequence, elements[0], elements[1]

    def _results(
        self, issued: list[tuple[_Shard, int, int, int]], deadline: float, contributors: int
    ) -> Iterator[tuple[int, int, bytearray, int]]:
        """(start, stop, its bytes, its contributors) of each range of `issued`, as each
        comes in, checked to have the leader range's `contributors`; when one fails, the
        later ranges are forgotten."""
        for position, (shard, sequence, start, stop) in enumerate(issued):
            try:
                data, count = self._wait(shard, sequence, deadline, start, stop)
            except BaseException:
                self._forget(issued[position + 1 :])
                raise
            if count != contributors:
                self._forget(issued[position + 1 :])
                raise GradSyncError(
                    f"range {shard.index} (elements {start}..{stop}) had {count} contributors "
                    f"on shard {shard.index}, range 0 had {contributors} on the leader",
                    rank=self.rank,
                )
            yield start, stop, data, count

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
