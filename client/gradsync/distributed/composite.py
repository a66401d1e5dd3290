"""Reduce-scatter, gather, scatter, all-to-all and reduce in c10d's shapes, on the hub's ops.

c10d hands these ops lists of tensors (one per rank) where the coordinator's
collectives (`gradsync.collectives.Collectives`) take one flat input: these
functions pack and unpack. The hub serves reduce-scatter, gather, scatter and
all-to-all natively, each rank receiving only its own part; reduce is an
all-reduce of which only the root keeps the result. N is the bytes of one
rank's part; W the group's size; "up" is what a rank uploads, "down" what it
receives.

Every function runs on the group's network thread (`gradsync.distributed.work`),
takes a `Collectives`, blocks (each wait bounded by the group's timeout) and
writes its result into the caller's output tensors.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from gradsync.collectives import Collectives


def flat_copy(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """The tensors' values, on the CPU, as one 1-D tensor (a copy)."""
    if not tensors:
        return torch.empty(0)
    return torch.cat([t.detach().reshape(-1).to("cpu") for t in tensors])


def write_into(target: torch.Tensor, values: torch.Tensor) -> None:
    with torch.no_grad():
        target.copy_(values.reshape(target.shape))


def reduce_scatter(
    collectives: Collectives,
    output: torch.Tensor,
    parts: Sequence[torch.Tensor],
    op: str,
    wire: torch.dtype | None = None,
) -> None:
    """`output` = the reduction over ranks of every rank's `parts[my rank]`.

    With `wire` (a 16-bit float type) the parts travel in it and the result comes
    back in it, then widens into `output`. Wire: up W·N, down N per rank (the hub
    sends each rank only its part); a ring reduce-scatter moves (W-1)·N each way
    per rank, over W-1 steps.
    """
    if wire is None:
        collectives.reduce_scatter(output, flat_copy(parts), op)
        return
    narrow = torch.empty(output.numel(), dtype=wire)
    collectives.reduce_scatter(narrow, flat_copy(parts).to(wire), op)
    write_into(output, narrow)


def reduce_by_all_reduce(
    collectives: Collectives, tensor: torch.Tensor, op: str, root: int
) -> None:
    """`tensor` on `root` = the reduction over ranks; the others' tensors stay as they are.

    Runs as one all-reduce on a copy. Wire: up N, down N per rank (a reduce at
    the hub would send nothing down to the other ranks).
    """
    copy = tensor.detach().to("cpu", copy=True)
    collectives.all_reduce(copy, op)
    if collectives.rank == root:
        write_into(tensor, copy)


def gather(
    collectives: Collectives,
    outputs: Sequence[torch.Tensor],
    tensor: torch.Tensor,
    root: int,
) -> None:
    """`root` receives every rank's `tensor` into `outputs` (rank order); others get nothing.

    Wire: up N per rank; the root receives W·N, the others nothing.
    """
    parts = collectives.gather(tensor, root)
    if parts is not None:
        for output, part in zip(outputs, parts, strict=True):
            write_into(output, part)


def scatter(
    collectives: Collectives,
    output: torch.Tensor,
    parts: Sequence[torch.Tensor],
    root: int,
) -> None:
    """Every rank receives `root`'s `parts[its rank]` into `output`.

    Wire: the root uploads W·N, every rank receives its N.
    """
    collectives.scatter(output, parts if collectives.rank == root else None, root)


def all_to_all(
    collectives: Collectives,
    outputs: Sequence[torch.Tensor],
    inputs: Sequence[torch.Tensor],
) -> None:
    """Rank r's `inputs[d]` lands in rank d's `outputs[r]`; parts may differ in size.

    The parts travel as one flat input with its split sizes; the hub checks
    that what rank r sends to rank d is what rank d expects from it and fails
    every rank, naming both sizes, otherwise. Wire: up N, down N per rank,
    with N the rank's own parts (a pairwise exchange moves (W-1)/W·N each way).
    """
    dtype = inputs[0].dtype if inputs else outputs[0].dtype
    received = torch.empty(sum(t.numel() for t in outputs), dtype=dtype)
    collectives.all_to_all(
        received,
        flat_copy(inputs).to(dtype),
        output_splits=[t.numel() for t in outputs],
        input_splits=[t.numel() for t in inputs],
    )
    offset = 0
    for output in outputs:
        write_into(output, received[offset : offset + output.numel()])
        offset += output.numel()
