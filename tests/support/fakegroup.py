"""W ranks in one process: threads whose links compute collectives as the coordinator does.

`ThreadedGroup` hands each simulated rank a `GroupLink` whose `run_collective`
waits (bounded) until every participating rank has issued the same sequence
number and then returns the result the agreed semantics define: SUM/AVG
accumulated in float32 (float64 for float64, int64 for integers), AVG divided
by the participants, MIN/MAX, BROADCAST of the root's bytes (the lowest
participant's when the root is out), ALL_GATHER in rank order, BARRIER, and
the hub's per-rank ops (REDUCE_SCATTER, GATHER, SCATTER, ALL_TO_ALL, with
PRODUCT) through the coordinator's own pure functions
(`gradsync_server.control.collective_ops`). Ranks listed in `out` have run
out of inputs and do not take part. It lets
`gradsync.collectives`, SyncBatchNorm and join() be unit-tested across ranks
with no coordinator and no sockets.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import numpy as np
import numpy.typing as npt
import torch
from gradsync.collectives import Collectives
from gradsync.errors import CollectiveError, SyncTimeoutError
from gradsync.path.signature import WIRE_DTYPES
from gradsync_proto.v1 import gradsync_pb2 as pb
from gradsync_server.control import collective_ops

T = TypeVar("T")
#: One rank's input: (op, dtype, payload, root, the chunk template: reduce op and splits).
Entry = tuple[int, int, bytes, int, pb.CollectiveChunk]
TORCH_DTYPES = {wire: dtype for dtype, wire in WIRE_DTYPES.items()}


class ThreadedGroup:
    """The coordinator's collectives for `world_size` ranks that run as threads."""

    def __init__(self, world_size: int, out: Iterable[int] = ()) -> None:
        self.world_size = world_size
        self.out = set(out)
        self._cond = threading.Condition()
        self._inputs: dict[int, dict[int, Entry]] = {}
        self._results: dict[int, dict[int, tuple[bytes, int]]] = {}
        #: (sequence, op) of every collective computed, in order.
        self.log: list[tuple[int, int]] = []

    @property
    def participants(self) -> list[int]:
        return [rank for rank in range(self.world_size) if rank not in self.out]

    def link(self, rank: int) -> GroupLink:
        return GroupLink(self, rank)

    def collectives(self, rank: int, timeout_s: float = 10.0) -> Collectives:
        link = self.link(rank)
        return Collectives(lambda: link, rank, self.world_size, timeout_s)  # type: ignore[arg-type, return-value]

    def run(self, body: Callable[[int], T], ranks: Iterable[int] | None = None) -> list[T]:
        """Run body(rank) on a thread per rank; return the results in rank order (re-raise)."""
        ranks = list(self.participants if ranks is None else ranks)
        results: dict[int, Any] = {}

        def target(rank: int) -> None:
            try:
                results[rank] = body(rank)
            except BaseException as exc:  # handed to the test thread
                results[rank] = exc

        threads = [threading.Thread(target=target, args=(rank,)) for rank in ranks]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=30)
            assert not thread.is_alive(), "a simulated rank hung"
        for rank in ranks:
            if isinstance(results[rank], BaseException):
                raise results[rank]
        return [results[rank] for rank in ranks]

    def submit(self, rank: int, sequence: int, entry: Entry, timeout_s: float) -> tuple[bytes, int]:
        with self._cond:
            self._inputs.setdefault(sequence, {})[rank] = entry
            self._cond.notify_all()
            arrived = self._cond.wait_for(
                lambda: set(self.participants) <= set(self._inputs.get(sequence, {})),
                timeout_s,
            )
            if not arrived:
                raise SyncTimeoutError(f"collective {sequence} timed out", rank=rank)
            if sequence not in self._results:
                self._results[sequence] = self._compute(sequence)
            return self._results[sequence][rank]

    def _compute(self, sequence: int) -> dict[int, tuple[bytes, int]]:
        inputs = self._inputs[sequence]
        ranks = self.participants
        op, dtype, _, root, template = inputs[ranks[0]]
        for rank in ranks:
            if inputs[rank][:2] != (op, dtype):
                raise CollectiveError(f"rank {rank} disagrees", rank=rank, sequence=sequence)
        self.log.append((sequence, op))
        if op in collective_ops.PER_RANK:
            return self._per_rank(sequence, op, template.reduce_op, dtype, root)
        result = self._shared(op, dtype, root, inputs, ranks)
        return dict.fromkeys(ranks, result)

    def _per_rank(
        self, sequence: int, op: int, reduce_op: int, dtype: int, root: int
    ) -> dict[int, tuple[bytes, int]]:
        inputs = self._inputs[sequence]
        splits = {
            rank: (list(entry[4].send_splits), list(entry[4].receive_splits))
            for rank, entry in inputs.items()
        }
        if op == pb.COLLECTIVE_OP_ALL_TO_ALL:
            for rank in sorted(inputs):
                for other in sorted(inputs):
                    problem = collective_ops.splits_mismatch(
                        rank, splits[rank], other, splits[other]
                    )
                    if problem:
                        raise CollectiveError(
                            f"rank {rank} {problem}", rank=rank, sequence=sequence
                        )
        results = collective_ops.per_rank_results(
            op,
            reduce_op,
            dtype,
            root,
            {rank: entry[2] for rank, entry in inputs.items()},
            {rank: split[0] for rank, split in splits.items()},
        )
        return {rank: (data, len(inputs)) for rank, data in results.items()}

    def _shared(
        self, op: int, dtype: int, root: int, inputs: dict[int, Entry], ranks: list[int]
    ) -> tuple[bytes, int]:
        data = [inputs[rank][2] for rank in ranks]
        if op == pb.COLLECTIVE_OP_BARRIER:
            return b"", len(ranks)
        if op == pb.COLLECTIVE_OP_BROADCAST:
            source = root if root in ranks else ranks[0]
            return inputs[source][2], len(ranks)
        if op == pb.COLLECTIVE_OP_ALL_GATHER:
            return b"".join(data), len(ranks)
        if not data[0]:
            return b"", len(ranks)
        torch_dtype = TORCH_DTYPES[dtype]
        wide = (
            torch.float64
            if torch_dtype == torch.float64
            else torch.float32
            if torch_dtype.is_floating_point
            else torch.int64
        )
        stacked = torch.stack(
            [torch.frombuffer(bytearray(raw), dtype=torch_dtype).to(wide) for raw in data]
        )
        if op == pb.COLLECTIVE_OP_PRODUCT:
            reduced = stacked.prod(0)
        elif op in (pb.COLLECTIVE_OP_SUM, pb.COLLECTIVE_OP_AVG):
            reduced = stacked.sum(0)
            if op == pb.COLLECTIVE_OP_AVG:
                reduced = reduced / len(ranks)
        elif op == pb.COLLECTIVE_OP_MIN:
            reduced = stacked.min(0).values
        else:
            reduced = stacked.max(0).values
        return reduced.to(torch_dtype).view(torch.uint8).numpy().tobytes(), len(ranks)


class GroupLink:
    """The collective part of a `CoordinatorLink`, for one simulated rank."""

    def __init__(self, group: ThreadedGroup, rank: int) -> None:
        self.group = group
        self.rank = rank
        self.sequence = 0
        self.current_step = 0

    def run_collective(
        self,
        op: int,
        dtype: int,
        payload: npt.NDArray[np.uint8],
        root: int,
        timeout_s: float,
        *,
        result_bytes: int | None = None,
        template: pb.CollectiveChunk | None = None,
    ) -> tuple[bytearray, int]:
        sequence = self.sequence
        self.sequence += 1
        entry = (op, dtype, payload.tobytes(), root, template or pb.CollectiveChunk())
        data, contributors = self.group.submit(self.rank, sequence, entry, timeout_s)
        if result_bytes is not None and len(data) != result_bytes:
            raise CollectiveError(
                f"{len(data)} bytes, expected {result_bytes}", rank=self.rank, sequence=sequence
            )
        return bytearray(data), contributors

    def set_collective_sequence(self, sequence: int) -> None:
        self.sequence = sequence
