"""Collectives on user tensors, paired up by sequence number across ranks: pure logic.

A DDP codebase also calls `torch.distributed` collectives on its own tensors
(metrics, SyncBatchNorm statistics, a sampler's seed), and a process group
calls them for everything; gradsync serves them through the coordinator so
that no second channel is needed. Every rank issues the same collectives in
the same order, numbered by a per-job `sequence`; each rank's input arrives
cut into chunks like a gradient bucket. This module pairs the chunks up by
sequence, checks that the ranks agree (op, reduce op, dtype, root, sizes,
all-to-all splits), and once every *participating* rank's input is complete
computes the result (`collective_ops`) and returns it as chunks: the same
result for every participant (all_reduce, broadcast, all_gather, barrier),
or each rank only its own part (reduce_scatter, gather, scatter, all_to_all).

A rank that disagrees with the ranks before it (another op, dtype, size,
root or splits) has its stream ended with INVALID_ARGUMENT, and every rank
that already sent its input to that collective (or sends it later) gets a
result carrying the same error instead of bytes: each names the rank, the
sequence and both values. The per-rank ops need every rank of the job; one
lost while such a collective is open fails it the same way.

Participants are the job's members that have not run out of inputs (DDP's
`join()`): a rank that runs out is dropped from rounds it has not contributed
to. Results never depend on arrival order: inputs are kept until complete and
combined in ascending rank order (floating values in float32, float64 for
float64; integers in int64), as `aggregation` does for gradients. A declared
size is a claim checked against a cap before any byte is buffered, and every
buffered byte is held through a `Reservation` of the coordinator's byte
budget (the job's share of `--max-buffered-mb`, the one that gradient
uploads count against): an input that does not fit is refused, naming the
rank, the job and the cap. The bytes go back when the collective completes
or fails, when the job ends, and when a rank leaves without finishing its
input (the round goes on without it).

In a process group's job (every member joined collectives-only) each
completed collective also reports each participant's lag: how long after the
first rank's input began to arrive its own did, on the job's clock. The
coordinator's lag tracker, `gradsync status` and the lag histogram then name
a group's slow rank as they name a wrapper's from its buckets. A wrapper's
own collectives (buffer broadcasts, SyncBatchNorm) report none: its buckets
already measure its ranks, and a broadcast that every rank issues when the
step's average arrives would only dilute that.
A process group's host group (`gradsync.distributed.host_group`) sums an
all-reduce over its host's ranks before it reaches here: its leader's input
names the ranks it covers (`covered_ranks`), which send none of their own.
The collective is ready once every participant is covered by a whole input;
the inputs are combined in ascending rank of their senders and the result
goes to the senders. A covered rank's lag is its leader's less how long the
leader waited for it. No gRPC, no asyncio.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from gradsync_proto import dtypes
from gradsync_proto.blobs import blob_chunks
from gradsync_proto.codes import Code
from gradsync_proto.v1 import gradsync_pb2 as pb

from gradsync_server.control.collective_ops import (
    ELEMENTWISE,
    EQUAL_INPUTS,
    PER_RANK,
    ROOTED,
    input_size_problem,
    op_dtype_problem,
    op_name,
    per_rank_results,
    reduce_inputs,
    splits_mismatch,
    splits_problem,
)
from gradsync_server.control.signature import is_collectives_only
from gradsync_server.dataplane.actions import Action, Member, Send, Terminate
from gradsync_server.dataplane.budget import OwnerBudget
from gradsync_server.dataplane.collective_fold import (
    HeldInput,
    encode_result,
    folded_results,
    folds,
)
from gradsync_server.dataplane.observer import StepObserver
from gradsync_server.dataplane.uploads import BlobAssembler
from gradsync_server.errors import RejectedMessage

__all__ = ["MAX_OPEN_COLLECTIVES", "Collectives", "op_name", "reduce_inputs"]

log = logging.getLogger("gradsync.server")

#: How far ahead of the oldest unfinished collective a rank may run (pipelined calls).
MAX_OPEN_COLLECTIVES = 16
#: The ops a chunk may name.
_KNOWN_OPS = frozenset(pb.CollectiveOp.values()) - {pb.COLLECTIVE_OP_UNSPECIFIED}
#: The ops a host group's leader may send reduced over its host's ranks.
_COVERABLE = frozenset({pb.COLLECTIVE_OP_SUM, pb.COLLECTIVE_OP_MIN, pb.COLLECTIVE_OP_MAX})


@dataclass
class _Round:
    """One collective (one sequence number) in progress."""

    sequence: int
    op: int
    reduce_op: int
    dtype: int
    root: int
    first_rank: int
    participants: list[int]
    #: Each rank's input as it arrives (any order; an empty input is one empty chunk):
    #: a floating all-reduce's kept as its chunks (`collective_fold`), others reassembled.
    inputs: dict[int, BlobAssembler | HeldInput] = field(default_factory=dict)
    #: When each rank's input began to arrive (its first chunk taken), on the job's clock.
    arrived: dict[int, float] = field(default_factory=dict)
    #: ALL_TO_ALL: each rank's (send_splits, receive_splits).
    splits: dict[int, tuple[tuple[int, ...], tuple[int, ...]]] = field(default_factory=dict)
    #: A host group leader's input: the ranks it covers (`CollectiveChunk.covered_ranks`).
    covered: dict[int, tuple[int, ...]] = field(default_factory=dict)
    #: A host group leader's input: how long before its upload each covered rank's came in.
    waited: dict[int, tuple[float, ...]] = field(default_factory=dict)
    #: Why the collective failed, once it has; it then holds no bytes.
    failure: str | None = None
    #: A failed collective: ranks already given the failure (or ended).
    told: set[int] = field(default_factory=set)
    #: A failed collective: bytes still to come of each rank's input before it is told.
    remaining: dict[int, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        #: The op's name in messages ("all_reduce sum").
        self.name = op_name(self.op, self.reduce_op)

    def describe(self) -> str:
        return f"collective {self.sequence} ({self.name})"

    def covering(self, rank: int) -> int | None:
        """The rank whose input holds `rank`'s (itself, or its host group's leader), or None."""
        if rank in self.inputs:
            return rank
        return next((leader for leader, covered in self.covered.items() if rank in covered), None)

    def ready(self) -> bool:
        units = [self.covering(rank) for rank in self.participants]
        return all(unit is not None and self.inputs[unit].complete for unit in units)

    def release(self) -> None:
        """Give every input's bytes back to the budget."""
        for item in self.inputs.values():
            item.release()

    def forget(self, rank: int) -> None:
        """Give `rank`'s input back and forget everything it declared."""
        self.inputs.pop(rank).release()
        for declared in (self.arrived, self.splits, self.covered, self.waited):
            declared.pop(rank, None)

    def answer(self, **fields: Any) -> pb.CollectiveChunk:
        """A chunk of this collective's answer (a result or its failure) with its header."""
        return pb.CollectiveChunk(
            sequence=self.sequence,
            op=self.op,  # type: ignore[arg-type]
            dtype=self.dtype,  # type: ignore[arg-type]
            root=self.root,
            reduce_op=self.reduce_op,  # type: ignore[arg-type]
            contributors=len(self.participants),
            **fields,
        )


class Collectives:
    """The collectives in flight of one job, by sequence number.

    Args:
        world_size: ranks the job needs (a root must be below it).
        chunk_bytes: chunk size every rank must use.
        max_bytes: cap on one rank's input and on one rank's result.
        budget: the job's share of the byte budget buffered inputs count against.
        observer: told of every completed collective (its op and bytes) and, in a
            process group's job, of each participant's lag, if anyone is.
        clock: monotonic time source the lags are measured on (the job's).
    """

    def __init__(
        self,
        world_size: int,
        chunk_bytes: int,
        max_bytes: int,
        budget: OwnerBudget,
        observer: StepObserver | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._observer = observer
        self._clock = clock
        #: Report each participant's lag (set when a process group's job starts).
        self._reports_lag = False
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

    def start(self, job_id: str, members: Mapping[int, Member]) -> None:
        """The job starts running with `members`.

        A process group's job (every member joined collectives-only) reports
        each participant's lag behind the first input of every collective.

        A restarted coordinator goes on with a process group's numbering: each
        rank of a process group that rejoins claims the lowest collective it has
        no result for (`Join.collective_resume`); every rank sends again each
        collective from the lowest claim on, so the job starts there (a rank with
        no claim counts as 0). Without claims the numbering starts at 0.
        """
        self._reports_lag = bool(members) and all(
            is_collectives_only(member.signature) for member in members.values()
        )
        claims = {rank: member.collective_resume for rank, member in members.items()}
        if all(claim is None for claim in claims.values()):
            return
        if self._rounds or self.next_sequence:
            raise RuntimeError("only a job with no collectives yet can resume its numbering")
        self._floor = self.next_sequence = min(claim or 0 for claim in claims.values())
        told = ", ".join(f"rank {rank} at {claim}" for rank, claim in sorted(claims.items()))
        log.warning(
            "job '%s': collectives resumed at %d after a restart (%s)", job_id, self._floor, told
        )

    def open_sequences(self) -> list[int]:
        """Sequences in flight, ascending."""
        return sorted(self._rounds)

    def waiting_ranks(self) -> tuple[int, ...]:
        """Ranks that contributed to a collective still in flight (they wait for it)."""
        ranks = {r for rnd in self._rounds.values() for r in rnd.inputs}
        ranks.update(r for rnd in self._rounds.values() for c in rnd.covered.values() for r in c)
        return tuple(sorted(ranks))

    # --------------------------------------------------------------- input
    def accept(
        self, rank: int, chunk: pb.CollectiveChunk, participants: Sequence[int]
    ) -> list[Action]:
        """Take one chunk of `rank`'s input; return the result chunks once all inputs are in.

        A chunk that disagrees with another rank's input returns the failure for
        the ranks that wait and the end of the sender's stream. A chunk with
        `covered_ranks` (a host group's leader) stands for those ranks: they
        send nothing, and the result goes to the sender only.

        Args:
            rank: the sender.
            chunk: the chunk as received.
            participants: the job's participating ranks now (used when this
                chunk opens a new collective).

        Raises:
            RejectedMessage: the chunk is malformed or exceeds a limit (the
                sender's stream ends).
        """
        sequence = chunk.sequence
        if chunk.op not in _KNOWN_OPS:
            raise RejectedMessage(
                Code.INVALID_ARGUMENT,
                f"rank {rank} sent collective {sequence} with unknown op {chunk.op}",
            )
        if not dtypes.is_supported_dtype(chunk.dtype):
            raise RejectedMessage(
                Code.INVALID_ARGUMENT,
                f"rank {rank} sent collective {sequence} with unsupported dtype {chunk.dtype}",
            )
        if sequence < self._floor or sequence in self._completed_above_floor:
            raise RejectedMessage(
                Code.FAILED_PRECONDITION,
                f"rank {rank} sent collective {sequence}, which already completed (next is "
                f"{self.next_sequence}); every rank must issue the same collectives in the "
                "same order",
            )
        if sequence >= self._floor + MAX_OPEN_COLLECTIVES:
            raise RejectedMessage(
                Code.FAILED_PRECONDITION,
                f"rank {rank} sent collective {sequence} while collective {self._floor} is "
                f"still waiting for other ranks (at most {MAX_OPEN_COLLECTIVES} may be in "
                "flight)",
            )
        held = self._rounds.get(sequence)
        if held is not None and held.failure is not None:
            return self._failed_input(rank, held, chunk)
        opened = held is None
        held = held or self._open(rank, chunk, participants)
        try:
            return self._take(rank, held, chunk)
        except RejectedMessage:
            if opened and not held.inputs:  # a refused first chunk opens nothing
                del self._rounds[sequence]
            raise

    def _take(self, rank: int, held: _Round, chunk: pb.CollectiveChunk) -> list[Action]:
        if rank not in held.participants:
            raise RejectedMessage(
                Code.FAILED_PRECONDITION,
                f"rank {rank} sent collective {held.sequence} but does not take part in it "
                f"(participants {held.participants}; a rank that ran out of inputs sends no "
                "collectives until every rank has)",
            )
        mismatch = self._mismatch(rank, held, chunk)
        if mismatch is not None:
            return self._disagree(rank, held, mismatch)
        item = held.inputs.get(rank)
        if item is None:
            self._check_covered(rank, held, chunk)
            mismatch = self._check_size(rank, held, chunk)
            if mismatch is not None:
                return self._disagree(rank, held, mismatch)
            # The budget's owner is the job's id (the job takes its share by its id).
            what = (
                f"{held.describe()} of {chunk.total_bytes} bytes from rank {rank} of job "
                f"'{self._budget.owner}'"
            )
            item = (
                HeldInput(what, chunk.total_bytes, self._chunk_bytes, self._budget)
                if folds(held.op, held.dtype)
                else BlobAssembler(
                    what, chunk.total_bytes, self._chunk_bytes, None, self._budget, in_order=False
                )
            )
            held.inputs[rank] = item
            held.arrived[rank] = self._clock()
            if chunk.covered_ranks:
                held.covered[rank] = tuple(chunk.covered_ranks)
                held.waited[rank] = tuple(chunk.covered_waited_s)
        elif held.op == pb.COLLECTIVE_OP_ALL_TO_ALL and held.splits[rank] != _splits_of(chunk):
            raise RejectedMessage(
                Code.INVALID_ARGUMENT,
                f"rank {rank} sent collective {held.sequence} (all_to_all) with splits "
                f"{_splits_of(chunk)} on the chunk at offset {chunk.offset}, but "
                f"{held.splits[rank]} on its first chunk",
            )
        try:
            item.add(chunk.offset, chunk.payload, chunk.total_bytes)
        finally:
            if not item.received and not item.complete:
                held.forget(rank)  # nothing of it was taken
        if held.sequence >= self.next_sequence:
            self.next_sequence = held.sequence + 1
        # (Every participant's input there, its own or its host group's, and whole.)
        if item.complete and held.ready():
            return self._finish(held)
        return []

    def _open(self, rank: int, chunk: pb.CollectiveChunk, participants: Sequence[int]) -> _Round:
        where = f"rank {rank} sent collective {chunk.sequence}"
        name = op_name(chunk.op, chunk.reduce_op)
        problem = op_dtype_problem(chunk.op, chunk.reduce_op, chunk.dtype)
        if problem is not None:
            raise RejectedMessage(
                Code.INVALID_ARGUMENT,
                f"{where} ({name}) as {dtypes.dtype_name(chunk.dtype)}: {problem}",
            )
        if chunk.op in ROOTED and chunk.root >= self._world_size:
            raise RejectedMessage(
                Code.INVALID_ARGUMENT,
                f"{where} ({name}) with root {chunk.root}, but the world size is "
                f"{self._world_size}",
            )
        if chunk.op in PER_RANK and sorted(participants) != list(range(self._world_size)):
            missing = sorted(set(range(self._world_size)) - set(participants))
            raise RejectedMessage(
                Code.FAILED_PRECONDITION,
                f"{where} ({name}), which needs every rank of the job, but ranks {missing} "
                "take no part now (lost, or out of inputs in join())",
            )
        held = _Round(
            chunk.sequence,
            chunk.op,
            chunk.reduce_op if chunk.op == pb.COLLECTIVE_OP_REDUCE_SCATTER else 0,
            chunk.dtype,
            chunk.root,
            rank,
            sorted(participants),
        )
        self._rounds[chunk.sequence] = held
        return held

    @staticmethod
    def _mismatch(rank: int, held: _Round, chunk: pb.CollectiveChunk) -> str | None:
        """How `chunk` disagrees with the collective's first input, or None."""
        first = held.first_rank
        name = held.name
        if chunk.op != held.op:
            return f"as {op_name(chunk.op)}, but rank {first} sent {name}"
        if held.op == pb.COLLECTIVE_OP_REDUCE_SCATTER and chunk.reduce_op != held.reduce_op:
            return f"as {op_name(chunk.op, chunk.reduce_op)}, but rank {first} sent {name}"
        if chunk.dtype != held.dtype:
            return (
                f"({name}) as {dtypes.dtype_name(chunk.dtype)}, but rank {first} "
                f"sent {dtypes.dtype_name(held.dtype)}"
            )
        if held.op in ROOTED and chunk.root != held.root:
            return f"({name}) from root {chunk.root}, but rank {first} named root {held.root}"
        return None

    @staticmethod
    def _check_covered(rank: int, held: _Round, chunk: pb.CollectiveChunk) -> None:
        """Refuse a host group's input that is malformed or overlaps another input (raises)."""
        covered = tuple(chunk.covered_ranks)
        where = f"rank {rank} sent {held.describe()}"
        other = held.covering(rank)
        if other is not None and other != rank:
            raise RejectedMessage(
                Code.INVALID_ARGUMENT,
                f"{where} as its own input, but rank {other}'s input already covers it "
                f"(ranks {list(held.covered[other])})",
            )
        if not covered:
            return
        if held.op not in _COVERABLE:
            raise RejectedMessage(
                Code.INVALID_ARGUMENT,
                f"{where} covering ranks {list(covered)}; only a sum, min or max may",
            )
        if covered[0] != rank or list(covered) != sorted(set(covered)):
            raise RejectedMessage(
                Code.INVALID_ARGUMENT,
                f"{where} covering ranks {list(covered)}: they must ascend from the sender",
            )
        waited = chunk.covered_waited_s
        if waited and len(waited) != len(covered):
            raise RejectedMessage(
                Code.INVALID_ARGUMENT,
                f"{where} with {len(waited)} waits for {len(covered)} covered ranks",
            )
        for member in covered[1:]:
            unit = held.covering(member)
            if unit is not None:
                raise RejectedMessage(
                    Code.INVALID_ARGUMENT,
                    f"{where} covering rank {member}, whose input rank {unit} already sent",
                )

    def _check_size(self, rank: int, held: _Round, chunk: pb.CollectiveChunk) -> str | None:
        """Refuse a malformed or oversized input (raises); return how its size
        disagrees with the other ranks' inputs, or None."""
        total = chunk.total_bytes
        problem = input_size_problem(
            held.op,
            held.dtype,
            rank,
            held.root,
            total,
            self._world_size,
            len(held.participants),
            self._max_bytes,
        )
        if held.op == pb.COLLECTIVE_OP_ALL_TO_ALL and problem is None:
            splits = _splits_of(chunk)
            problem = splits_problem(held.dtype, total, *splits, self._world_size, self._max_bytes)
        if problem is not None:
            over, why = problem
            code = Code.RESOURCE_EXHAUSTED if over else Code.INVALID_ARGUMENT
            raise RejectedMessage(
                code, f"rank {rank} sent {held.describe()} with {total} bytes; {why}"
            )
        if held.op in EQUAL_INPUTS and held.inputs:
            other = min(held.inputs)  # (the inputs taken so far all have one size)
            size = held.inputs[other].total_bytes
            if size != total:
                return (
                    f"({held.name}) with {total} bytes, but rank {other} sent {size} bytes "
                    "(every rank's input must have the same size)"
                )
        if held.op == pb.COLLECTIVE_OP_ALL_TO_ALL:
            splits = _splits_of(chunk)
            for other, others in sorted(held.splits.items()):
                found = splits_mismatch(rank, splits, other, others)
                if found is not None:
                    return f"(all_to_all) that {found}"
            held.splits[rank] = splits
        return None

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

    # ------------------------------------------------------------ failures
    def _disagree(self, rank: int, held: _Round, mismatch: str) -> list[Action]:
        """`rank`'s input disagrees with the others': fail the collective for every
        rank and end the sender's stream, each naming both values."""
        message = f"rank {rank} sent collective {held.sequence} {mismatch}"
        actions = self._fail(held, message, ended=rank)
        return [*actions, Terminate((rank,), Code.INVALID_ARGUMENT, message)]

    def _fail(self, held: _Round, message: str, *, ended: int | None = None) -> list[Action]:
        """Fail `held`: tell every rank whose input is whole now, the others once theirs is."""
        held.failure = message
        if ended is not None:
            held.told.add(ended)
        whole = tuple(r for r, item in sorted(held.inputs.items()) if item.complete)
        for rank, item in held.inputs.items():
            if not item.complete:
                held.remaining[rank] = item.total_bytes - item.received
        held.release()
        held.inputs.clear()
        held.splits.clear()
        return self._tell(held, tuple(r for r in whole if r not in held.told))

    def _failed_input(self, rank: int, held: _Round, chunk: pb.CollectiveChunk) -> list[Action]:
        """A chunk of an input to a failed collective: dropped; its sender is told the
        failure once its whole input has arrived."""
        if rank in held.told or rank not in held.participants:
            return []
        left = held.remaining.get(rank, chunk.total_bytes) - len(chunk.payload)
        if left > 0:
            held.remaining[rank] = left
            return []
        held.remaining.pop(rank, None)
        return self._tell(held, (rank,))

    def _tell(self, held: _Round, ranks: tuple[int, ...]) -> list[Action]:
        actions: list[Action] = []
        if ranks:
            failure = held.answer(error=held.failure or "")
            actions.append(Send(ranks, pb.CoordinatorMessage(collective=failure)))
            held.told.update(ranks)
            # A host group's ranks hear it from their leader.
            held.told.update(r for unit in ranks for r in held.covered.get(unit, ()))
        if all(r in held.told for r in held.participants):
            self._close(held)
        return actions

    # ------------------------------------------------------------- results
    def drop_participant(self, rank: int) -> list[Action]:
        """`rank` takes no part from now on: finish rounds that only waited for it.

        A whole input it sent stays its contribution (the result is the one it
        would have got had it stayed a moment longer). A partial one is given
        back now and the round goes on without it: nothing can complete it, so
        the round would otherwise wait for good, holding those bytes, and the
        other ranks with it. A collective that gives each rank its own part
        (reduce_scatter, gather, scatter, all_to_all) cannot go on without
        one: it fails for the others, naming the rank.
        """
        actions: list[Action] = []
        for held in sorted(self._rounds.values(), key=lambda r: r.sequence):
            if rank not in held.participants:
                continue
            if held.failure is None and held.op in PER_RANK:
                actions += self._fail(
                    held,
                    f"rank {rank} stopped taking part in {held.describe()} (lost, or out "
                    "of inputs in join()), which needs every rank of the job",
                    ended=rank,
                )
            if held.failure is not None:
                held.participants.remove(rank)
                held.remaining.pop(rank, None)
                if held.sequence in self._rounds:
                    actions += self._tell(held, ())
                continue
            unit = held.covering(rank)
            if unit is not None and held.inputs[unit].complete:
                continue
            if rank in held.inputs:
                held.forget(rank)
            held.participants.remove(rank)
            if not held.participants:
                self._close(held)
            elif held.ready():
                actions += self._finish(held)
        return actions

    def _finish(self, held: _Round) -> list[Action]:
        participants = tuple(held.participants)
        units = tuple(sorted(held.inputs))  # the senders (their own input, or a host group's)
        received = sum(held.inputs[r].total_bytes for r in units)
        arrived = self._arrivals(held) if self._reports_lag else {}
        by_rank: list[tuple[tuple[int, ...], bytes | memoryview]]
        if folds(held.op, held.dtype):
            # A floating all-reduce: combined chunk by chunk from the inputs' own chunks and
            # encoded once per chunk for every unit (`collective_fold`).
            kept = [held.inputs[r] for r in units]
            fields = held.answer(total_bytes=kept[0].total_bytes)  # reduce_op 0: unset
            chunks = [item.chunks for item in kept if isinstance(item, HeldInput)]
            actions: list[Action] = []
            for offset, payload in folded_results(held.op, held.dtype, chunks):
                fields.offset = offset
                actions.append(Send(units, encode_result(fields, payload)))
            self._close(held)
            self._observe(held, participants, received, fields.total_bytes * len(units), arrived)
            return actions
        if held.op in ELEMENTWISE:
            # The inputs are handed over (no copy) and combined into the first one's bytes,
            # in ascending rank of their senders (a host group's sum in its leader's place).
            inputs = [_assembled(held, r).take() for r in units]
            reduced = reduce_inputs(held.op, held.dtype, inputs, in_place=True)
            by_rank = [(units, reduced)]
        elif held.op in PER_RANK:
            blobs = {r: _assembled(held, r).blob() for r in participants}
            send_splits = {r: splits[0] for r, splits in held.splits.items()}
            results = per_rank_results(
                held.op, held.reduce_op, held.dtype, held.root, blobs, send_splits
            )
            by_rank = [((rank,), result) for rank, result in sorted(results.items())]
        else:
            blobs = {r: _assembled(held, r).blob() for r in participants}
            by_rank = [(participants, self._common(held, participants, blobs))]
        self._close(held)
        sent = sum(len(result) * len(ranks) for ranks, result in by_rank)
        self._observe(held, participants, received, sent, arrived)
        return [
            Send(
                ranks,
                pb.CoordinatorMessage(
                    collective=held.answer(total_bytes=len(result), offset=offset, payload=payload)
                ),
            )
            for ranks, result in by_rank
            for offset, payload in blob_chunks(result, self._chunk_bytes, empty_chunk=True)
        ]

    def _observe(
        self,
        held: _Round,
        participants: tuple[int, ...],
        received: int,
        sent: int,
        arrived: dict[int, float],
    ) -> None:
        if self._observer is None:
            return
        self._observer.observe_collective(held.name.replace(" ", "_"), received, sent)
        if arrived:
            first = min(arrived.values())
            for rank in participants:
                if rank in arrived:
                    self._observer.observe_bucket_arrival(rank, arrived[rank] - first)

    @staticmethod
    def _arrivals(held: _Round) -> dict[int, float]:
        """When each rank's input began to arrive; a host group's ranks as long before
        their leader's upload as they waited for it."""
        arrived = dict(held.arrived)
        for leader, covered in held.covered.items():
            waited = held.waited.get(leader) or (0.0,) * len(covered)
            for rank, wait in zip(covered, waited, strict=True):
                arrived[rank] = held.arrived[leader] - max(0.0, wait)
        return arrived

    @staticmethod
    def _common(held: _Round, participants: tuple[int, ...], blobs: dict[int, bytes]) -> bytes:
        if held.op == pb.COLLECTIVE_OP_ALL_GATHER:
            return b"".join(blobs[r] for r in participants)
        if held.op == pb.COLLECTIVE_OP_BROADCAST:
            if held.root in blobs:
                return blobs[held.root]
            # The root ran out of inputs: the lowest participant that sent data stands in.
            senders = [r for r in participants if blobs[r]] or list(participants)
            return blobs[min(senders)]
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


def _assembled(held: _Round, rank: int) -> BlobAssembler:
    """`rank`'s input to a collective that is not folded (reassembled as it arrived)."""
    item = held.inputs[rank]
    if not isinstance(item, BlobAssembler):
        raise TypeError(f"{held.describe()}: rank {rank}'s input was kept for folding")
    return item


def _splits_of(chunk: pb.CollectiveChunk) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """An ALL_TO_ALL chunk's (send_splits, receive_splits)."""
    return tuple(chunk.send_splits), tuple(chunk.receive_splits)
