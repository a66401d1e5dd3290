"""Collectives on user tensors (all_reduce, broadcast, all_gather, barrier): pure logic.

A DDP codebase also calls `torch.distributed` collectives on its own tensors
(metrics, SyncBatchNorm statistics, a sampler's seed); gradsync serves them
through the coordinator so that no second channel is needed. Every rank
issues the same collectives in the same order, numbered by a per-job
`sequence`; each rank's input arrives cut into chunks like a gradient bucket.
This module pairs the chunks up by sequence, checks that the ranks agree
(op, dtype, root, sizes: an error names the rank, the sequence and both
values), and once every *participating* rank's input is complete computes the
result and returns it as chunks for every participant.

Participants are the job's members that have not run out of inputs (DDP's
`join()`): a rank that runs out is dropped from rounds it has not contributed
to. Results never depend on arrival order: inputs are kept until complete and
combined in ascending rank order (floating sums in float32, float64 for
float64; integer sums, minima and maxima in int64), as `aggregation` does for
gradients. A declared size is a claim checked against a cap before any byte
is buffered, and every buffered byte is held through a `Reservation` of the
coordinator's byte budget (the job's share of `--max-buffered-mb`, the one that
gradient uploads count against): an input that does not fit is refused, naming
the rank, the job and the cap. The bytes go back when the collective completes,
when the job ends, and when a rank leaves without finishing its input (the
round goes on without it). No gRPC, no asyncio.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt
from gradsync_proto import dtypes
from gradsync_proto.blobs import blob_chunks
from gradsync_proto.codes import Code
from gradsync_proto.v1 import gradsync_pb2 as pb

from gradsync_server.dataplane.accumulators import from_accumulator, to_accumulator
from gradsync_server.dataplane.actions import Action, Send
from gradsync_server.dataplane.budget import OwnerBudget
from gradsync_server.dataplane.uploads import BlobAssembler
from gradsync_server.errors import RejectedMessage

#: How far ahead of the oldest unfinished collective a rank may run (pipelined calls).
MAX_OPEN_COLLECTIVES = 16

_FLOATING = dtypes.REDUCIBLE_DTYPES
#: Integer dtypes and how numpy reads them (bool as bytes: MIN/MAX are AND/OR).
_INTEGER_LAYOUT: dict[int, str] = {
    pb.DTYPE_INT64: "<i8",
    pb.DTYPE_INT32: "<i4",
    pb.DTYPE_INT16: "<i2",
    pb.DTYPE_INT8: "i1",
    pb.DTYPE_UINT8: "u1",
    pb.DTYPE_BOOL: "u1",
}
_ELEMENTWISE: tuple[int, ...] = (
    pb.COLLECTIVE_OP_SUM,
    pb.COLLECTIVE_OP_AVG,
    pb.COLLECTIVE_OP_MIN,
    pb.COLLECTIVE_OP_MAX,
)


def op_name(op: int) -> str:
    """'all_reduce sum', 'broadcast', ... for error messages."""
    if op not in pb.CollectiveOp.values() or op == pb.COLLECTIVE_OP_UNSPECIFIED:
        return f"<unknown op {op}>"
    name = pb.CollectiveOp.Name(op).removeprefix("COLLECTIVE_OP_").lower()
    return f"all_reduce {name}" if op in _ELEMENTWISE else name


def _op_dtype_problem(op: int, dtype: int) -> str | None:
    """Why `op` cannot run on `dtype`, or None."""
    if op == pb.COLLECTIVE_OP_AVG and dtype not in _FLOATING:
        return "avg needs a floating dtype"
    if op == pb.COLLECTIVE_OP_SUM and dtype not in _FLOATING and dtype not in _INTEGER_LAYOUT:
        return "sum needs a floating or integer dtype"
    if op == pb.COLLECTIVE_OP_SUM and dtype == pb.DTYPE_BOOL:
        return "sum of bool is not defined (use max for 'any', min for 'all')"
    return None


def _decode(raw: bytes, dtype: int) -> npt.NDArray[Any]:
    """A fresh, writable accumulation array: float32/float64 for floats, int64 for integers."""
    if dtype in _FLOATING:
        return to_accumulator(raw, dtype)
    return np.frombuffer(raw, dtype=_INTEGER_LAYOUT[dtype]).astype(np.int64)


def reduce_inputs(op: int, dtype: int, inputs: Sequence[bytes]) -> bytes:
    """Combine equal-sized inputs (in the order given: ascending rank) element-wise.

    Floating dtypes accumulate in float32 (float64 for float64) and come back
    in their own dtype; integers accumulate in int64 and wrap back.
    """
    values = _decode(inputs[0], dtype)
    for raw in inputs[1:]:
        if op in (pb.COLLECTIVE_OP_SUM, pb.COLLECTIVE_OP_AVG):
            values += _decode(raw, dtype)
        elif op == pb.COLLECTIVE_OP_MIN:
            np.minimum(values, _decode(raw, dtype), out=values)
        else:
            np.maximum(values, _decode(raw, dtype), out=values)
    if dtype not in _FLOATING:
        return values.astype(_INTEGER_LAYOUT[dtype]).tobytes()
    if op == pb.COLLECTIVE_OP_AVG:
        values /= len(inputs)
    return bytes(from_accumulator(values, dtype))


@dataclass
class _Round:
    """One collective (one sequence number) in progress."""

    sequence: int
    op: int
    dtype: int
    root: int
    first_rank: int
    participants: list[int]
    #: Each rank's input as it arrives (any order; an empty input is one empty chunk).
    inputs: dict[int, BlobAssembler] = field(default_factory=dict)

    def describe(self) -> str:
        return f"collective {self.sequence} ({op_name(self.op)})"

    def ready(self) -> bool:
        return all(r in self.inputs and self.inputs[r].complete for r in self.participants)

    def release(self) -> None:
        """Give every input's bytes back to the budget."""
        for item in self.inputs.values():
            item.release()


class Collectives:
    """The collectives in flight of one job, by sequence number.

    Args:
        world_size: ranks the job needs (a broadcast root must be below it).
        chunk_bytes: chunk size every rank must use.
        max_bytes: cap on one rank's input (and on an all_gather's result).
        budget: the job's share of the byte budget buffered inputs count against.
    """

    def __init__(
        self, world_size: int, chunk_bytes: int, max_bytes: int, budget: OwnerBudget
    ) -> None:
        self._world_size = world_size
        self._chunk_bytes = chunk_bytes
        self._max_bytes = max_bytes
        self._budget = budget
        self._rounds: dict[int, _Round] = {}
        #: Every sequence below this one is complete.
        self._floor = 0
        self._completed_above_floor: set[int] = set()
        #: One past the highest sequence any rank has started (what ranks continue from).
        self.next_sequence = 0

    def open_sequences(self) -> list[int]:
        """Sequences in flight, ascending."""
        return sorted(self._rounds)

    def waiting_ranks(self) -> tuple[int, ...]:
        """Ranks that contributed to a collective still in flight (they wait for it)."""
        return tuple(sorted({r for rnd in self._rounds.values() for r in rnd.inputs}))

    # --------------------------------------------------------------- input
    def accept(
        self, rank: int, chunk: pb.CollectiveChunk, participants: Sequence[int]
    ) -> list[Action]:
        """Take one chunk of `rank`'s input; return the result chunks once all inputs are in.

        Args:
            rank: the sender.
            chunk: the chunk as received.
            participants: the job's participating ranks now (used when this
                chunk opens a new collective).

        Raises:
            RejectedMessage: the chunk is malformed, disagrees with another
                rank's, or exceeds a limit (the sender's stream ends).
        """
        sequence = chunk.sequence
        where = f"rank {rank} sent collective {sequence}"
        if chunk.op == pb.COLLECTIVE_OP_UNSPECIFIED or chunk.op not in pb.CollectiveOp.values():
            raise RejectedMessage(Code.INVALID_ARGUMENT, f"{where} with unknown op {chunk.op}")
        if not dtypes.is_supported_dtype(chunk.dtype):
            raise RejectedMessage(
                Code.INVALID_ARGUMENT, f"{where} with unsupported dtype {chunk.dtype}"
            )
        if sequence < self._floor or sequence in self._completed_above_floor:
            raise RejectedMessage(
                Code.FAILED_PRECONDITION,
                f"{where}, which already completed (next is {self.next_sequence}); "
                "every rank must issue the same collectives in the same order",
            )
        if sequence >= self._floor + MAX_OPEN_COLLECTIVES:
            raise RejectedMessage(
                Code.FAILED_PRECONDITION,
                f"{where} while collective {self._floor} is still waiting for other ranks "
                f"(at most {MAX_OPEN_COLLECTIVES} may be in flight)",
            )
        opened = sequence not in self._rounds
        held = self._rounds.get(sequence) or self._open(rank, chunk, participants)
        try:
            return self._take(rank, held, chunk)
        except RejectedMessage:
            if opened and not held.inputs:  # a refused first chunk opens nothing
                del self._rounds[sequence]
            raise

    def _take(self, rank: int, held: _Round, chunk: pb.CollectiveChunk) -> list[Action]:
        where = f"rank {rank} sent collective {held.sequence}"
        self._check_agrees(rank, held, chunk)
        if rank not in held.participants:
            raise RejectedMessage(
                Code.FAILED_PRECONDITION,
                f"{where} but does not take part in it (participants {held.participants}; "
                "a rank that ran out of inputs sends no collectives until every rank has)",
            )
        item = held.inputs.get(rank)
        if item is None:
            self._check_size(rank, held, chunk.total_bytes)
            # The budget's owner is the job's id (the job takes its share by its id).
            what = (
                f"{held.describe()} of {chunk.total_bytes} bytes from rank {rank} of job "
                f"'{self._budget.owner}'"
            )
            item = BlobAssembler(
                what, chunk.total_bytes, self._chunk_bytes, None, self._budget, in_order=False
            )
            held.inputs[rank] = item
        try:
            item.add(chunk.offset, chunk.payload, chunk.total_bytes)
        finally:
            if not item.received and not item.complete:
                item.release()
                del held.inputs[rank]  # nothing of it was taken
        if held.sequence >= self.next_sequence:
            self.next_sequence = held.sequence + 1
        return self._finish(held) if held.ready() else []

    def _open(self, rank: int, chunk: pb.CollectiveChunk, participants: Sequence[int]) -> _Round:
        problem = _op_dtype_problem(chunk.op, chunk.dtype)
        if problem is not None:
            raise RejectedMessage(
                Code.INVALID_ARGUMENT,
                f"rank {rank} sent collective {chunk.sequence} ({op_name(chunk.op)}) as "
                f"{dtypes.dtype_name(chunk.dtype)}: {problem}",
            )
        if chunk.op == pb.COLLECTIVE_OP_BROADCAST and chunk.root >= self._world_size:
            raise RejectedMessage(
                Code.INVALID_ARGUMENT,
                f"rank {rank} sent collective {chunk.sequence} (broadcast) from root "
                f"{chunk.root}, but the world size is {self._world_size}",
            )
        held = _Round(
            chunk.sequence,
            chunk.op,
            chunk.dtype,
            chunk.root,
            rank,
            sorted(participants),
        )
        self._rounds[chunk.sequence] = held
        return held

    def _check_agrees(self, rank: int, held: _Round, chunk: pb.CollectiveChunk) -> None:
        first = held.first_rank
        mismatch = None
        if chunk.op != held.op:
            mismatch = f"as {op_name(chunk.op)}, but rank {first} sent {op_name(held.op)}"
        elif chunk.dtype != held.dtype:
            mismatch = (
                f"({op_name(held.op)}) as {dtypes.dtype_name(chunk.dtype)}, but rank {first} "
                f"sent {dtypes.dtype_name(held.dtype)}"
            )
        elif held.op == pb.COLLECTIVE_OP_BROADCAST and chunk.root != held.root:
            mismatch = (
                f"(broadcast) from root {chunk.root}, but rank {first} named root {held.root}"
            )
        if mismatch is not None:
            raise RejectedMessage(
                Code.INVALID_ARGUMENT, f"rank {rank} sent collective {held.sequence} {mismatch}"
            )

    def _check_size(self, rank: int, held: _Round, total: int) -> None:
        where = f"rank {rank} sent {held.describe()} with {total} bytes"
        if total % dtypes.itemsize(held.dtype):
            raise RejectedMessage(
                Code.INVALID_ARGUMENT,
                f"{where}, not a whole number of {dtypes.dtype_name(held.dtype)} elements",
            )
        if total > self._max_bytes:
            raise RejectedMessage(
                Code.RESOURCE_EXHAUSTED,
                f"{where}; the limit is {self._max_bytes} bytes (--max-collective-mb)",
            )
        if held.op == pb.COLLECTIVE_OP_BARRIER and total:
            raise RejectedMessage(Code.INVALID_ARGUMENT, f"{where}; a barrier carries no data")
        if held.op == pb.COLLECTIVE_OP_ALL_GATHER and total * len(held.participants) > (
            self._max_bytes
        ):
            raise RejectedMessage(
                Code.RESOURCE_EXHAUSTED,
                f"{where}; gathered over {len(held.participants)} ranks that makes "
                f"{total * len(held.participants)} bytes, above the limit of "
                f"{self._max_bytes} bytes (--max-collective-mb)",
            )
        if held.op in (*_ELEMENTWISE, pb.COLLECTIVE_OP_ALL_GATHER):
            for other, item in sorted(held.inputs.items()):
                if item.total_bytes != total:
                    raise RejectedMessage(
                        Code.INVALID_ARGUMENT,
                        f"{where}, but rank {other} sent {item.total_bytes} bytes "
                        "(every rank's input must have the same size)",
                    )

    def add_participants(self, ranks: Sequence[int]) -> int:
        """`ranks` take part from now on (healed newcomers); return where they start numbering.

        A newcomer is admitted at a step boundary while the live ranks may
        already have opened that boundary's collectives (the buffer broadcast
        before a forward pass). None of those can have completed: the donor,
        a participant, uploads its state before its own input. So the
        newcomers join every round still in flight and number their next
        collective from the lowest one, exactly where the live ranks stand.
        """
        for held in self._rounds.values():
            for rank in ranks:
                if rank not in held.participants:
                    held.participants.append(rank)
            held.participants.sort()
        return min(self._rounds, default=self.next_sequence)

    # ------------------------------------------------------------- results
    def drop_participant(self, rank: int) -> list[Action]:
        """`rank` takes no part from now on: finish rounds that only waited for it.

        A whole input it sent stays its contribution (the result is the one it
        would have got had it stayed a moment longer). A partial one is given
        back now and the round goes on without it: nothing can complete it, so
        the round would otherwise wait for good, holding those bytes, and the
        other ranks with it.
        """
        actions: list[Action] = []
        for held in sorted(self._rounds.values(), key=lambda r: r.sequence):
            if rank not in held.participants:
                continue
            item = held.inputs.get(rank)
            if item is not None and item.complete:
                continue
            if item is not None:
                item.release()
                del held.inputs[rank]
            held.participants.remove(rank)
            if not held.participants:
                self._close(held)
            elif held.ready():
                actions += self._finish(held)
        return actions

    def _finish(self, held: _Round) -> list[Action]:
        participants = tuple(held.participants)
        blobs = [held.inputs[r].blob() for r in participants]
        result = self._compute(held, participants, blobs)
        self._close(held)
        return [
            Send(
                participants,
                pb.CoordinatorMessage(
                    collective=pb.CollectiveChunk(
                        sequence=held.sequence,
                        op=held.op,  # type: ignore[arg-type]
                        dtype=held.dtype,  # type: ignore[arg-type]
                        total_bytes=len(result),
                        offset=offset,
                        payload=payload,
                        root=held.root,
                        contributors=len(participants),
                    )
                ),
            )
            for offset, payload in blob_chunks(result, self._chunk_bytes, empty_chunk=True)
        ]

    @staticmethod
    def _compute(held: _Round, participants: tuple[int, ...], blobs: list[bytes]) -> bytes:
        if held.op in _ELEMENTWISE:
            return reduce_inputs(held.op, held.dtype, blobs)
        if held.op == pb.COLLECTIVE_OP_ALL_GATHER:
            return b"".join(blobs)
        if held.op == pb.COLLECTIVE_OP_BROADCAST:
            by_rank = dict(zip(participants, blobs, strict=True))
            if held.root in by_rank:
                return by_rank[held.root]
            # The root ran out of inputs: the lowest participant that sent data stands in.
            senders = [r for r in participants if by_rank[r]] or list(participants)
            return by_rank[min(senders)]
        return b""  # barrier

    def _close(self, held: _Round) -> None:
        held.release()
        del self._rounds[held.sequence]
        self._completed_above_floor.add(held.sequence)
        while self._floor in self._completed_above_floor:
            self._completed_above_floor.discard(self._floor)
            self._floor += 1

    def release(self) -> None:
        """Free every buffered input; nothing in flight will complete (job ended)."""
        for held in self._rounds.values():
            held.release()
        self._rounds.clear()
