"""DiLoCo's compact answer: the change of the ranks' copy of the global parameters (pure).

An outer step's answer is, by default, the new global parameters in
float32: four bytes per parameter down for one (int8) byte up. With
`OuterOptimizer.answer_dtype` = int8 (or bfloat16) the coordinator keeps,
beside its exact float32 global parameters (which the outer optimizer goes on
updating exactly), the **public copy**: the global parameters exactly as the
ranks hold them. Each round it answers every chunk with

    q = quantize(exact - public)       (int8 with the chunk's float32 scale, or bfloat16)
    public = public + dequantize(q)    (float32: one multiply, then one add)

and every rank does the same addition on its own copy, so the ranks and the
public copy stay bitwise identical. The next round's change is taken against
the public copy again, so the quantization error never accumulates: it is
carried into the next answer (error feedback at the coordinator), and
|public - exact| <= scale / 2 per element after every round (int8; bfloat16:
half an ulp of bfloat16 of the change). The ranks compute their
pseudo-gradients against the public copy they hold.

Why the rounding is spelled out: a rank adds the dequantized change with
plain float32 operations (multiply, then add, each correctly rounded; no
fused multiply-add, which rounds once for both), exactly as here, so both
ends get the same bits whatever their hardware. The int8 rule is the int8
wire's (`gradsync_proto.int8_wire`); bfloat16 rounds to nearest even and
widens exactly (`accumulators.from_accumulator` / `to_accumulator`).

The seed round (the ranks' identical parameters) is answered in float32, so
after it the public copy equals the exact parameters. An int8 answer needs the
int8 wire (a bfloat16 answer the bfloat16 wire): the answer to a chunk is then
one message on the upload's own grid, so each answer chunk's scale travels in
its own header (`GradientChunk.scale`), as the upload's did.

With `OuterOptimizer.answer_density` > 0 (DiLoCo's sparse 2-bit wire) the
int8 answer is sparse too: each chunk's change is sent as its top
answer_density elements, 2 bits each with the chunk's own step
(`gradsync_proto.sparse_wire`, `ENCODING_TOPK2`), one message per uploaded
chunk whose size depends on the density alone, not on how many ranks
contributed. The rule above is unchanged: public moves by exactly what the
ranks add (q * step, then one add), so what the answer leaves out stays in
exact - public, the coordinator's own residual, and goes out in a later answer.

What a snapshot of the outer state must hold besides the exact parameters and
the momentum: the public copy (`PublicCopy.values`), else a restarted
coordinator would answer changes against a copy no rank holds.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
from gradsync_proto import dtypes, int8_wire, sparse_wire
from gradsync_proto.codec import ChunkHeader
from gradsync_proto.v1 import gradsync_pb2 as pb

from gradsync_server.dataplane.accumulators import from_accumulator, to_accumulator
from gradsync_server.dataplane.chunk_checks import refused

__all__ = ["ANSWER_DTYPES", "PublicCopy", "answer_dtype_of", "answer_dtype_problem", "quantize"]

Floats = npt.NDArray[np.float32]

#: What an outer step may be answered in (float32 = the parameters themselves).
ANSWER_DTYPES = (pb.DTYPE_FLOAT32, pb.DTYPE_INT8, pb.DTYPE_BFLOAT16)


def answer_dtype_of(outer: pb.OuterOptimizer | None) -> int:
    """The job's answer dtype (unset = float32, the exact parameters)."""
    if outer is None or outer.answer_dtype == pb.DTYPE_UNSPECIFIED:
        return pb.DTYPE_FLOAT32
    return int(outer.answer_dtype)


def answer_dtype_problem(outer: pb.OuterOptimizer) -> str | None:
    """Why a signature's `answer_dtype` (and `answer_density`) cannot be served, or None."""
    answer = answer_dtype_of(outer)
    density = outer.answer_density
    if density:
        problem = sparse_wire.density_problem(density)
        if problem is not None:
            return f"the outer answer density: {problem}"
        if answer != pb.DTYPE_INT8:
            return (
                f"the outer answer density {density!r} needs the int8 answer dtype, not "
                f"{dtypes.dtype_name(answer)} (a sparse answer is int8 levels)"
            )
    if answer not in ANSWER_DTYPES:
        return (
            f"the outer answer dtype {dtypes.dtype_name(answer)} is not supported: "
            f"{', '.join(dtypes.dtype_name(d) for d in ANSWER_DTYPES)} (or unset = float32)"
        )
    if answer != pb.DTYPE_FLOAT32 and outer.min_contributors:
        # A late rank is answered with the global parameters, not the public copy.
        return (
            f"the outer answer dtype {dtypes.dtype_name(answer)} cannot be combined with "
            f"min_contributors {outer.min_contributors} (partial rounds) yet: a late rank "
            "would not hold the public copy; use the float32 answer"
        )
    return None


def quantize(
    change: Floats, answer_dtype: int, density: float = 0.0
) -> tuple[memoryview, float, Floats]:
    """A chunk's change on the wire, its scale, and what the ranks add for it.

    Args:
        change: exact - public over the chunk (float32, 1-D).
        answer_dtype: DTYPE_INT8 or DTYPE_BFLOAT16.
        density: > 0: sparse (int8 only; the step travels in the payload).

    Returns:
        (payload bytes, scale (dense int8; else 0.0), the dequantized change in float32).
    """
    if density:
        encoded, chunk = sparse_wire.encode(change, density)
        return memoryview(encoded), 0.0, chunk.values()
    if answer_dtype == pb.DTYPE_INT8:
        q, scale = int8_wire.quantize_chunk(change)
        return q.data.cast("B"), scale, int8_wire.dequantize(q, scale)
    payload = from_accumulator(change, answer_dtype)
    return payload, 0.0, to_accumulator(payload, answer_dtype).astype(np.float32, copy=False)


@dataclass
class Pending:
    """One chunk's new values (global parameters and momentum, or public values),
    applied when the step completes."""

    bucket: int
    start: int
    values: Floats
    momentum: Floats | None = None

    def apply(self, values: dict[int, Floats], momenta: dict[int, Floats] | None = None) -> None:
        """Write the chunk's values (and momentum, if it has some) into their arrays."""
        stop = self.start + len(self.values)
        values[self.bucket][self.start : stop] = self.values
        if momenta is not None and self.momentum is not None:
            momenta[self.bucket][self.start : stop] = self.momentum


class PublicCopy:
    """The global parameters as the ranks hold them, for this plane's range of each bucket.

    Inactive (holds nothing) when the job's answer is the exact float32 parameters.

    Args:
        answer_dtype: the job's answer dtype (`answer_dtype_of`).
        density: the job's `answer_density` (> 0: sparse int8 answers).
    """

    def __init__(self, answer_dtype: int, density: float = 0.0) -> None:
        self.answer_dtype = answer_dtype
        self.density = density if answer_dtype == pb.DTYPE_INT8 else 0.0
        #: Per outer bucket: the public copy of this plane's range (what a snapshot needs).
        self.values: dict[int, Floats] = {}
        self._pending: list[Pending] = []
        #: (bucket, wire offset) -> the scale of the open step's answer to that chunk.
        self._scales: dict[tuple[int, int], float] = {}

    @property
    def active(self) -> bool:
        """True if answers are compact (changes of the public copy), not the parameters."""
        return self.answer_dtype != pb.DTYPE_FLOAT32

    def held_bytes(self) -> int:
        """Bytes of the public copy."""
        return sum(array.nbytes for array in self.values.values())

    def reply_dtype(self, seeded: bool) -> int:
        """The dtype every chunk of an outer bucket must ask its answer in."""
        return self.answer_dtype if seeded else pb.DTYPE_FLOAT32

    def check_reply(self, rank: int, chunk: ChunkHeader, wire_dtype: int, seeded: bool) -> int:
        """The reply dtype of a chunk of an outer bucket, if it is the one the job answers in.

        The seed is answered in float32, every later step in the job's answer
        dtype, and a compact answer only to a chunk of the same wire dtype (one
        message per chunk, on the upload's grid). Every rank asking exactly this
        also makes them agree with each other.

        Raises:
            RejectedMessage: INVALID_ARGUMENT naming rank, step, bucket and both dtypes.
        """
        step, bucket = chunk.step, chunk.bucket_index
        asked = chunk.reply_dtype or wire_dtype  # unset: the payload's
        wanted = self.reply_dtype(seeded)
        where = f"rank {rank} asked for the answer to bucket {bucket} of step {step}"
        if asked != wanted:
            when = "every outer step after the seed" if seeded else "the seed"
            raise refused(
                chunk,
                f"{where} in {dtypes.dtype_name(asked)}, but this job answers {when} in "
                f"{dtypes.dtype_name(wanted)} (the outer optimizer's answer dtype is "
                f"{dtypes.dtype_name(self.answer_dtype)})",
            )
        if asked != pb.DTYPE_FLOAT32 and wire_dtype != asked:
            raise refused(
                chunk,
                f"{where} in {dtypes.dtype_name(asked)}, but sent it as "
                f"{dtypes.dtype_name(wire_dtype)}: a {dtypes.dtype_name(asked)} answer needs a "
                f"{dtypes.dtype_name(asked)} wire (one answer per uploaded chunk)",
            )
        return asked

    def answer(self, bucket: int, start: int, offset: int, exact: Floats) -> memoryview:
        """A chunk's answer once the new exact parameters are known (pending until `commit`).

        Args:
            bucket: the bucket.
            start: the chunk's first element, relative to this plane's range.
            offset: the chunk's offset in wire bytes (its answer's, and its scale's key).
            exact: the chunk's new exact global parameters.
        """
        if not self.active:
            return exact.astype("<f4", copy=False).data.cast("B")
        public = self.values[bucket][start : start + len(exact)]
        change = exact - public
        payload, scale, added = quantize(change, self.answer_dtype, self.density)
        self._pending.append(Pending(bucket, start, public + added))
        self._scales[(bucket, offset)] = scale
        return payload

    def encoding_at(self, bucket: int, offset: int) -> int:
        """The encoding of the open step's answer to the chunk at `offset`."""
        sparse = self.density and (bucket, offset) in self._scales
        return pb.ENCODING_TOPK2 if sparse else pb.ENCODING_RAW

    def scale_at(self, bucket: int, offset: int) -> float:
        """The scale of the open step's answer to the chunk at `offset` (0.0: none)."""
        return self._scales.get((bucket, offset), 0.0)

    def commit(self, parameters: Mapping[int, Floats], seeding: bool) -> None:
        """The step completed: after the seed the public copy is the exact parameters,
        after an outer step it moves by what the ranks added."""
        if self.active and seeding:
            self.values = {index: values.copy() for index, values in parameters.items()}
        for pending in self._pending:
            pending.apply(self.values)
        self.discard()

    def discard(self) -> None:
        """The step was aborted (or is over): nothing pending is applied."""
        self._pending.clear()
        self._scales.clear()
