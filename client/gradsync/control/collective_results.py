"""Reassembly and checking of collective results as they arrive in chunks (pure logic).

A collective's result comes back from the coordinator as `CollectiveChunk`s,
cut by `Welcome.chunk_bytes` like every other blob. Everything about it is a
claim: its size, its op and dtype, how many ranks contributed and where each
chunk lands. `CollectiveResults` checks each claim against what this rank
asked for before it allocates anything (a SUM answers exactly the input's
size, an ALL_GATHER one input per contributor, a BARRIER nothing, the ops
whose result differs by rank exactly what the caller said), refuses
duplicate or out-of-range chunks (the shared `gradsync_proto.blobs.BlobAssembly`
checks and reassembles them, in any order), and records a problem against the
collective's sequence number so that the waiter gets a `CollectiveError`
naming it, rather than a corrupted tensor.

It holds no lock and imports neither grpc nor torch: `gradsync.control.inbox` calls
it under its own condition variable, and tests drive it chunk by chunk.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from gradsync_proto.blobs import BadChunk, BlobAssembly
from gradsync_proto.dtypes import dtype_name
from gradsync_proto.v1 import gradsync_pb2 as pb

from gradsync import defaults
from gradsync.errors import CollectiveError

#: Largest result accepted when the caller cannot say how big it will be (a raw
#: BROADCAST without `result_bytes`); the public collectives always say.
MAX_UNSIZED_RESULT_BYTES = defaults.MAX_COLLECTIVE_BYTES


def op_name(op: int) -> str:
    """Short human name of a CollectiveOp ("sum", "all_gather"), for messages."""
    try:
        return str(pb.CollectiveOp.Name(op)).removeprefix("COLLECTIVE_OP_").lower()
    except ValueError:
        return f"<unknown op {op}>"


@dataclass
class _Pending:
    """One issued collective and what has come back for it so far."""

    op: int
    dtype: int
    input_bytes: int
    #: The exact result size when this rank knows it without the contributors.
    result_bytes: int | None
    world_size: int
    chunk_bytes: int
    #: The result as it arrives, once its first chunk's claims were checked.
    result: BlobAssembly | None = None
    contributors: int = 0
    error: str | None = None
    #: Called once (by the inbox, outside its lock) when the result is whole or failed.
    on_ready: Callable[[], None] | None = None

    @property
    def complete(self) -> bool:
        return self.error is not None or (self.result is not None and self.result.complete)


class CollectiveResults:
    """Results of the collectives one rank has issued, by sequence number.

    Args:
        rank: this worker's rank (for error messages).
    """

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self._pending: dict[int, _Pending] = {}

    def expect(
        self,
        sequence: int,
        op: int,
        dtype: int,
        input_bytes: int,
        *,
        world_size: int,
        chunk_bytes: int,
        result_bytes: int | None = None,
        on_ready: Callable[[], None] | None = None,
    ) -> None:
        """Register an issued collective, before its input is sent.

        Args:
            sequence: its job-wide sequence number.
            op, dtype: what was asked (the result must say the same).
            input_bytes: this rank's input size.
            world_size: the job's size (bounds the contributors).
            chunk_bytes: the chunk size results are cut by (from Welcome).
            result_bytes: the exact result size, when the caller knows it and
                the op does not imply it (a non-root BROADCAST).
            on_ready: told once the result is whole or failed (`take_ready_hook`).

        Raises:
            ValueError: `sequence` is already outstanding, or a size is negative.
        """
        if sequence in self._pending:
            raise ValueError(f"collective {sequence} was issued twice")
        if input_bytes < 0 or (result_bytes is not None and result_bytes < 0):
            raise ValueError(f"collective {sequence}: negative size")
        if chunk_bytes <= 0:
            raise ValueError(f"collective {sequence}: chunk size must be positive")
        self._pending[sequence] = _Pending(
            op, dtype, input_bytes, result_bytes, world_size, chunk_bytes, on_ready=on_ready
        )

    def outstanding(self) -> list[int]:
        """Sequence numbers issued and not yet taken, ascending."""
        return sorted(self._pending)

    def is_ready(self, sequence: int) -> bool:
        """True once the whole result (or a problem with it) is in."""
        pending = self._pending.get(sequence)
        return pending is not None and pending.complete

    def on_chunk(self, chunk: pb.CollectiveChunk) -> str | None:
        """Take in one result chunk.

        Returns:
            None, or a description of a chunk that belongs to no issued
            collective (the stream itself is then not to be trusted). Problems
            with an issued collective's result are kept for `take` instead.
        """
        sequence = chunk.sequence
        pending = self._pending.get(sequence)
        if pending is None:
            return (
                f"a result chunk of collective {sequence}, which this rank has not issued "
                f"(outstanding: {self.outstanding()})"
            )
        if pending.error is None:
            pending.error = self._check_and_store(pending, chunk)
        return None

    def take_ready_hook(self, sequence: int) -> Callable[[], None] | None:
        """The `on_ready` of collective `sequence` once its result is whole or failed
        (handed out once; None before, after, or without one)."""
        pending = self._pending.get(sequence)
        if pending is None or pending.on_ready is None or not pending.complete:
            return None
        hook, pending.on_ready = pending.on_ready, None
        return hook

    def take_all_hooks(self) -> list[Callable[[], None]]:
        """Every `on_ready` not yet handed out (the stream failed: every wait will raise)."""
        hooks = [p.on_ready for _, p in sorted(self._pending.items()) if p.on_ready is not None]
        for pending in self._pending.values():
            pending.on_ready = None
        return hooks

    def take(self, sequence: int) -> tuple[bytearray, int]:
        """Remove a complete result and return (its bytes, the number of contributors).

        Raises:
            CollectiveError: the result was malformed or not what was asked.
            KeyError: `sequence` is not outstanding.
        """
        pending = self._pending.pop(sequence)
        if pending.error is not None:
            raise CollectiveError(pending.error, rank=self.rank, sequence=sequence)
        if pending.result is None or not pending.result.complete:
            raise CollectiveError("the result is incomplete", rank=self.rank, sequence=sequence)
        return pending.result.blob(), pending.contributors

    def forget(self, sequence: int) -> None:
        """Drop an outstanding collective (its wait gave up)."""
        self._pending.pop(sequence, None)

    def describe(self, sequence: int) -> str:
        """What has arrived of a collective's result, for a timeout's message."""
        pending = self._pending.get(sequence)
        if pending is None:
            return "it is not outstanding"
        what = (
            f"{op_name(pending.op)} of {pending.input_bytes} bytes of {dtype_name(pending.dtype)}"
        )
        result = pending.result
        if result is None:
            return f"{what}: no result chunk arrived"
        missing = result.missing_offsets()
        return (
            f"{what}: {result.chunks_received} of {result.chunks_expected} result chunks "
            f"arrived; missing offsets {missing[:8]}{' ...' if len(missing) > 8 else ''}"
        )

    # ------------------------------------------------------------ checks
    def _check_and_store(self, pending: _Pending, chunk: pb.CollectiveChunk) -> str | None:
        """Check one chunk against what was asked and what came before; store it."""
        if chunk.error:
            # The coordinator failed the collective for every rank (ranks disagreed,
            # or one was lost from an op that needs them all); its words name both sides.
            return f"the coordinator failed it: {chunk.error}"
        if chunk.op != pending.op:
            return (
                f"the result says op {op_name(chunk.op)}, this rank asked for {op_name(pending.op)}"
            )
        if chunk.dtype != pending.dtype:
            return (
                f"the result has dtype {dtype_name(chunk.dtype)}, "
                f"this rank sent {dtype_name(pending.dtype)}"
            )
        result = pending.result
        if result is None:
            problem = self._check_size(pending, chunk.total_bytes, chunk.contributors)
            if problem is not None:
                return problem
            # The claim is checked against what this rank asked for (above); still the
            # buffer grows as chunks arrive, never allocated by a claimed size.
            result = pending.result = BlobAssembly(
                "the result", chunk.total_bytes, pending.chunk_bytes, in_order=False
            )
            pending.contributors = chunk.contributors
        elif chunk.contributors != pending.contributors:
            return (
                f"the result chunk at offset {chunk.offset} claims {chunk.contributors} "
                f"contributors, earlier chunks claimed {pending.contributors}"
            )
        try:
            result.add(chunk.offset, chunk.payload, chunk.total_bytes)
        except BadChunk as bad:
            return bad.message
        return None

    def _check_size(self, pending: _Pending, total: int, contributors: int) -> str | None:
        if not 1 <= contributors <= pending.world_size:
            return (
                f"the result claims {contributors} contributors, expected 1 to "
                f"{pending.world_size} (the world size)"
            )
        op = pending.op
        if op in (
            pb.COLLECTIVE_OP_SUM,
            pb.COLLECTIVE_OP_AVG,
            pb.COLLECTIVE_OP_MIN,
            pb.COLLECTIVE_OP_MAX,
            pb.COLLECTIVE_OP_PRODUCT,
        ):
            expected, why = pending.input_bytes, "the input's size"
        elif op == pb.COLLECTIVE_OP_ALL_GATHER:
            expected = pending.input_bytes * contributors
            why = f"{pending.input_bytes} bytes from each of {contributors} contributors"
        elif op == pb.COLLECTIVE_OP_BARRIER:
            expected, why = 0, "a barrier has no data"
        elif pending.result_bytes is not None:
            expected, why = pending.result_bytes, "the size this rank asked for"
        else:
            if total > MAX_UNSIZED_RESULT_BYTES:
                return (
                    f"the result claims {total} bytes, more than the "
                    f"{MAX_UNSIZED_RESULT_BYTES} accepted for a result of unknown size"
                )
            return None
        if total != expected:
            return f"the result claims {total} bytes, expected {expected} ({why})"
        return None
