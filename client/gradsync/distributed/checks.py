"""What the "gradsync" process group checks on the caller's thread, and the helpers it shares.

A c10d call that cannot succeed (an op the coordinator does not reduce with, a
dtype the wire does not carry, tensors of the wrong number or size) raises at
the call, as gloo's does, before anything is queued; these are those checks
and the small conversions the process group's ops share.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from gradsync.path.signature import WIRE_DTYPES

# torch's stubs do not describe ReduceOp's `.op` / `.factor`: taken untyped, here only.
RedOpType: Any = dist.ReduceOp.RedOpType
REDUCE_NAMES = {
    RedOpType.SUM: "sum",
    RedOpType.AVG: "avg",
    RedOpType.MIN: "min",
    RedOpType.MAX: "max",
    RedOpType.PRODUCT: "product",
    RedOpType.PREMUL_SUM: "sum",  # the input is scaled by the factor first
}
FLOATING = (torch.float32, torch.float64, torch.float16, torch.bfloat16)

POINT_TO_POINT = (
    "gradsync: {what} is not supported: the gradsync backend runs collectives through a "
    "coordinator (a hub), not point-to-point transfers between ranks; use a collective "
    "(broadcast, scatter, all_to_all) or a second process group on gloo for send/recv"
)


def op_of(opts: Any) -> Any:
    """The ReduceOp of c10d's options object (SUM when there are none)."""
    return getattr(opts, "reduceOp", dist.ReduceOp.SUM) if opts is not None else dist.ReduceOp.SUM


def reduce_op(op: Any, dtype: torch.dtype, what: str) -> tuple[str, Any]:
    """(the Collectives op name, the PREMUL_SUM factor or None) of a c10d ReduceOp.

    Raises:
        ValueError: a bitwise op, or AVG of an integer tensor.
    """
    kind: Any = getattr(op, "op", op)  # a ReduceOp holds its RedOpType; or one itself
    name = REDUCE_NAMES.get(kind)
    if name is None:
        raise ValueError(
            f"gradsync: {what} with ReduceOp.{getattr(kind, 'name', kind)} is not supported "
            "(the coordinator reduces with SUM, AVG, MIN, MAX, PRODUCT and PREMUL_SUM)"
        )
    if kind == RedOpType.AVG and dtype not in FLOATING:
        raise ValueError(f"gradsync: {what} with ReduceOp.AVG needs a floating tensor, got {dtype}")
    factor = op.factor if kind == RedOpType.PREMUL_SUM else None  # (a float or a tensor)
    return name, factor


def check_dtype(tensor: torch.Tensor, what: str, *, reducing: bool) -> None:
    """Raise ValueError unless `tensor` is dense and of a dtype the wire carries (and, when
    `reducing`, one the coordinator can reduce: not bool)."""
    if tensor.layout != torch.strided:
        raise ValueError(f"{what} needs a dense tensor, got layout {tensor.layout}")
    if tensor.dtype not in WIRE_DTYPES or (reducing and tensor.dtype == torch.bool):
        raise ValueError(f"gradsync: {what} does not support dtype {tensor.dtype}")


def describe(tensor: torch.Tensor) -> str:
    """'[3, 2] float32', for names and messages."""
    return f"{list(tensor.shape)} {str(tensor.dtype).removeprefix('torch.')}"


def chunks(tensor: torch.Tensor, parts: int) -> list[torch.Tensor]:
    """`tensor` cut into `parts` equal flat pieces (views when it is contiguous)."""
    flat = tensor.reshape(-1)
    size = flat.numel() // parts
    return [flat[i * size : (i + 1) * size] for i in range(parts)]


def split_rows(
    tensor: torch.Tensor, split_sizes: Sequence[int], world: int, what: str
) -> list[torch.Tensor]:
    """all_to_all_single's parts: rows of dim 0 per rank (equal when no sizes are given)."""
    rows = tensor.shape[0] if tensor.dim() else 0
    sizes = list(split_sizes) or ([rows // world] * world if rows % world == 0 else [])
    if len(sizes) != world or sum(sizes) != rows:
        raise ValueError(
            f"all_to_all_single: {what} split sizes {list(split_sizes)} do not cut "
            f"{rows} rows into {world} parts"
        )
    return list(torch.split(tensor, sizes, dim=0))


def flat_copy(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """The tensors' values, on the CPU, as one 1-D tensor (a copy)."""
    if not tensors:
        return torch.empty(0)
    return torch.cat([t.detach().reshape(-1).to("cpu") for t in tensors])


def write_into(target: torch.Tensor, values: torch.Tensor) -> None:
    with torch.no_grad():
        target.copy_(values.reshape(target.shape))


def write_parts(targets: Sequence[torch.Tensor], parts: Sequence[torch.Tensor]) -> None:
    """Each of `parts` into its target."""
    for target, part in zip(targets, parts, strict=True):
        write_into(target, part)


def write_flat(targets: Sequence[torch.Tensor], flat: torch.Tensor) -> None:
    """`flat`'s values into `targets`, one after another."""
    offset = 0
    for target in targets:
        write_into(target, flat[offset : offset + target.numel()])
        offset += target.numel()
