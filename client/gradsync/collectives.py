"""Collectives on user tensors through the coordinator: all_reduce, broadcast, all_gather,
barrier, reduce_scatter, gather, scatter, all_to_all.

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
part ("avg" divides by their number). Reductions accumulate in float32 (float64
for float64; float16 and bfloat16 inputs widen to float32 and narrow once) on
the coordinator, integers in int64, always in rank order once every input is
in: the result's bits do not depend on which rank arrived first.

What each op costs on the wire (N = bytes of one rank's full input, W ranks;
the coordinator is a hub, so every byte goes up to it and back once)::

    op              each rank sends   each rank receives   hub link, in / out
    all_reduce      N                 N                    W*N / W*N
    reduce_scatter  N                 N/W                  W*N / N
    all_gather      N                 W*N                  W*N / W*W*N
    gather          N                 W*N (root), 0        W*N / W*N
    scatter         W*N (root), 0     N                    W*N / W*N
    all_to_all      N                 N                    W*N / W*N
    broadcast       N (root), 0       N                    N / W*N

Against gloo's ring, per rank and each way: all_reduce 2(W-1)/W*N,
reduce_scatter (W-1)/W*N, all_gather (W-1)*N, pairwise all_to_all
(W-1)/W*N. So a rank's own link carries about what it carries in a ring
(reduce_scatter: N up and N/W down, against (W-1)/W*N up and down), while the
hub's link carries the sum over the ranks: the hub wins on latency (one round
trip instead of W-1 steps), not on the hub's bandwidth.

`Collectives` is the object behind these functions: the wrapper builds one as
`model.collectives`, and its own buffer broadcasts, SyncBatchNorm and join()
use it too. Tensors may live on any device (they are staged through host
memory) and have any float or integer dtype; bool tensors can be broadcast
and gathered but not reduced.
"""

from __future__ import annotations

import math
import time
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
    "product": pb.COLLECTIVE_OP_PRODUCT,
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
            op: "sum", "avg", "min", "max" or "product" (torch.distributed.ReduceOp
                values work too); "avg" needs a floating dtype.

        Raises:
            ValueError: an unknown op, or a dtype the op cannot reduce.
            GradSyncError: the collective failed (see `SessionLink.run_collective`).
        """
        wire_op = _reduce_op(op)
        _check_reducible(tensor, wire_op, "all_reduce")
        _write_back(tensor, self._run(wire_op, tensor.dtype, _bytes_of(tensor), root=0))
        return tensor

    @property
    def can_issue(self) -> bool:
        """True when the link can have several collectives in flight (`start_all_reduce`
        then never blocks); False for a link that only runs a collective whole."""
        return hasattr(self.link, "issue_collective")

    def start_all_reduce(
        self,
        tensor: torch.Tensor,
        op: Any = "sum",
        on_ready: Callable[[], None] | None = None,
    ) -> Callable[[], int]:
        """Issue an all_reduce of `tensor` now; return `finish`, which blocks (until
        `timeout_s` after the issue) for the result, writes it into `tensor` in place and
        returns how many ranks contributed.

        The input is sent from `tensor`'s own memory when it is a contiguous CPU
        tensor, so it must not change until `finish` returned. Several may be in
        flight; their `finish`es must be called in issue order. Without `can_issue`
        the whole collective runs here and `finish` only writes the result back.
        `on_ready` is told once `finish` would not block: on the link's reading thread
        (or here, when the collective ran whole); it must not block.

        Raises:
            ValueError: as `all_reduce`.
            GradSyncError: the collective could not be issued (or, without `can_issue`,
                failed).
        """
        wire_op = _reduce_op(op)
        _check_reducible(tensor, wire_op, "all_reduce")
        payload = _bytes_of(tensor)
        link = self.link
        issue = getattr(link, "issue_collective", None)
        if issue is None:
            data, contributors = link.run_collective(
                wire_op, WIRE_DTYPES[tensor.dtype], payload, 0, self.timeout_s
            )

            def written() -> int:
                _write_back(tensor, memoryview(data))
                return contributors

            if on_ready is not None:
                on_ready()
            return written
        deadline = time.monotonic() + self.timeout_s
        sequence = issue(wire_op, WIRE_DTYPES[tensor.dtype], payload, 0, on_ready=on_ready)
        wait = link.wait_collective  # type: ignore[attr-defined]

        def finish() -> int:
            result, count = wait(sequence, max(0.0, deadline - time.monotonic()))
            _write_back(tensor, memoryview(result))
            return int(count)

        return finish

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
        sizes = [_nbytes(t) for t in tensors]
        payload = _packed(tensors if self.rank == src or every_rank_sends else [])
        result = self._run(
            pb.COLLECTIVE_OP_BROADCAST, torch.uint8, payload, root=src, result_bytes=sum(sizes)
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
        result = self._run(pb.COLLECTIVE_OP_ALL_GATHER, tensor.dtype, _bytes_of(tensor), root=0)
        return _unpacked_parts(tensor, result, self.last_contributors)

    def barrier(self) -> None:
        """Return once every contributing rank has reached this barrier.

        Raises:
            GradSyncError: the collective failed or timed out.
        """
        self._run(pb.COLLECTIVE_OP_BARRIER, torch.uint8, np.empty(0, np.uint8), root=0)

    def reduce_scatter(
        self, output: torch.Tensor, input: torch.Tensor, op: Any = "sum"
    ) -> torch.Tensor:
        """Reduce `input` element-wise over the ranks; keep this rank's part in `output`.

        `input` is read flat: world_size * n elements, where n is
        `output.numel()`; rank r receives reduced elements [r*n, (r+1)*n). Every
        rank must pass the same sizes, dtype and op. Needs every rank of the job
        (not inside join() while a rank has run out of inputs).

        On the wire each rank sends its whole input (N bytes) and receives only
        its part (N/W); the coordinator receives W*N and sends N in all. A ring
        reduce-scatter sends and receives (W-1)/W*N per rank, over W-1 steps.

        Args:
            output: n elements of `input`'s dtype; written in place and returned.
            input: world_size * n elements, any shape (read in row-major order).
            op: as for `all_reduce`.

        Raises:
            ValueError: sizes or dtypes that do not fit, an unknown op.
            GradSyncError: the collective failed (e.g. another rank disagreed).
        """
        wire_op = _reduce_op(op)
        _check(output, "reduce_scatter")
        _check_reducible(input, wire_op, "reduce_scatter")
        _check_same_dtype(output, input, "reduce_scatter")
        if input.numel() != self.world_size * output.numel():
            raise ValueError(
                f"reduce_scatter needs an input of world_size * output.numel() = "
                f"{self.world_size} * {output.numel()} elements, got {input.numel()}"
            )
        template = pb.CollectiveChunk(reduce_op=wire_op)  # type: ignore[arg-type]
        return self._run_into(pb.COLLECTIVE_OP_REDUCE_SCATTER, output, input, template)

    def gather(self, tensor: torch.Tensor, dst: int) -> list[torch.Tensor] | None:
        """Every rank's `tensor` at rank `dst` only, in rank order (new tensors).

        Every rank must pass the same shape and dtype; only `dst` receives the
        parts (each rank sends N bytes, `dst` receives W*N, the others an
        empty answer). Needs every rank of the job.

        Returns:
            On `dst`, world_size tensors like `tensor`; None on the other ranks.

        Raises:
            ValueError: `dst` is not a rank of the job, or an unsupported dtype.
            GradSyncError: the collective failed.
        """
        self._check_src(dst)
        _check(tensor, "gather")
        size = _nbytes(tensor)
        result = self._run(
            pb.COLLECTIVE_OP_GATHER,
            tensor.dtype,
            _bytes_of(tensor),
            root=dst,
            result_bytes=size * self.world_size if self.rank == dst else 0,
        )
        return _unpacked_parts(tensor, result, self.world_size) if self.rank == dst else None

    def scatter(
        self, output: torch.Tensor, inputs: Sequence[torch.Tensor] | None, src: int
    ) -> torch.Tensor:
        """Rank `src`'s `inputs[r]` into `output` on each rank r, in place; return `output`.

        Only `src` passes `inputs` (world_size tensors shaped like `output`); the
        others pass None. `src` sends W*N bytes, every rank receives its N.
        Needs every rank of the job.

        Raises:
            ValueError: `src` is not a rank, `inputs` missing on `src` or of the
                wrong number, shape or dtype.
            GradSyncError: the collective failed.
        """
        self._check_src(src)
        _check(output, "scatter")
        if self.rank == src:
            if inputs is None or len(inputs) != self.world_size:
                count = "None" if inputs is None else str(len(inputs))
                raise ValueError(
                    f"scatter's source rank {src} must pass {self.world_size} inputs "
                    f"(one per rank), got {count}"
                )
            for part in inputs:
                _check(part, "scatter")
                if part.shape != output.shape or part.dtype != output.dtype:
                    raise ValueError(
                        f"scatter's inputs must each match the output ({tuple(output.shape)}, "
                        f"{output.dtype}), got {tuple(part.shape)} {part.dtype}"
                    )
        payload = _packed(inputs if self.rank == src and inputs is not None else [])
        result = self._run(
            pb.COLLECTIVE_OP_SCATTER, output.dtype, payload, root=src, result_bytes=_nbytes(output)
        )
        _write_back(output, result)
        return output

    def all_to_all(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_splits: Sequence[int] | None = None,
        input_splits: Sequence[int] | None = None,
    ) -> torch.Tensor:
        """Send part r of `input` to rank r; receive every rank's part for this rank.

        As torch's `all_to_all_single`: the parts are slices of dimension 0,
        `input_splits[r]` rows to rank r and `output_splits[j]` rows from rank j
        (None: world_size equal parts). The split sizes travel with the input
        and the coordinator checks that what rank j sends to rank r is what
        rank r expects from it. Each rank sends N bytes and receives its N; a
        pairwise exchange would send and receive (W-1)/W*N. Needs every rank.

        Raises:
            ValueError: splits that do not add up to dimension 0, or dtypes or
                row shapes that differ between `output` and `input`.
            GradSyncError: the collective failed (e.g. splits disagree across ranks).
        """
        for tensor in (output, input):
            _check(tensor, "all_to_all")
        _check_same_dtype(output, input, "all_to_all")
        if output.dim() == 0 or input.dim() == 0 or output.shape[1:] != input.shape[1:]:
            raise ValueError(
                f"all_to_all needs output and input with the same row shape, got "
                f"{tuple(output.shape)} and {tuple(input.shape)}"
            )
        row = math.prod(input.shape[1:]) * input.element_size()  # bytes of one row
        send = self._splits(input, input_splits, "input")
        receive = self._splits(output, output_splits, "output")
        template = pb.CollectiveChunk(
            send_splits=[rows * row for rows in send],
            receive_splits=[rows * row for rows in receive],
        )
        return self._run_into(pb.COLLECTIVE_OP_ALL_TO_ALL, output, input, template)

    # ------------------------------------------------------------ helpers
    def _splits(self, tensor: torch.Tensor, splits: Sequence[int] | None, what: str) -> list[int]:
        """Rows per rank of `tensor`'s dimension 0 (equal parts when `splits` is None)."""
        rows = tensor.shape[0]
        if splits is None:
            if rows % self.world_size:
                raise ValueError(
                    f"all_to_all's {what} has {rows} rows, not divisible into "
                    f"{self.world_size} equal parts: pass {what}_splits"
                )
            return [rows // self.world_size] * self.world_size
        parts = [int(size) for size in splits]
        if len(parts) != self.world_size or min(parts) < 0 or sum(parts) != rows:
            raise ValueError(
                f"all_to_all's {what}_splits {parts} must be {self.world_size} sizes "
                f"(one per rank, none negative) adding up to its {rows} rows"
            )
        return parts

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
        template: pb.CollectiveChunk | None = None,
    ) -> memoryview:
        data, contributors = self.link.run_collective(
            op,
            WIRE_DTYPES[dtype],
            payload,
            root,
            self.timeout_s,
            result_bytes=result_bytes,
            template=template,
        )
        self.last_contributors = contributors
        return memoryview(data)

    def _run_into(
        self, op: int, output: torch.Tensor, input: torch.Tensor, template: pb.CollectiveChunk
    ) -> torch.Tensor:
        """Run `op` on `input` with `template`; write the result into `output`, return it."""
        result = self._run(
            op,
            input.dtype,
            _bytes_of(input),
            root=0,
            result_bytes=_nbytes(output),
            template=template,
        )
        _write_back(output, result)
        return output


def _reduce_op(op: Any) -> int:
    """The CollectiveOp of "sum"/"avg"/"min"/"max"/"product" (or a torch.distributed.ReduceOp)."""
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


def _check_reducible(tensor: torch.Tensor, wire_op: int, what: str) -> None:
    _check(tensor, what)
    if tensor.dtype == torch.bool:
        raise ValueError(f"{what} cannot reduce bool tensors; convert them to int first")
    if wire_op == pb.COLLECTIVE_OP_AVG and tensor.dtype not in _FLOATING:
        raise ValueError(
            f"{what} op 'avg' needs a floating tensor, got {tensor.dtype}; use 'sum' and divide"
        )


def _check_same_dtype(output: torch.Tensor, input: torch.Tensor, what: str) -> None:
    if output.dtype != input.dtype:
        raise ValueError(
            f"{what} needs output and input of one dtype, got {output.dtype} and {input.dtype}"
        )


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _unpacked_parts(like: torch.Tensor, raw: memoryview, count: int) -> list[torch.Tensor]:
    """`count` new tensors shaped like `like` (on its device), `raw`'s values in order."""
    size = _nbytes(like)
    parts = []
    for index in range(count):
        part = torch.empty_like(like, memory_format=torch.contiguous_format)
        _write_back(part, raw[index * size : (index + 1) * size])
        parts.append(part)
    return parts


def _host(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor`'s values as a contiguous CPU tensor (itself when it already is one)."""
    return tensor.detach().to("cpu", memory_format=torch.contiguous_format)


def _bytes_of(tensor: torch.Tensor) -> np.ndarray[Any, np.dtype[np.uint8]]:
    """The raw bytes of `tensor`'s values (without a copy of a contiguous CPU tensor)."""
    if tensor.numel() == 0:
        return np.empty(0, np.uint8)
    host = _host(tensor)
    array: np.ndarray[Any, np.dtype[np.uint8]] = host.reshape(-1).view(torch.uint8).numpy()
    return array


def _packed(tensors: Sequence[torch.Tensor]) -> np.ndarray[Any, np.dtype[np.uint8]]:
    """The raw bytes of every tensor of `tensors`, one after the other."""
    pieces = [_bytes_of(t) for t in tensors if t.numel()]
    return np.concatenate(pieces) if pieces else np.empty(0, np.uint8)


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
