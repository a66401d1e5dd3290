"""What each collective computes and what sizes it accepts: pure functions, no state.

`collectives` pairs the ranks' inputs up by sequence number; this module
says, for one op, which dtypes it takes, whether the ranks' sizes and splits
fit together (every size is a claim: it is checked here, against the
coordinator's limit, before a byte of it is buffered), and what each rank
receives once every input is in. Results never depend on arrival order:
inputs are combined in ascending rank order only when all have arrived,
floating values in float32 (float64 for float64; float16 and bfloat16 inputs
widen to float32 and narrow once, at the end), integers in int64.

The hub's ops that give each rank only its own part (REDUCE_SCATTER,
GATHER, SCATTER, ALL_TO_ALL) need every rank of the job: with a rank missing
there is no part to give it, or no part it should have sent.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
from gradsync_proto import dtypes
from gradsync_proto.v1 import gradsync_pb2 as pb

from gradsync_server.dataplane.accumulators import decoded, from_accumulator, to_accumulator

_FLOATING = dtypes.REDUCIBLE_DTYPES
#: The floating dtypes that are their own accumulation dtype (combined in place).
_WIDE: dict[int, str] = {pb.DTYPE_FLOAT32: "<f4", pb.DTYPE_FLOAT64: "<f8"}
#: Integer dtypes and how numpy reads them (bool as bytes: MIN/MAX are AND/OR).
_INTEGER_LAYOUT: dict[int, str] = {
    pb.DTYPE_INT64: "<i8",
    pb.DTYPE_INT32: "<i4",
    pb.DTYPE_INT16: "<i2",
    pb.DTYPE_INT8: "i1",
    pb.DTYPE_UINT8: "u1",
    pb.DTYPE_BOOL: "u1",
}
#: Element-wise reductions (an all_reduce, or how a REDUCE_SCATTER combines).
ELEMENTWISE: tuple[int, ...] = (
    pb.COLLECTIVE_OP_SUM,
    pb.COLLECTIVE_OP_AVG,
    pb.COLLECTIVE_OP_MIN,
    pb.COLLECTIVE_OP_MAX,
    pb.COLLECTIVE_OP_PRODUCT,
)
#: Ops whose result differs by rank; each needs every rank of the job.
PER_RANK: tuple[int, ...] = (
    pb.COLLECTIVE_OP_REDUCE_SCATTER,
    pb.COLLECTIVE_OP_GATHER,
    pb.COLLECTIVE_OP_SCATTER,
    pb.COLLECTIVE_OP_ALL_TO_ALL,
)
#: Ops with a root rank.
ROOTED: tuple[int, ...] = (
    pb.COLLECTIVE_OP_BROADCAST,
    pb.COLLECTIVE_OP_GATHER,
    pb.COLLECTIVE_OP_SCATTER,
)
#: Ops whose inputs must all have the same size.
EQUAL_INPUTS: tuple[int, ...] = (
    *ELEMENTWISE,
    pb.COLLECTIVE_OP_ALL_GATHER,
    pb.COLLECTIVE_OP_REDUCE_SCATTER,
    pb.COLLECTIVE_OP_GATHER,
)


def op_name(op: int, reduce_op: int = 0) -> str:
    """'all_reduce sum', 'reduce_scatter max', 'broadcast', ... for error messages."""
    if op not in pb.CollectiveOp.values() or op == pb.COLLECTIVE_OP_UNSPECIFIED:
        return f"<unknown op {op}>"
    name = str(pb.CollectiveOp.Name(op)).removeprefix("COLLECTIVE_OP_").lower()
    if op in ELEMENTWISE:
        return f"all_reduce {name}"
    if op == pb.COLLECTIVE_OP_REDUCE_SCATTER:
        return f"reduce_scatter {op_name(reduce_op).removeprefix('all_reduce ')}"
    return name


def op_dtype_problem(op: int, reduce_op: int, dtype: int) -> str | None:
    """Why `op` (combining by `reduce_op` for REDUCE_SCATTER) cannot run on `dtype`, or None."""
    if op == pb.COLLECTIVE_OP_REDUCE_SCATTER:
        if reduce_op not in ELEMENTWISE:
            return "reduce_scatter needs a reduce op of sum, avg, min, max or product"
        op = reduce_op
    if op == pb.COLLECTIVE_OP_AVG and dtype not in _FLOATING:
        return "avg needs a floating dtype"
    if op in (pb.COLLECTIVE_OP_SUM, pb.COLLECTIVE_OP_PRODUCT):
        what = "sum" if op == pb.COLLECTIVE_OP_SUM else "product"
        if dtype == pb.DTYPE_BOOL:
            return f"{what} of bool is not defined (use max for 'any', min for 'all')"
        if dtype not in _FLOATING and dtype not in _INTEGER_LAYOUT:
            return f"{what} needs a floating or integer dtype"
    return None


def _decode(raw: bytes | bytearray, dtype: int) -> npt.NDArray[Any]:
    """A fresh, writable accumulation array: float32/float64 for floats, int64 for integers."""
    if dtype in _FLOATING:
        return to_accumulator(memoryview(raw), dtype)
    return np.frombuffer(raw, dtype=_INTEGER_LAYOUT[dtype]).astype(np.int64)


def reduce_inputs(
    op: int, dtype: int, inputs: Sequence[bytes | bytearray], *, in_place: bool = False
) -> bytes | memoryview:
    """Combine equal-sized inputs (in the order given: ascending rank) element-wise.

    Floating dtypes accumulate in float32 (float64 for float64) and come back
    in their own dtype; integers accumulate in int64 and wrap back. The inputs
    after the first are read in place (float32/float64: no copy). With
    `in_place` the caller gives up the first input, a writable `bytearray`:
    float32/float64 values are combined into it and the result is a view of it
    (the same arithmetic in the same order, so the same bits, without a copy).
    """
    first = inputs[0]
    if in_place and isinstance(first, bytearray) and dtype in _WIDE:
        values = np.frombuffer(first, dtype=_WIDE[dtype])
    else:
        values = _decode(first, dtype)
    for raw in inputs[1:]:
        other = decoded(memoryview(raw), dtype) if dtype in _FLOATING else _decode(raw, dtype)
        if op in (pb.COLLECTIVE_OP_SUM, pb.COLLECTIVE_OP_AVG):
            values += other
        elif op == pb.COLLECTIVE_OP_PRODUCT:
            values *= other
        elif op == pb.COLLECTIVE_OP_MIN:
            np.minimum(values, other, out=values)
        else:
            np.maximum(values, other, out=values)
    if dtype not in _FLOATING:
        return values.astype(_INTEGER_LAYOUT[dtype]).tobytes()
    if op == pb.COLLECTIVE_OP_AVG:
        values /= len(inputs)
    result = from_accumulator(values, dtype)
    return result if in_place else bytes(result)


def input_size_problem(
    op: int,
    dtype: int,
    rank: int,
    root: int,
    total: int,
    world_size: int,
    participants: int,
    max_bytes: int,
) -> tuple[bool, str] | None:
    """Why one rank's declared input size is refused, or None.

    Returns (whether it is over a limit rather than malformed, the reason).
    """
    item = dtypes.itemsize(dtype)
    if total % item:
        return False, f"not a whole number of {dtypes.dtype_name(dtype)} elements"
    if total > max_bytes:
        return True, f"the limit is {max_bytes} bytes (--max-collective-mb)"
    if op == pb.COLLECTIVE_OP_BARRIER and total:
        return False, "a barrier carries no data"
    if op == pb.COLLECTIVE_OP_SCATTER and rank != root and total:
        return False, f"only the root (rank {root}) of a scatter sends data"
    parted = op == pb.COLLECTIVE_OP_REDUCE_SCATTER or (
        op == pb.COLLECTIVE_OP_SCATTER and rank == root
    )
    if parted and total % (item * world_size):
        return False, (
            f"not {world_size} equal parts of whole {dtypes.dtype_name(dtype)} elements "
            "(one per rank)"
        )
    if op in (pb.COLLECTIVE_OP_ALL_GATHER, pb.COLLECTIVE_OP_GATHER):
        gathered = total * participants
        if gathered > max_bytes:
            return True, (
                f"gathered over {participants} ranks that makes {gathered} bytes, above the "
                f"limit of {max_bytes} bytes (--max-collective-mb)"
            )
    return None


def splits_problem(
    dtype: int,
    total: int,
    send_splits: Sequence[int],
    receive_splits: Sequence[int],
    world_size: int,
    max_bytes: int,
) -> tuple[bool, str] | None:
    """Why one rank's ALL_TO_ALL splits are refused, or None (see `input_size_problem`)."""
    item = dtypes.itemsize(dtype)
    for what, splits in (("send_splits", send_splits), ("receive_splits", receive_splits)):
        if len(splits) != world_size:
            return False, f"{len(splits)} {what}, expected one per rank ({world_size})"
        odd = [size for size in splits if size % item]
        if odd:
            return False, (
                f"{what} {list(splits)}: {odd[0]} bytes is not a whole number of "
                f"{dtypes.dtype_name(dtype)} elements"
            )
    if sum(send_splits) != total:
        return False, f"send_splits {list(send_splits)} sum to {sum(send_splits)}, not {total}"
    if sum(receive_splits) > max_bytes:
        return True, (
            f"receive_splits sum to {sum(receive_splits)} bytes, above the limit of "
            f"{max_bytes} bytes (--max-collective-mb)"
        )
    return None


def splits_mismatch(
    rank: int,
    splits: tuple[Sequence[int], Sequence[int]],
    other: int,
    others: tuple[Sequence[int], Sequence[int]],
) -> str | None:
    """How two ranks' ALL_TO_ALL splits disagree, or None (each must send what the
    other expects from it)."""
    if splits[0][other] != others[1][rank]:
        return (
            f"sends {splits[0][other]} bytes to rank {other}, but rank {other} expects "
            f"{others[1][rank]} bytes from it"
        )
    if others[0][rank] != splits[1][other]:
        return (
            f"expects {splits[1][other]} bytes from rank {other}, but rank {other} sends "
            f"{others[0][rank]} bytes to it"
        )
    return None


def per_rank_results(
    op: int,
    reduce_op: int,
    dtype: int,
    root: int,
    inputs: Mapping[int, bytes],
    send_splits: Mapping[int, Sequence[int]],
) -> dict[int, bytes]:
    """What each rank receives from a PER_RANK op, given every rank's input by rank."""
    ranks = sorted(inputs)
    world = len(ranks)
    if op == pb.COLLECTIVE_OP_REDUCE_SCATTER:
        reduced = bytes(reduce_inputs(reduce_op, dtype, [inputs[r] for r in ranks]))
        part = len(reduced) // world
        return {r: reduced[i * part : (i + 1) * part] for i, r in enumerate(ranks)}
    if op == pb.COLLECTIVE_OP_GATHER:
        return {r: b"".join(inputs[s] for s in ranks) if r == root else b"" for r in ranks}
    if op == pb.COLLECTIVE_OP_SCATTER:
        data = inputs[root]
        part = len(data) // world
        return {r: data[i * part : (i + 1) * part] for i, r in enumerate(ranks)}
    # ALL_TO_ALL: rank r gets part r of every rank, in rank order.
    starts = {s: np.concatenate(([0], np.cumsum(send_splits[s]))).tolist() for s in ranks}
    return {
        r: b"".join(inputs[s][starts[s][i] : starts[s][i + 1]] for s in ranks)
        for i, r in enumerate(ranks)
    }
