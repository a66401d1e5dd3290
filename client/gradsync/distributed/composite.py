"""Collectives composed of others: reduce-scatter, gather, scatter, all-to-all, reduce.

The coordinator runs all-reduce, broadcast, all-gather and barrier; the ops
here are built from them, correct on every rank but not bandwidth-optimal. A
hub that serves each op natively replaces one function here (its
docstring says what it costs now and what the native op would cost). N is
the bytes of one rank's part; W the group's size; "up" is what a rank
uploads, "down" what it receives.

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


def reduce_scatter_by_all_reduce(
    collectives: Collectives, output: torch.Tensor, parts: Sequence[torch.Tensor], op: str
) -> None:
    """`output` = the reduction over ranks of every rank's `parts[my rank]`.

    Runs as one all-reduce of all W parts, of which this rank keeps its own.
    Wire: up W·N, down W·N per rank. A hub's native reduce-scatter sends each
    rank only its part (up W·N, down N); ring reduce-scatter moves (W-1)·N each way.
    """
    flat = flat_copy(parts)
    collectives.all_reduce(flat, op)
    size = output.numel()
    rank = collectives.rank
    write_into(output, flat[rank * size : (rank + 1) * size])


def reduce_by_all_reduce(
    collectives: Collectives, tensor: torch.Tensor, op: str, root: int
) -> None:
    """`tensor` on `root` = the reduction over ranks; the others' tensors stay as they are.

    Runs as one all-reduce on a copy. Wire: up N, down N per rank (a native
    reduce would send nothing down to the other ranks).
    """
    copy = tensor.detach().to("cpu", copy=True)
    collectives.all_reduce(copy, op)
    if collectives.rank == root:
        write_into(tensor, copy)


def gather_by_all_gather(
    collectives: Collectives,
    outputs: Sequence[torch.Tensor],
    tensor: torch.Tensor,
    root: int,
) -> None:
    """`root` receives every rank's `tensor` into `outputs` (rank order); others get nothing.

    Runs as one all-gather. Wire: up N, down W·N on every rank (a native
    gather sends W·N down to the root only).
    """
    parts = collectives.all_gather(tensor)
    if len(parts) != collectives.world_size:
        raise RuntimeError(
            f"gather: {len(parts)} ranks contributed, the group has {collectives.world_size}"
        )
    if collectives.rank == root:
        for output, part in zip(outputs, parts, strict=True):
            write_into(output, part)


def scatter_by_broadcast(
    collectives: Collectives,
    output: torch.Tensor,
    parts: Sequence[torch.Tensor],
    root: int,
) -> None:
    """Every rank receives `root`'s `parts[its rank]` into `output`.

    Runs as one broadcast of all W parts. Wire: the root uploads W·N, every
    rank receives W·N (a native scatter sends each rank only its N).
    """
    world = collectives.world_size
    if collectives.rank == root:
        received = list(parts)
    else:
        received = [torch.empty(output.shape, dtype=output.dtype) for _ in range(world)]
    collectives.broadcast_tensors(received, root)
    write_into(output, received[collectives.rank].detach().to("cpu"))


def all_to_all_by_all_gather(
    collectives: Collectives,
    outputs: Sequence[torch.Tensor],
    inputs: Sequence[torch.Tensor],
    what: str,
) -> None:
    """Rank r's `inputs[d]` lands in rank d's `outputs[r]`; parts may differ in size.

    Runs as two all-gathers: every rank's part sizes (W int64 each), then every
    rank's inputs, padded to the largest rank's total; each rank keeps the
    parts addressed to it. A part whose size is not what its receiver expects
    fails on every rank, naming both ranks and both sizes.
    Wire: up W·N', down W·W·N' per rank, with N' the largest part (a native
    all-to-all moves W·N each way).
    """
    world, rank = collectives.world_size, collectives.rank
    # Each rank says what it sends and what it expects, so every rank checks every pair.
    counts = [t.numel() for t in inputs] + [t.numel() for t in outputs]
    table = torch.stack(collectives.all_gather(torch.tensor(counts, dtype=torch.int64)))
    if table.shape[0] != world:
        raise RuntimeError(f"{what}: {table.shape[0]} ranks contributed, the group has {world}")
    sizes, expects = table[:, :world], table[:, world:]  # sizes[src][dst], expects[dst][src]
    for src in range(world):
        for dst in range(world):
            if int(sizes[src][dst]) != int(expects[dst][src]):
                raise ValueError(
                    f"{what}: rank {src} sends {int(sizes[src][dst])} elements to rank {dst}, "
                    f"which expects {int(expects[dst][src])}"
                )
    longest = int(sizes.sum(dim=1).max())
    dtype = inputs[0].dtype if inputs else outputs[0].dtype
    flat = torch.zeros(longest, dtype=dtype)
    mine = flat_copy(inputs)
    flat[: mine.numel()] = mine
    rows = collectives.all_gather(flat)
    for src in range(world):
        start = int(sizes[src][:rank].sum())
        count = int(sizes[src][rank])
        write_into(outputs[src], rows[src][start : start + count])
