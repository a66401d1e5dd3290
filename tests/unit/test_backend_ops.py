"""The "gradsync" process group's ops across W ranks in one process, against references.

Each rank is a thread whose `Collectives` run on `support.fakegroup.ThreadedGroup`
(what the coordinator computes, without sockets), so every op of
`ProcessGroupGradsync`, the composed ones with uneven sizes included, is
checked against a numpy reference; the checks made on the caller's thread, the
names the backend gives jobs, and what a Work does when its op fails.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
from gradsync.collectives import Collectives
from gradsync.distributed import ProcessGroupGradsync, group_job_id
from gradsync.distributed.store import parse_url
from support.fakegroup import GroupLink, ThreadedGroup

WORLD = 3


class StandInSession:
    """What a `ProcessGroupGradsync` reads of its `GroupSession`, over a ThreadedGroup."""

    def __init__(self, collectives: Collectives) -> None:
        self.collectives = collectives
        self.rank, self.world_size = collectives.rank, collectives.world_size
        self.job_id, self.address = "job.pg-world", "127.0.0.1:1"
        self.shard_routes = None  # an unsharded coordinator
        self.closed = False

    def close(self) -> None:
        self.closed = True


class ShrunkGroup(ThreadedGroup):
    """A ThreadedGroup whose links announce the live ranks, as after an elastic shrink."""

    def link(self, rank: int) -> GroupLink:
        link = super().link(rank)
        link.live_ranks = lambda: tuple(self.participants)  # type: ignore[attr-defined]
        return link


def across_ranks(body: Callable[[ProcessGroupGradsync, int], Any], world: int = WORLD) -> list[Any]:
    group = ThreadedGroup(world)

    def one(rank: int) -> Any:
        pg = ProcessGroupGradsync(StandInSession(group.collectives(rank)), "0")  # type: ignore[arg-type]
        try:
            return body(pg, rank)
        finally:
            pg.shutdown()

    return group.run(one)


def values(rank: int, *shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    count = int(np.prod(shape))
    return (torch.arange(count, dtype=torch.float64).reshape(shape) * (rank + 2) - rank).to(dtype)


def test_allreduce_ops_and_premul_sum() -> None:
    def body(pg: ProcessGroupGradsync, rank: int) -> dict[str, torch.Tensor]:
        out = {}
        for name, op in [
            ("sum", dist.ReduceOp.SUM),
            ("avg", dist.ReduceOp.AVG),
            ("min", dist.ReduceOp.MIN),
            ("max", dist.ReduceOp.MAX),
            ("premul", dist._make_nccl_premul_sum(0.25)),
        ]:
            tensor = values(rank, 2, 3)
            options = dist.AllreduceOptions()
            options.reduceOp = op
            pg.allreduce([tensor], options).wait()
            out[name] = tensor
        return out

    stack = torch.stack([values(r, 2, 3) for r in range(WORLD)])
    for result in across_ranks(body):
        torch.testing.assert_close(result["sum"], stack.sum(0))
        torch.testing.assert_close(result["avg"], stack.mean(0))
        torch.testing.assert_close(result["min"], stack.min(0).values)
        torch.testing.assert_close(result["max"], stack.max(0).values)
        torch.testing.assert_close(result["premul"], stack.sum(0) * 0.25)


def test_reduce_scatter_gather_scatter_and_reduce() -> None:
    def body(pg: ProcessGroupGradsync, rank: int) -> dict[str, Any]:
        part = torch.zeros(4)
        pg.reduce_scatter_single(part, values(rank, 4 * WORLD)).wait()
        listed = torch.zeros(2, 2)
        pg.reduce_scatter([listed], [[values(rank, 2, 2) + i for i in range(WORLD)]]).wait()
        gathered = [torch.zeros(3) for _ in range(WORLD)] if rank == 1 else []
        gather_options = dist.GatherOptions()
        gather_options.rootRank = 1
        pg.gather([gathered] if rank == 1 else [], [values(rank, 3)], gather_options).wait()
        scattered = torch.zeros(2)
        scatter_options = dist.ScatterOptions()
        scatter_options.rootRank = 2
        parts = [[values(10 + i, 2) for i in range(WORLD)]] if rank == 2 else []
        pg.scatter([scattered], parts, scatter_options).wait()
        reduced = values(rank, 3)
        reduce_options = dist.ReduceOptions()
        reduce_options.rootRank = 0
        pg.reduce([reduced], reduce_options).wait()
        return {
            "part": part,
            "listed": listed,
            "gathered": gathered,
            "scattered": scattered,
            "reduced": reduced,
        }

    results = across_ranks(body)
    total = sum(values(r, 4 * WORLD) for r in range(WORLD))
    for rank, result in enumerate(results):
        torch.testing.assert_close(result["part"], total[rank * 4 : (rank + 1) * 4])
        listed = sum(values(r, 2, 2) + rank for r in range(WORLD))
        torch.testing.assert_close(result["listed"], listed)
        torch.testing.assert_close(result["scattered"], values(10 + rank, 2))
        reference = sum(values(r, 3) for r in range(WORLD)) if rank == 0 else values(rank, 3)
        torch.testing.assert_close(result["reduced"], reference)
    torch.testing.assert_close(
        torch.stack(results[1]["gathered"]), torch.stack([values(r, 3) for r in range(WORLD)])
    )


def test_all_to_all_with_uneven_splits() -> None:
    # Rank r sends (r + d + 1) rows of width 2 to rank d.
    def sizes_from(src: int) -> list[int]:
        return [src + dst + 1 for dst in range(WORLD)]

    def body(pg: ProcessGroupGradsync, rank: int) -> torch.Tensor:
        sent = sizes_from(rank)
        source = torch.cat([torch.full((n, 2), 100.0 * rank + dst) for dst, n in enumerate(sent)])
        received = [src + rank + 1 for src in range(WORLD)]
        output = torch.zeros(sum(received), 2)
        pg.all_to_all_single(output, source, received, sent).wait()
        return output

    for rank, output in enumerate(across_ranks(body)):
        expected = torch.cat(
            [torch.full((src + rank + 1, 2), 100.0 * src + rank) for src in range(WORLD)]
        )
        torch.testing.assert_close(output, expected)


def test_all_to_all_size_disagreement_fails_every_rank_naming_both() -> None:
    def body(pg: ProcessGroupGradsync, rank: int) -> str:
        outputs = [torch.zeros(2) for _ in range(WORLD)]
        inputs = [torch.zeros(3 if rank == 0 else 2) for _ in range(WORLD)]  # rank 0 sends 3s
        with pytest.raises(dist.DistBackendError) as caught:
            pg.alltoall(outputs, inputs).wait()
        return str(caught.value)

    for rank, message in enumerate(across_ranks(body)):
        assert f"rank {rank} of group '0'" in message
        assert "rank 0 sends 12 bytes to rank 0, but rank 0 expects 8 bytes from it" in message


def test_allgather_broadcast_barrier_and_coalesced() -> None:
    def body(pg: ProcessGroupGradsync, rank: int) -> dict[str, Any]:
        gathered = [torch.zeros(2, dtype=torch.int64) for _ in range(WORLD)]
        pg.allgather([gathered], [values(rank, 2, dtype=torch.int64)]).wait()
        into = torch.zeros(WORLD, 2)
        pg.all_gather_single(into, values(rank, 2)).wait()
        strided = torch.zeros(2, WORLD).t()  # not contiguous: written back whole
        pg.all_gather_single(strided, values(rank, 2)).wait()
        sent = [values(rank, 2), values(rank, 3)]
        options = dist.BroadcastOptions()
        options.rootRank = 1
        pg.broadcast(sent, options).wait()
        coalesced = [values(rank, 2), values(rank, 1)]
        pg.allreduce_coalesced(coalesced, dist.AllreduceCoalescedOptions()).wait()
        pg.barrier(dist.BarrierOptions()).wait()
        return {
            "gathered": gathered,
            "into": into,
            "strided": strided,
            "sent": sent,
            "coalesced": coalesced,
        }

    rows = torch.stack([values(r, 2) for r in range(WORLD)])
    for result in across_ranks(body):
        torch.testing.assert_close(torch.stack(result["gathered"]), rows.long())
        torch.testing.assert_close(result["into"], rows)
        torch.testing.assert_close(result["strided"], rows)
        torch.testing.assert_close(result["sent"][1], values(1, 3))
        torch.testing.assert_close(result["coalesced"][1], sum(values(r, 1) for r in range(WORLD)))


def test_bad_calls_raise_on_the_callers_thread() -> None:
    group = ThreadedGroup(2)
    pg = ProcessGroupGradsync(StandInSession(group.collectives(0)), "0")  # type: ignore[arg-type]
    try:
        bitwise = dist.AllreduceOptions()
        bitwise.reduceOp = dist.ReduceOp.BAND
        with pytest.raises(ValueError, match=r"ReduceOp\.BAND is not supported"):
            pg.allreduce([torch.ones(2, dtype=torch.int64)], bitwise)
        average = dist.AllreduceOptions()
        average.reduceOp = dist.ReduceOp.AVG
        with pytest.raises(ValueError, match="AVG needs a floating tensor"):
            pg.allreduce([torch.ones(2, dtype=torch.int32)], average)
        with pytest.raises(ValueError, match="exactly one tensor"):
            pg.allreduce([torch.ones(2), torch.ones(2)], dist.AllreduceOptions())
        with pytest.raises(ValueError, match=r"must hold 2 x \[3\] float32"):
            pg.all_gather_single(torch.zeros(5), torch.zeros(3))
        with pytest.raises(RuntimeError, match="send is not supported: the gradsync backend"):
            pg.send([torch.ones(1)], 1, 0)
        with pytest.raises(RuntimeError, match="recv is not supported"):
            pg.recv([torch.ones(1)], 1, 0)
        assert pg.operations_completed == 0  # nothing was queued
    finally:
        pg.shutdown()
    with pytest.raises(RuntimeError, match="after the group was shut down"):
        pg.barrier()


def test_a_collective_over_fewer_ranks_than_the_group_fails_its_work() -> None:
    group = ShrunkGroup(3, out=[2])  # the coordinator went on without rank 2 (elastic)

    def body(rank: int) -> str:
        pg = ProcessGroupGradsync(StandInSession(group.collectives(rank)), "0")  # type: ignore[arg-type]
        try:
            work = pg.allreduce([torch.ones(2)], dist.AllreduceOptions())
            with pytest.raises(dist.DistBackendError) as caught:
                work.wait()
            with pytest.raises(RuntimeError, match="only 2 of the group's 3 ranks"):
                work.get_future().wait()  # the future fails too (DDP's reducer reads it)
            assert not work.is_success()
            return str(caught.value)
        finally:
            pg.shutdown()

    for rank, message in zip((0, 1), group.run(body, ranks=[0, 1]), strict=True):
        assert (
            f"rank {rank} of group '0' (job 'job.pg-world'): allreduce(sum, [2] float32)" in message
        )
        assert "(operation 0 of the group)" in message
        assert "only 2 of the group's 3 ranks took part (the coordinator lost ranks [2]" in message


def test_job_ids_and_rendezvous_urls() -> None:
    assert group_job_id("run", "0", []) == "run.pg-world"
    sub = group_job_id("run", "3f2a", [0, 2])
    assert sub.startswith("run.pg-") and sub == group_job_id("run", "3f2a", [0, 2])
    assert sub != group_job_id("run", "3f2a", [0, 1]) != group_job_id("run", "4", [0, 2])
    with pytest.raises(ValueError, match="too long"):
        group_job_id("x" * 125, "0", [])
    target = parse_url("gradsync://10.0.0.5:50051?rank=2&world_size=4", environ={})
    assert (target.address, target.rank, target.world_size) == ("10.0.0.5:50051", 2, 4)
    target = parse_url("gradsync://host:1", environ={"RANK": "1", "WORLD_SIZE": "2"})
    assert (target.rank, target.world_size) == (1, 2)
    with pytest.raises(ValueError, match="no rank"):
        parse_url("gradsync://host:1", environ={})
    with pytest.raises(ValueError, match="expected gradsync://"):
        parse_url("tcp://host:1", environ={})


def test_importing_registers_the_backend_and_the_rendezvous_once() -> None:
    import importlib

    import gradsync.distributed
    from torch.distributed.rendezvous import _rendezvous_handlers

    importlib.reload(gradsync.distributed)  # a second registration is a no-op
    assert "gradsync" in dist.Backend.backend_list
    assert dist.Backend.backend_capability["gradsync"] == ["cpu", "cuda"]
    assert "gradsync" in _rendezvous_handlers


def test_the_coordinator_comes_from_the_options_else_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from gradsync.distributed.backend import GradsyncOptions, resolve_coordinator

    monkeypatch.setenv("GRADSYNC_COORDINATOR", "env-host:1")
    assert resolve_coordinator(GradsyncOptions(coordinator="opt-host:2")) == "opt-host:2"
    assert resolve_coordinator(None) == "env-host:1"
    monkeypatch.delenv("GRADSYNC_COORDINATOR")
    with pytest.raises(ValueError, match="no coordinator: use init_method='gradsync://host:port'"):
        resolve_coordinator(GradsyncOptions())


def test_the_group_keeps_the_name_c10d_gives_it() -> None:
    """DeviceMesh looks its dimensions' groups up by name (`group_name`)."""
    group = ThreadedGroup(1)
    pg = ProcessGroupGradsync(StandInSession(group.collectives(0)), "7")  # type: ignore[arg-type]
    try:
        assert pg.group_name == "7"
        pg._set_group_name("mesh-dim-1")
        pg._set_group_desc("mesh_shard")
        assert (pg.group_name, pg.group_desc) == ("mesh-dim-1", "mesh_shard")
        assert pg.name() == "gradsync" and pg.size() == 1
    finally:
        pg.shutdown()


def test_a_16_bit_wire_rounds_summing_float32_reductions_and_leaves_the_rest_exact() -> None:
    """On a bfloat16 wire each rank's float32 input is rounded, the inputs summed in
    float32, the result rounded again and widened into the tensor; MAX, float64 and
    broadcast stay exact."""
    wire = torch.bfloat16
    group = ThreadedGroup(2)

    def mine(rank: int) -> torch.Tensor:
        return torch.tensor([1.0 + 2**-10, 3.0 + 2**-9, -2.5 + 2**-12, 1000.1]) * (rank + 1)

    def rounded(*shares: torch.Tensor) -> torch.Tensor:
        total = shares[0].to(wire).float()
        for share in shares[1:]:
            total = total + share.to(wire).float()
        return total.to(wire).float()

    def options(op: Any) -> Any:
        chosen = dist.AllreduceOptions()
        chosen.reduceOp = op
        return chosen

    def body(rank: int) -> dict[str, torch.Tensor]:
        pg = ProcessGroupGradsync(StandInSession(group.collectives(rank)), "0", wire)  # type: ignore[arg-type]
        out: dict[str, torch.Tensor] = {}
        try:
            for name, op in [
                ("sum", dist.ReduceOp.SUM),
                ("avg", dist.ReduceOp.AVG),
                ("premul", dist._make_nccl_premul_sum(0.25)),
                ("max", dist.ReduceOp.MAX),
            ]:
                out[name] = mine(rank)
                pg.allreduce([out[name]], options(op)).wait()
            out["float64"] = mine(rank).double()
            pg.allreduce([out["float64"]], options(dist.ReduceOp.SUM)).wait()
            out["coalesced"] = mine(rank)
            pg.allreduce_coalesced([out["coalesced"]], dist.AllreduceCoalescedOptions()).wait()
            out["scattered"] = torch.zeros(2)
            pg.reduce_scatter_single(out["scattered"], mine(rank)).wait()
            out["broadcast"] = mine(rank)
            pg.broadcast([out["broadcast"]], dist.BroadcastOptions()).wait()
        finally:
            pg.shutdown()
        return out

    shares = [mine(0), mine(1)]
    exact = shares[0] + shares[1]
    widened = [share.to(wire).float() for share in shares]
    for rank, out in enumerate(group.run(body)):
        assert all(t.dtype in (torch.float32, torch.float64) for t in out.values())
        assert torch.equal(out["sum"], rounded(*shares))
        assert not torch.equal(out["sum"], exact)  # the wire's rounding, not float32's
        assert torch.equal(out["avg"], ((widened[0] + widened[1]) / 2).to(wire).float())
        assert torch.equal(out["premul"], rounded(*(share * 0.25 for share in shares)))
        assert torch.equal(out["max"], torch.maximum(*shares))
        assert torch.equal(out["float64"], shares[0].double() + shares[1].double())
        assert torch.equal(out["coalesced"], rounded(*shares))
        assert torch.equal(out["scattered"], rounded(*shares)[2 * rank : 2 * rank + 2])
        assert torch.equal(out["broadcast"], shares[0])


def test_the_wire_comes_from_the_options_else_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from gradsync.distributed.backend import GradsyncOptions
    from gradsync.distributed.wire import resolve_wire_dtype

    monkeypatch.delenv("GRADSYNC_WIRE_DTYPE", raising=False)
    assert resolve_wire_dtype(None) is None
    monkeypatch.setenv("GRADSYNC_WIRE_DTYPE", "bfloat16")
    assert resolve_wire_dtype(None) == torch.bfloat16
    assert resolve_wire_dtype(torch.float16) == torch.float16
    assert resolve_wire_dtype(torch.float32) is None  # the option turns the wire off
    monkeypatch.setenv("GRADSYNC_WIRE_DTYPE", "float32")
    assert resolve_wire_dtype(None) is None
    monkeypatch.setenv("GRADSYNC_WIRE_DTYPE", "bf16")
    with pytest.raises(ValueError, match=r"GRADSYNC_WIRE_DTYPE='bf16' is not one of bfloat16"):
        resolve_wire_dtype(None)
    with pytest.raises(ValueError, match=r"wire_dtype must be torch\.bfloat16, torch\.float16"):
        GradsyncOptions(wire_dtype=torch.int8)
