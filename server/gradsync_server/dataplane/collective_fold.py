"""A floating element-wise collective reduced chunk by chunk, with no input reassembled.

An all-reduce of float32, float64, float16 or bfloat16 values (SUM, AVG,
MIN, MAX, PRODUCT; a PREMUL_SUM arrives as a SUM of scaled inputs) is served
here instead of by copying every rank's input into one buffer and combining
the copies (`collective_ops.reduce_inputs`). Each rank's chunks are kept as
they arrived: the payload objects themselves, each checked against the wire
grid by `uploads.BlobAssembler` and counted in the job's byte budget, never copied.
Once every input is whole the result is made chunk by chunk: the chunks at
one offset are combined in ascending rank of their senders (float32
accumulation, float64 for float64), the first read in place and the second
added to it into a fresh array, so the result is the reassembling path's,
bit for bit, whatever order chunks and inputs arrived in. A collective with
one input (a host group's leader covering every rank) is answered with that
input's own chunks. Each result chunk is encoded once, straight from its
accumulator, into the one message every recipient gets (`encode_result`):
one copy of the result's bytes instead of three (a `bytes` of the chunk, the
message holding it, its serialization).

Why combine at the end rather than fold each chunk into a running sum as it
arrives, as the gradient data plane does: a collective's participants can
change while it is open. A rank lost while sending, or out of inputs, is
dropped and the result must be the one without any of its input (a float
sum cannot give back a part already added), and a healed newcomer may join
with a rank below inputs already there (rank order would be broken). Both
keep a folded-as-it-comes sum from being the rank-order sum; holding the
chunks until the end costs what the reassembled copies cost in memory, and
none of their copying, which is what the coordinator spent most of its time
on for stock DDP over the backend. Pure numpy, no I/O.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np
import numpy.typing as npt
from gradsync_proto import dtypes
from gradsync_proto.v1 import gradsync_pb2 as pb

from gradsync_server.dataplane.accumulators import WIDE, decoded, from_accumulator, to_accumulator
from gradsync_server.dataplane.budget import OwnerBudget
from gradsync_server.dataplane.uploads import BlobAssembler

__all__ = ["FOLDED_OPS", "HeldInput", "encode_result", "folded_results", "folds"]

#: The element-wise ops folded here (any floating dtype).
FOLDED_OPS = frozenset(
    {
        pb.COLLECTIVE_OP_SUM,
        pb.COLLECTIVE_OP_AVG,
        pb.COLLECTIVE_OP_MIN,
        pb.COLLECTIVE_OP_MAX,
        pb.COLLECTIVE_OP_PRODUCT,
    }
)


def _varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


#: CoordinatorMessage.collective and CollectiveChunk.payload, as wire tags (field, LEN).
_COLLECTIVE_TAG = _varint((25 << 3) | 2)
_PAYLOAD_TAG = _varint((6 << 3) | 2)


def folds(op: int, dtype: int) -> bool:
    """Whether an all-reduce of `op` on `dtype` is folded here."""
    return op in FOLDED_OPS and dtype in dtypes.REDUCIBLE_DTYPES


class HeldInput:
    """One rank's input to a folded collective: its chunks as they arrived, by offset.

    The same interface as `uploads.BlobAssembler` where `Collectives` uses it
    (`total_bytes`, `received`, `complete`, `add`, `release`).

    Args:
        what: the input and its sender, in messages.
        total_bytes: the size the sender declares (checked by the caller; never allocated).
        chunk_bytes: the wire chunk size.
        budget: the job's share of the byte budget the chunks are counted in.
    """

    def __init__(self, what: str, total_bytes: int, chunk_bytes: int, budget: OwnerBudget) -> None:
        # Checked and counted as any upload, its bytes not assembled: kept here instead.
        self._checks = BlobAssembler(
            what, total_bytes, chunk_bytes, None, budget, in_order=False, keep=False
        )
        #: The chunks so far, by offset (the payloads as received).
        self.chunks: dict[int, bytes] = {}

    @property
    def total_bytes(self) -> int:
        return self._checks.total_bytes

    @property
    def received(self) -> int:
        return self._checks.received

    @property
    def complete(self) -> bool:
        return self._checks.complete

    def add(self, offset: int, payload: bytes, claimed_total: int | None = None) -> bool:
        """Check and keep one chunk (no copy); True once the input is whole.

        Raises:
            RejectedMessage: a chunk that does not fit the input, or no room for it in
                the byte budget (`uploads.BlobAssembler.add`).
        """
        complete = self._checks.add(offset, payload, claimed_total)
        self.chunks[offset] = payload
        return complete

    def release(self) -> None:
        """Drop the chunks and give their bytes back (idempotent)."""
        self.chunks = {}
        self._checks.release()


def folded_results(
    op: int, dtype: int, inputs: Sequence[dict[int, bytes]]
) -> Iterator[tuple[int, bytes | memoryview]]:
    """(offset, bytes) of each result chunk, ascending, in the inputs' dtype.

    `inputs` are the whole inputs' chunks by offset, in ascending rank of their
    senders. Each chunk is combined over the inputs in that order (float32
    accumulation, float64 for float64), the first input read in place and the
    second added to it into a fresh array: the same operations as
    `collective_ops.reduce_inputs` element by element, so the same bits. One
    input of float32/float64 (a host group's leader covering every rank) is
    answered with its own chunks for SUM, MIN, MAX and PRODUCT. Lazy: one
    chunk's accumulator at a time.
    """
    average = op == pb.COLLECTIVE_OP_AVG
    first, rest = inputs[0], inputs[1:]
    for offset in sorted(first):
        payload = first[offset]
        if not rest and dtype in WIDE and not average:
            yield offset, payload
            continue
        values = _combine(op, dtype, payload, [other[offset] for other in rest])
        if average:
            values /= len(inputs)
        yield offset, from_accumulator(values, dtype)


def _combine(
    op: int, dtype: int, first: bytes, others: Sequence[bytes]
) -> npt.NDArray[np.floating]:
    if not others:
        return to_accumulator(memoryview(first), dtype)
    values = decoded(memoryview(first), dtype)
    for index, payload in enumerate(others):
        other = decoded(memoryview(payload), dtype)
        out = None if index == 0 else values  # the first pair out of place: no copy of it
        if op in (pb.COLLECTIVE_OP_SUM, pb.COLLECTIVE_OP_AVG):
            values = np.add(values, other, out=out)
        elif op == pb.COLLECTIVE_OP_PRODUCT:
            values = np.multiply(values, other, out=out)
        elif op == pb.COLLECTIVE_OP_MIN:
            values = np.minimum(values, other, out=out)
        else:
            values = np.maximum(values, other, out=out)
    return values


def encode_result(fields: pb.CollectiveChunk, payload: bytes | memoryview) -> bytes:
    """The CoordinatorMessage carrying `fields` (everything but the payload) with
    `payload`, serialized with one copy of the payload (no message holds it)."""
    head = fields.SerializeToString() + _PAYLOAD_TAG + _varint(len(payload))
    inner = len(head) + len(payload)
    return b"".join((_COLLECTIVE_TAG, _varint(inner), head, payload))
