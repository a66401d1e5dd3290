"""`ProcessGroupGradsync`: a c10d process group whose collectives run through the coordinator.

c10d calls these methods for `dist.all_reduce`, `dist.broadcast`, ... and
DDP's reducer calls `allreduce` for every gradient bucket. Each method
checks its arguments on the caller's thread (a bad call raises there, as with
gloo), then hands the network part to the group's `OpQueue` and returns a
`Work` at once. An all-reduce of a CPU tensor is issued right there (its
input queued on the stream, no copy) and up to `MAX_IN_FLIGHT` are in flight
together; the other ops run in turn on the queue's threads through the
group's `Collectives`. Results are written into the caller's tensors.

All-reduce (SUM, AVG, MIN, MAX, and PREMUL_SUM as a scaled SUM), broadcast,
all-gather and barrier are the coordinator's own collectives: every rank's
call is checked against the others' (op, dtype, size, root) and a mismatch
fails every rank naming both values. Reduce-scatter, gather, scatter and
all-to-all are the hub's too, each rank receiving only its part; reduce is an
all-reduce only the root keeps (docs/backend.md says what each op costs on the
wire). The bitwise reductions are refused, and so are send and recv: the
coordinator is a hub, not a point-to-point relay. Same-host ranks sum
all-reduces in shared memory first (`gradsync.distributed.host_group`); a
16-bit wire (`gradsync.distributed.wire`) halves the bytes of summing
reductions of float32. Tensors may live on the CPU or a CUDA device (staged
through host memory on the network thread).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from gradsync.distributed.group_session import GroupSession
from gradsync.distributed.host_group import HostGroup
from gradsync.distributed.op_trace import OpTrace
from gradsync.distributed.shard_routes import (
    all_gather,
    flat_copy,
    reduce_scatter_parts,
    start_all_reduce,
    write_into,
)
from gradsync.distributed.wire import on_wire, wire_for
from gradsync.distributed.work import Finish, OpQueue, OpResult
from gradsync.path.signature import WIRE_DTYPES

__all__ = ["BACKEND_NAME", "ProcessGroupGradsync"]

#: The name c10d knows the backend by.
BACKEND_NAME = "gradsync"
# torch's stubs describe c10d's Python-facing overloads, not the methods its C++
# trampoline calls on a Python subclass (`allreduce(tensors, opts) -> Work`, ...): the
# base class is taken untyped, here only.
_ProcessGroup: Any = dist.ProcessGroup
#: Collectives of one group issued and not yet completed, at most (the coordinator
#: holds up to 16 of a job open; a rank never has more outstanding than that).
MAX_IN_FLIGHT = 8
#: How long shutting a group down waits for its queued operations (at exit, too).
SHUTDOWN_WAIT_S = 10.0

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


class ProcessGroupGradsync(_ProcessGroup):  # type: ignore[misc]  # (untyped base: above)
    """One c10d group (the default group, a `new_group`, a mesh dimension) on the coordinator.

    Built by the backend's factory (`gradsync.distributed.backend`), not by users.

    Args:
        session: the group's joined collectives-only session.
        group_name: c10d's name of the group (named in errors).
        wire_dtype: the 16-bit type summing reductions of float32 travel in
            (`gradsync.distributed.wire`), or None.
        host: this rank's host group, or None (every all-reduce flat).
        trace: records each operation's phases (`gradsync.distributed.op_trace`), or None.
    """

    def __init__(
        self,
        session: GroupSession,
        group_name: str,
        wire_dtype: torch.dtype | None = None,
        host: HostGroup | None = None,
        trace: OpTrace | None = None,
    ) -> None:
        super().__init__(session.rank, session.world_size)
        #: The group's trace, or None.
        self.trace = trace
        self._session = session
        #: The 16-bit type summing reductions of float32 travel in, or None.
        self.wire_dtype = wire_dtype
        #: This rank's host group (all-reduces summed in shared memory first), or None.
        self.host = host
        self._collectives = session.collectives
        #: The name and description c10d gives the group (`_set_group_name`, ...).
        self._c10d_name, self._c10d_desc = group_name, "undefined"
        describe = f"rank {session.rank} of group '{group_name}' (job '{session.job_id}')"
        thread_name = f"gradsync-pg-{group_name}-r{session.rank}"[:50]
        timeout_s = self._collectives.timeout_s
        self._ops = OpQueue(describe, thread_name, MAX_IN_FLIGHT, timeout_s, trace)

    # ------------------------------------------------------------ identity
    def getBackendName(self) -> str:
        return BACKEND_NAME

    name = getBackendName

    # c10d names a group through these; a Python process group holds no C++ backend to
    # keep the name in, so it keeps it itself (DeviceMesh looks groups up by name).
    def setGroupName(self, group_name: str) -> None:
        self._c10d_name = group_name

    def getGroupName(self) -> str:
        return self._c10d_name

    def setGroupDesc(self, group_desc: str) -> None:
        self._c10d_desc = group_desc

    def getGroupDesc(self) -> str:
        return self._c10d_desc

    @property
    def job_id(self) -> str:
        """The group's job on the coordinator."""
        return self._session.job_id

    @property
    def operations_completed(self) -> int:
        """Operations this group completed or failed so far."""
        return self._ops.completed

    @property
    def reconnects(self) -> int:
        """Coordinator restarts this group survived (it rejoined and sent its collectives
        in flight again)."""
        return self._session.resuming.reconnects

    @property
    def collectives_resent(self) -> int:
        """Collectives this group sent again after coordinator restarts."""
        return self._session.resuming.resent

    def shutdown(self) -> None:
        """Let queued operations finish (for up to `SHUTDOWN_WAIT_S`), then leave the job;
        an operation still waiting for other ranks then fails. Idempotent."""
        self._ops.close(min(SHUTDOWN_WAIT_S, self._collectives.timeout_s))
        if self.host is not None:
            self.host.close()
        self._session.close()
        if self.trace is not None:
            self.trace.close()

    abort = shutdown

    # ------------------------------------------------------------ the coordinator's own ops
    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        tensor = self._one(tensors, "allreduce")
        op, factor = reduce_op(op_of(opts), tensor.dtype, "allreduce")
        check_dtype(tensor, "allreduce", reducing=True)
        cpu = tensor.device.type == "cpu"
        wire = wire_for(self.wire_dtype, tensor.dtype, op)
        host = self.host
        start: Callable[[torch.Tensor, str, Callable[[], None]], Callable[[], int]]
        if host is not None and wire is None and host.takes(tensor, op):
            # Through this rank's host group (`gradsync.distributed.host_group`).
            name = f"allreduce({op}, {describe(tensor)}, host group {host.members})"
            start, inline = host.start, cpu
        else:
            name = f"allreduce({op}, {describe(tensor)}{on_wire(wire)})"
            routes = self._session.shard_routes
            start = functools.partial(start_all_reduce, routes, self._collectives)
            inline = cpu and self._collectives.can_issue

        def issue(ready: Callable[[], None]) -> Finish:
            if factor is not None:
                with torch.no_grad():
                    tensor.mul_(factor)
            sent = tensor if wire is None else tensor.detach().to(wire)
            finish = start(sent, op, ready)

            def done() -> OpResult:
                self._check_contributors(finish())
                if sent is not tensor:
                    write_into(tensor, sent)
                return tensors

            return done

        return self._ops.submit(name, issue=issue, inline=inline, tells=cpu)

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        if not tensors:
            return self._submit("allreduce_coalesced([])", lambda: None, tensors)
        dtypes = {t.dtype for t in tensors}
        if len(dtypes) != 1:
            raise ValueError(f"allreduce_coalesced needs tensors of one dtype, got {dtypes}")
        op, factor = reduce_op(op_of(opts), tensors[0].dtype, "allreduce_coalesced")
        for tensor in tensors:
            check_dtype(tensor, "allreduce_coalesced", reducing=True)
        wire = wire_for(self.wire_dtype, tensors[0].dtype, op)

        def run() -> None:
            flat = flat_copy(tensors)  # one collective for all of them
            if factor is not None:
                flat.mul_(factor)
            if wire is None:
                self._collectives.all_reduce(flat, op)
            else:
                flat = self._collectives.all_reduce(flat.to(wire), op).to(flat.dtype)
            write_flat(tensors, flat)

        name = f"allreduce_coalesced({op}, {len(tensors)} tensors{on_wire(wire)})"
        return self._submit(name, run, tensors)

    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        root = self._root(getattr(opts, "rootRank", 0), "broadcast")
        if getattr(opts, "rootTensor", 0) != 0:
            raise ValueError("broadcast: rootTensor must be 0 (one tensor list per rank)")
        for tensor in tensors:
            check_dtype(tensor, "broadcast", reducing=False)

        name = f"broadcast(root {root}, {len(tensors)} tensors)"
        return self._submit(
            name, lambda: self._collectives.broadcast_tensors(tensors, root), tensors
        )

    def allgather(
        self,
        output_tensors: list[list[torch.Tensor]],
        input_tensors: list[torch.Tensor],
        opts: Any = None,
    ) -> Any:
        tensor = self._one(input_tensors, "allgather")
        outputs = self._only_list(output_tensors, tensor, "allgather", "output")

        run = functools.partial(self._gather_into, outputs, tensor, "allgather")
        return self._submit(f"allgather({describe(tensor)})", run, outputs)

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> Any:
        check_dtype(input, "all_gather_into_tensor", reducing=False)
        self._check_stacked(output, input, "all_gather_into_tensor")

        run = functools.partial(self._gather_stacked, output, input, "all_gather_into_tensor")
        return self._submit(f"all_gather_into_tensor({describe(input)})", run, [output])

    _allgather_base = all_gather_single

    def allgather_coalesced(
        self,
        output_lists: list[list[torch.Tensor]],
        input_list: list[torch.Tensor],
        opts: Any = None,
    ) -> Any:
        if len(output_lists) != len(input_list):
            raise ValueError(
                f"allgather_coalesced: {len(output_lists)} output lists "
                f"for {len(input_list)} inputs"
            )
        pairs = [
            (self._per_rank(outputs, tensor, "allgather_coalesced"), tensor)
            for outputs, tensor in zip(output_lists, input_list, strict=True)
        ]

        def run() -> None:
            for outputs, tensor in pairs:
                self._gather_into(outputs, tensor, "allgather_coalesced")

        result = [t for outputs, _ in pairs for t in outputs]
        return self._submit(f"allgather_coalesced({len(pairs)} tensors)", run, result)

    def all_gather_single_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> Any:
        self._same_count(outputs, inputs, "all_gather_into_tensor_coalesced")
        for output, tensor in zip(outputs, inputs, strict=True):
            check_dtype(tensor, "all_gather_into_tensor_coalesced", reducing=False)
            self._check_stacked(output, tensor, "all_gather_into_tensor_coalesced")

        def run() -> None:
            for output, tensor in zip(outputs, inputs, strict=True):
                self._gather_stacked(output, tensor, "all_gather_into_tensor_coalesced")

        name = f"all_gather_into_tensor_coalesced({len(inputs)} tensors)"
        return self._submit(name, run, outputs)

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    def barrier(self, opts: Any = None) -> Any:
        return self._submit("barrier", self._collectives.barrier, [])

    # ------------------------------------------------------------ the hub's per-rank ops
    def reduce_scatter(
        self,
        output_tensors: list[torch.Tensor],
        input_tensors: list[list[torch.Tensor]],
        opts: Any = None,
    ) -> Any:
        output = self._one(output_tensors, "reduce_scatter")
        parts = self._only_list(input_tensors, output, "reduce_scatter", "input")
        return self._reduce_scatter(output, parts, opts, "reduce_scatter", output_tensors)

    def reduce_scatter_single(
        self, output: torch.Tensor, input: torch.Tensor, opts: Any = None
    ) -> Any:
        self._check_stacked(input, output, "reduce_scatter_tensor")
        return self._reduce_scatter(
            output, chunks(input, self.size()), opts, "reduce_scatter_tensor", [output]
        )

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter_single_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> Any:
        self._same_count(outputs, inputs, "reduce_scatter_tensor_coalesced")
        op, factor = reduce_op(
            op_of(opts), inputs[0].dtype if inputs else torch.float32, "reduce_scatter"
        )
        for output, tensor in zip(outputs, inputs, strict=True):
            self._check_stacked(tensor, output, "reduce_scatter_tensor_coalesced")
            check_dtype(tensor, "reduce_scatter_tensor_coalesced", reducing=True)
        wires = [wire_for(self.wire_dtype, tensor.dtype, op) for tensor in inputs]
        jobs = [
            (output, chunks(tensor, self.size()), wire)
            for output, tensor, wire in zip(outputs, inputs, wires, strict=True)
        ]
        shown = on_wire(next((w for w in wires if w is not None), None))
        name = f"reduce_scatter_tensor_coalesced({len(inputs)} tensors{shown})"
        return self._submit_reduce_scatter(name, jobs, op, factor, outputs)

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    def _reduce_scatter(
        self,
        output: torch.Tensor,
        parts: list[torch.Tensor],
        opts: Any,
        what: str,
        result: list[torch.Tensor],
    ) -> Any:
        op, factor = reduce_op(op_of(opts), output.dtype, what)
        check_dtype(output, what, reducing=True)
        wire = wire_for(self.wire_dtype, output.dtype, op)
        name = f"{what}({op}, {describe(output)}{on_wire(wire)})"
        return self._submit_reduce_scatter(name, [(output, parts, wire)], op, factor, result)

    def _submit_reduce_scatter(
        self,
        name: str,
        jobs: list[tuple[torch.Tensor, list[torch.Tensor], torch.dtype | None]],
        op: str,
        factor: Any,
        result: list[torch.Tensor],
    ) -> Any:
        """Queue the reduce-scatter of each (output, per-rank parts, wire) of `jobs`."""

        def run() -> None:
            for output, parts, wire in jobs:
                scaled = [p * factor for p in parts] if factor is not None else parts
                routes = self._session.shard_routes
                reduce_scatter_parts(routes, self._collectives, output, scaled, op, wire)

        return self._submit(name, run, result)

    def reduce(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        tensor = self._one(tensors, "reduce")
        root = self._root(getattr(opts, "rootRank", 0), "reduce")
        op, factor = reduce_op(op_of(opts), tensor.dtype, "reduce")
        check_dtype(tensor, "reduce", reducing=True)

        def run() -> None:
            # One all-reduce of a copy that only the root keeps: up N, down N per rank.
            source = tensor * factor if factor is not None else tensor
            copy = source.detach().to("cpu", copy=True)
            self._collectives.all_reduce(copy, op)
            if self.rank() == root:
                write_into(tensor, copy)

        return self._submit(f"reduce({op}, root {root}, {describe(tensor)})", run, tensors)

    def gather(
        self,
        output_tensors: list[list[torch.Tensor]],
        input_tensors: list[torch.Tensor],
        opts: Any = None,
    ) -> Any:
        tensor = self._one(input_tensors, "gather")
        root = self._root(getattr(opts, "rootRank", 0), "gather")
        check_dtype(tensor, "gather", reducing=False)
        outputs = []
        if self.rank() == root:
            outputs = self._only_list(output_tensors, tensor, "gather", "output", " on the root")

        def run() -> None:
            parts = self._collectives.gather(tensor, root)
            if parts is not None:
                write_parts(outputs, parts)

        return self._submit(f"gather(root {root}, {describe(tensor)})", run, outputs)

    def scatter(
        self,
        output_tensors: list[torch.Tensor],
        input_tensors: list[list[torch.Tensor]],
        opts: Any = None,
    ) -> Any:
        output = self._one(output_tensors, "scatter")
        root = self._root(getattr(opts, "rootRank", 0), "scatter")
        check_dtype(output, "scatter", reducing=False)
        parts = []
        if self.rank() == root:
            parts = self._only_list(input_tensors, output, "scatter", "input", " on the root")

        sent = parts if self.rank() == root else None
        run = functools.partial(self._collectives.scatter, output, sent, root)
        return self._submit(f"scatter(root {root}, {describe(output)})", run, output_tensors)

    def alltoall(
        self,
        output_tensors: list[torch.Tensor],
        input_tensors: list[torch.Tensor],
        opts: Any = None,
    ) -> Any:
        world = self.size()
        if len(output_tensors) != world or len(input_tensors) != world:
            raise ValueError(
                f"alltoall needs {world} input and output tensors, got "
                f"{len(input_tensors)} and {len(output_tensors)}"
            )
        self._same_dtype([*output_tensors, *input_tensors], "alltoall")

        run = functools.partial(self._all_to_all, output_tensors, input_tensors)
        return self._submit(f"alltoall({world} parts)", run, output_tensors)

    def all_to_all_single(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_split_sizes: list[int],
        input_split_sizes: list[int],
        opts: Any = None,
    ) -> Any:
        self._same_dtype([output, input], "all_to_all_single")
        outputs = split_rows(output, output_split_sizes, self.size(), "output")
        inputs = split_rows(input, input_split_sizes, self.size(), "input")

        run = functools.partial(self._all_to_all, outputs, inputs)
        return self._submit(f"all_to_all_single({describe(input)})", run, [output])

    alltoall_base = all_to_all_single

    # ------------------------------------------------------------ refused
    def send(self, tensors: list[torch.Tensor], dst: int, tag: int = 0) -> Any:
        raise RuntimeError(POINT_TO_POINT.format(what="send"))

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int = 0) -> Any:
        raise RuntimeError(POINT_TO_POINT.format(what="recv"))

    def recv_anysource(self, tensors: list[torch.Tensor], tag: int = 0) -> Any:
        raise RuntimeError(POINT_TO_POINT.format(what="recv"))

    # ------------------------------------------------------------ helpers
    def _submit(self, name: str, run: Callable[[], object], result: OpResult) -> Any:
        """Queue `run`, whose Work carries `result` (the tensors it writes into); that
        result stands only if every rank of the group took part.

        Under `--on-failure elastic` the coordinator completes a collective over the
        live ranks; a c10d group's size is fixed, so here that is a failure.
        """

        def checked() -> OpResult:
            run()
            self._check_contributors(self._collectives.last_contributors)
            return result

        return self._ops.submit(name, checked)

    def _check_contributors(self, contributors: int) -> None:
        if contributors and contributors != self.size():
            live = self._collectives.link.live_ranks() or ()
            lost = sorted(set(range(self.size())) - set(live)) if live else "some"
            raise RuntimeError(
                f"only {contributors} of the group's {self.size()} ranks took part "
                f"(the coordinator lost ranks {lost} and went on without them)"
            )

    def _one(self, tensors: Sequence[torch.Tensor], what: str) -> torch.Tensor:
        if len(tensors) != 1:
            raise ValueError(f"{what} takes exactly one tensor per rank, got {len(tensors)}")
        tensor = tensors[0]
        if not isinstance(tensor, torch.Tensor) or tensor.layout != torch.strided:
            raise ValueError(f"{what} needs a dense torch.Tensor, got {type(tensor).__name__}")
        return tensor

    def _root(self, root: int, what: str) -> int:
        if not 0 <= root < self.size():
            raise ValueError(
                f"{what}: root {root} is not a rank of the group (0..{self.size() - 1})"
            )
        return int(root)

    def _only_list(
        self,
        lists: Sequence[Sequence[torch.Tensor]],
        like: torch.Tensor,
        what: str,
        which: str,
        where: str = "",
    ) -> list[torch.Tensor]:
        """The one `which` list c10d passes, checked as `_per_rank`."""
        if len(lists) != 1:
            raise ValueError(f"{what} takes one {which} list{where}, got {len(lists)}")
        return self._per_rank(lists[0], like, what)

    def _per_rank(
        self, tensors: Sequence[torch.Tensor], like: torch.Tensor, what: str
    ) -> list[torch.Tensor]:
        """`tensors`, checked to be one per rank, each of `like`'s size and dtype."""
        if len(tensors) != self.size():
            raise ValueError(
                f"{what} needs {self.size()} tensors (one per rank), got {len(tensors)}"
            )
        for tensor in tensors:
            if tensor.numel() != like.numel() or tensor.dtype != like.dtype:
                raise ValueError(
                    f"{what}: every per-rank tensor must be {describe(like)}, "
                    f"got {describe(tensor)}"
                )
        check_dtype(like, what, reducing=False)
        return list(tensors)

    def _same_count(self, outputs: list[Any], inputs: list[Any], what: str) -> None:
        if len(outputs) != len(inputs):
            raise ValueError(f"{what}: {len(outputs)} outputs, {len(inputs)} inputs")

    def _check_stacked(self, big: torch.Tensor, small: torch.Tensor, what: str) -> None:
        if big.numel() != self.size() * small.numel() or big.dtype != small.dtype:
            raise ValueError(
                f"{what}: the large tensor must hold {self.size()} x {describe(small)}, "
                f"got {describe(big)}"
            )

    def _same_dtype(self, tensors: Sequence[torch.Tensor], what: str) -> None:
        dtypes = {t.dtype for t in tensors}
        if len(dtypes) != 1:
            raise ValueError(f"{what} needs tensors of one dtype, got {sorted(map(str, dtypes))}")
        for tensor in tensors:
            check_dtype(tensor, what, reducing=False)

    def _gather_into(
        self, outputs: Sequence[torch.Tensor], tensor: torch.Tensor, what: str
    ) -> None:
        parts = all_gather(self._session.shard_routes, self._collectives, tensor)
        if len(parts) != self.size():
            raise RuntimeError(
                f"{what}: {len(parts)} ranks contributed, the group has {self.size()}"
            )
        write_parts(outputs, parts)

    def _gather_stacked(self, output: torch.Tensor, tensor: torch.Tensor, what: str) -> None:
        """Every rank's `tensor` into `output`, one after another in rank order."""
        parts = output.view(self.size(), -1) if output.is_contiguous() else None
        targets = list(parts) if parts is not None else chunks(output, self.size())
        self._gather_into(targets, tensor, what)
        if parts is None:
            write_into(output, torch.cat([t.reshape(-1) for t in targets]))

    def _all_to_all(self, outputs: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor]) -> None:
        """Rank r's `inputs[d]` lands in rank d's `outputs[r]`; parts may differ in size (the
        hub checks that what rank r sends rank d is what rank d expects from it)."""
        dtype = inputs[0].dtype if inputs else outputs[0].dtype
        received = torch.empty(sum(t.numel() for t in outputs), dtype=dtype)
        self._collectives.all_to_all(
            received,
            flat_copy(inputs).to(dtype),
            output_splits=[t.numel() for t in outputs],
            input_splits=[t.numel() for t in inputs],
        )
        write_flat(outputs, received)

    def __repr__(self) -> str:
        return (
            f"ProcessGroupGradsync(rank={self.rank()}, size={self.size()}, "
            f"job={self._session.job_id!r}, coordinator={self._session.address!r})"
        )
