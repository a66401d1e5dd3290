"""Collectives on user tensors through the coordinator: all_reduce, broadcast, all_gather, barrier.

A DDP training script uses `torch.distributed` for more than gradients: it
sums a metric over ranks, broadcasts a seed from rank 0, gathers small
tensors, waits at a barrier. With gradsync there is no process group, so
these go through the coordinator on the stream the job already has::

    from gradsync import collectives
    model = gradsync.DistributedDataParallel(net, ...)
    collectives.all_reduce(loss_sum, op="sum", group=model)   # in place
    collectives.broadcast(seed, src=0, group=model)            # in place
    parts = collectives.all_gather(local_stats, group=model)   # list, rank order
    collectives.barrier(group=model)

As with torch.distributed, every rank must issue the same collectives in the
same order (the coordinator pairs them by sequence number and refuses
mismatched ops, dtypes or sizes naming the rank and both values); results are
written in place; every wait is bounded by the wrapper's sync timeout. While
some ranks have run out of inputs inside `model.join()`, only the others take
part ("avg" divides by their number). SUM and AVG accumulate in float32 (float64
for float64) on the coordinator, integers in int64.

`Collectives` is the object behind these functions: the wrapper builds one as
`model.collectives`, and its own buffer broadcasts, SyncBatchNorm and join()
use it too. Tensors may live on any device (they are staged through host
memory) and have any float or integer dtype; bool tensors can be broadcast
and gathered but not reduced.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from gradsync_proto.v1 import gradsync_pb2 as pb

from gradsync.control.link import SessionLink
from gradsync.path.signature import WIRE_DTYPES

__all__ = ["Collectives", "all_gather", "all_reduce", "barrier", "broadcast"]

_REDUCE_OPS = {
    "sum": pb.COLLECTIVE_OP_SUM,
    "avg": pb.COLLECTIVE_OP_AVG,
    "min": pb.COLLECTIVE_OP_MIN,
    "max": pb.COLLECTIVE_OP_MAX,
}
_FLOATING = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


class Collectives:
    """Collectives of one rank of a job, over its current link to the coordinator.

    Args:
        link_getter: returns the current link (a reconnect replaces it).
        rank: this rank.
        world_size: the job's size.
        timeout_s: bound on each wait for a result.
    """

    def __init__(
        self,
        link_getter: Callable[[], SessionLink],
        rank: int,
        world_size: int,
        timeout_s: float,
    ) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is out of range for world size {world_size}")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        self._link_getter = link_getter
        self.rank = rank
        self.world_size = world_size
        self.timeout_s = timeout_s
        #: How many ranks contributed to the latest collective.
        self.last_contributors = 0

    @property
    def link(self) -> SessionLink:
        """The current link to the coordinator."""
        return self._link_getter()

    def all_reduce(self, tensor: torch.Tensor, op: Any = "sum") -> torch.Tensor:
        """Reduce `tensor` element-wise over the ranks, in place; return it.

        Args:
            tensor: a float or integer tensor, the same shape and dtype on every rank.
            op: "sum", "avg", "min" or "max" (torch.distributed.ReduceOp values work
                too); "avg" needs a floating dtype.

        Raises:
            ValueError: an unknown op, or a dtype the op cannot reduce.
            GradSyncError: the collective failed (see `SessionLink.run_collective`).
        """
        wire_op = _reduce_op(op)
        _check(tensor, "all_reduce")
        if tensor.dtype == torch.bool:
            raise ValueError("all_reduce cannot reduce bool tensors; convert them to int first")
        if wire_op == pb.COLLECTIVE_OP_AVG and tensor.dtype not in _FLOATING:
            raise ValueError(
                f"all_reduce op 'avg' needs a floating tensor, got {tensor.dtype}; "
                "use 'sum' and divide"
            )
        host = _host(tensor)
        result = self._run(wire_op, tensor.dtype, _bytes_of(host), root=0)
        _write_back(tensor, result)
        return tensor

    def broadcast(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        """Overwrite `tensor` on every rank with rank `src`'s, in place; return it.

        Raises:
            ValueError: `src` is not a rank of the job, or an unsupported dtype.
            GradSyncError: the collective failed.
        """
        self._check_src(src)
        _check(tensor, "broadcast")
        self.broadcast_tensors([tensor], src)
        return tensor

    def broadcast_tensors(
        self, tensors: Sequence[torch.Tensor], src: int, *, every_rank_sends: bool = False
    ) -> None:
        """Overwrite every tensor of `tensors` with rank `src`'s, in one collective.

        The tensors' bytes travel packed as one blob (what the wrapper does
        for buffers before a forward pass, and join() for the whole model), so
        a model with a hundred buffers costs one round trip, not a hundred.
        Every rank must pass tensors of the same shapes and dtypes, in order.

        With `every_rank_sends`, every rank uploads its own bytes, not only
        `src`: if `src` is lost (elastic policy) or has run out of inputs, the
        coordinator hands out the lowest participating rank's bytes instead,
        so the broadcast still completes. Worth it for small tensors (buffers).

        Raises:
            ValueError: `src` is not a rank of the job, or an unsupported dtype.
            GradSyncError: the collective failed.
        """
        self._check_src(src)
        for tensor in tensors:
            _check(tensor, "broadcast")
        sizes = [t.numel() * t.element_size() for t in tensors]
        total = sum(sizes)
        if self.rank == src or every_rank_sends:
            pieces = [_bytes_of(_host(t)) for t in tensors if t.numel()]
            payload = np.concatenate(pieces) if pieces else np.empty(0, np.uint8)
        else:
            payload = np.empty(0, np.uint8)
        result = self._run(
            pb.COLLECTIVE_OP_BROADCAST, torch.uint8, payload, root=src, result_bytes=total
        )
        if self.rank == src:
            return  # the root's tensors already hold the result
        offset = 0
        for tensor, size in zip(tensors, sizes, strict=True):
            _write_back(tensor, result[offset : offset + size])
            offset += size

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Every contributing rank's `tensor`, in rank order (new tensors, on its device).

        Every rank must pass the same shape and dtype. While some ranks are
        inside join() having run out of inputs, only the others' tensors are
        returned (the list is shorter than the world size).

        Raises:
            ValueError: an unsupported dtype.
            GradSyncError: the collective failed.
        """
        _check(tensor, "all_gather")
        host = _host(tensor)
        result = self._run(pb.COLLECTIVE_OP_ALL_GATHER, tensor.dtype, _bytes_of(host), root=0)
        size = tensor.numel() * tensor.element_size()
        parts = []
        for index in range(self.last_contributors):
            part = torch.empty_like(tensor, memory_format=torch.contiguous_format)
            _write_back(part, result[index * size : (index + 1) * size])
            parts.append(part)
        return parts

    def barrier(self) -> None:
        """Return once every contributing rank has reached this barrier.

        Raises:
            GradSyncError: the collective failed or timed out.
        """
        self._run(pb.COLLECTIVE_OP_BARRIER, torch.uint8, np.empty(0, np.uint8), root=0)

    # ------------------------------------------------------------ helpers
    def _check_src(self, src: int) -> None:
        if isinstance(src, bool) or not isinstance(src, int) or not 0 <= src < self.world_size:
            raise ValueError(f"src must be a rank of the job (0..{self.world_size - 1}), got {src}")

    def _run(
        self,
        op: int,
        dtype: torch.dtype,
        payload: np.ndarray[Any, np.dtype[np.uint8]],
        root: int,
        result_bytes: int | None = None,
    ) -> memoryview:
        data, contributors = self.link.run_collective(
            op, WIRE_DTYPES[dtype], payload, root, self.timeout_s, result_bytes=result_bytes
        )
        self.last_contributors = contributors
        return memoryview(data)


def _reduce_op(op: Any) -> int:
    """The CollectiveOp of "sum"/"avg"/"min"/"max" (or a torch.distributed.ReduceOp)."""
    name = op if isinstance(op, str) else str(op).rsplit(".", 1)[-1]
    try:
        return _REDUCE_OPS[name.lower()]
    except KeyError:
        raise ValueError(
            f"unsupported reduce op {op!r}: use one of {sorted(_REDUCE_OPS)}"
        ) from None


def _check(tensor: torch.Tensor, what: str) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"{what} needs a torch.Tensor, got {type(tensor).__name__}")
    if tensor.layout != torch.strided:
        raise ValueError(f"{what} needs a dense tensor, got layout {tensor.layout}")
    if tensor.dtype not in WIRE_DTYPES:
        supported = ", ".join(str(d).removeprefix("torch.") for d in WIRE_DTYPES)
        raise ValueError(f"{what} does not support dtype {tensor.dtype} (supported: {supported})")


def _host(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor`'s values as a contiguous CPU tensor (itself when it already is one)."""
    return tensor.detach().to("cpu", memory_format=torch.contiguous_format)


def _bytes_of(host: torch.Tensor) -> np.ndarray[Any, np.dtype[np.uint8]]:
    """The raw bytes of a contiguous CPU tensor, without a copy."""
    if host.numel() == 0:
        return np.empty(0, np.uint8)
    array: np.ndarray[Any, np.dtype[np.uint8]] = host.reshape(-1).view(torch.uint8).numpy()
    return array


def _write_back(tensor: torch.Tensor, raw: memoryview) -> None:
    """Copy raw little-endian bytes of `tensor`'s dtype into `tensor`, in place."""
    if tensor.numel() == 0:
        return
    source = torch.frombuffer(raw, dtype=tensor.dtype, count=tensor.numel())
    with torch.no_grad():
        tensor.copy_(source.view(tensor.shape))


def _collectives_of(group: Any) -> Collectives:
    """The `Collectives` of a wrapper (its `.collectives`), or `group` itself."""
    if isinstance(group, Collectives):
        return group
    found = getattr(group, "collectives", None)
    if isinstance(found, Collectives):
        return found
    raise ValueError(
        "group must be a gradsync.DistributedDataParallel (or its .collectives), "
        f"got {type(group).__name__}"
    )


def all_reduce(tensor: torch.Tensor, op: Any = "sum", *, group: Any) -> torch.Tensor:
    """Reduce `tensor` over the ranks of `group` in place; see `Collectives.all_reduce`."""
    return _collectives_of(group).all_reduce(tensor, op)


def broadcast(tensor: torch.Tensor, src: int, *, group: Any) -> torch.Tensor:
    """Overwrite `tensor` with rank `src`'s in place; see `Collectives.broadcast`."""
    return _collectives_of(group).broadcast(tensor, src)


def all_gather(tensor: torch.Tensor, *, group: Any) -> list[torch.Tensor]:
    """Every rank's `tensor`, in rank order; see `Collectives.all_gather`."""
    return _collectives_of(group).all_gather(tensor)


def barrier(*, group: Any) -> None:
    """Wait until every rank of `group` arrives; see `Collectives.barrier`."""
    _collectives_of(group).barrier()
