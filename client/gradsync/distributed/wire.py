"""The backend's 16-bit wire: which reductions travel as bfloat16 or float16, and how.

With `GradsyncOptions(wire_dtype=torch.bfloat16)` (or `$GRADSYNC_WIRE_DTYPE=bfloat16`)
a group sends the float32 inputs of its summing reductions (all-reduce SUM, AVG and
PREMUL_SUM, all-reduce coalesced, reduce-scatter) rounded to the 16-bit type: half
the bytes up and down. The coordinator widens every rank's input to float32, adds
them in rank order (the result's bits do not depend on which rank arrived first),
rounds the result to the same 16-bit type once and sends that; the group writes it
back into the caller's float32 tensor. Everything else stays exact: MIN, MAX and
PRODUCT, tensors of another dtype (float64, float16, bfloat16, the integers),
broadcast, all-gather, gather, scatter, all-to-all and reduce. Every rank of a group
must use the same wire: the coordinator compares the ranks' dtypes at every
collective and fails the first one that differs on every rank, naming both.
"""

from __future__ import annotations

import os

import torch

#: The environment variable read when `GradsyncOptions.wire_dtype` is not given.
ENV_WIRE_DTYPE = "GRADSYNC_WIRE_DTYPE"
#: What the option and the variable accept (float32: no 16-bit wire).
WIRE_CHOICES: dict[str, torch.dtype] = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
}
#: The reductions (the Collectives op names) whose float32 inputs travel on the wire.
SUMMING = ("sum", "avg")


def check_wire_dtype(wire_dtype: torch.dtype | None, where: str) -> torch.dtype | None:
    """`wire_dtype` as a group uses it: a 16-bit float type, or None for float32.

    Raises:
        ValueError: any other dtype.
    """
    if wire_dtype is None or wire_dtype == torch.float32:
        return None
    if wire_dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(
            f"gradsync backend: {where} must be torch.bfloat16, torch.float16 or "
            f"torch.float32 (no 16-bit wire), got {wire_dtype}"
        )
    return wire_dtype


def resolve_wire_dtype(option: torch.dtype | None) -> torch.dtype | None:
    """The group's wire: the option's, else `$GRADSYNC_WIRE_DTYPE`'s, else None (float32).

    Raises:
        ValueError: the option or the variable names another type.
    """
    if option is not None:
        return check_wire_dtype(option, "GradsyncOptions.wire_dtype")
    text = os.environ.get(ENV_WIRE_DTYPE, "").strip().lower().removeprefix("torch.")
    if not text:
        return None
    if text not in WIRE_CHOICES:
        raise ValueError(
            f"gradsync backend: ${ENV_WIRE_DTYPE}={os.environ[ENV_WIRE_DTYPE]!r} is not one of "
            f"{', '.join(WIRE_CHOICES)}"
        )
    return check_wire_dtype(WIRE_CHOICES[text], f"${ENV_WIRE_DTYPE}")


def wire_for(wire_dtype: torch.dtype | None, dtype: torch.dtype, op: str) -> torch.dtype | None:
    """The 16-bit type a reduction `op` of `dtype` travels in, or None when it goes exact."""
    if wire_dtype is None or dtype != torch.float32 or op not in SUMMING:
        return None
    return wire_dtype


def on_wire(wire_dtype: torch.dtype | None) -> str:
    """' on a bfloat16 wire' (for an operation's name in errors), or ''."""
    if wire_dtype is None:
        return ""
    return f" on a {str(wire_dtype).removeprefix('torch.')} wire"
