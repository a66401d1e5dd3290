"""`gradsync.collectives` across ranks simulated as threads (no coordinator, no sockets).

`ThreadedGroup` computes what the coordinator computes; these tests pin down
what the client side decides: in-place results on any layout, dtypes and ops
allowed or refused with a clear error, one packed collective for many
tensors, rank order of all_gather, and who takes part while ranks are out of
inputs.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch
from gradsync import collectives
from gradsync.collectives import Collectives
from gradsync_proto.v1 import gradsync_pb2 as pb
from support.fakegroup import ThreadedGroup

pytestmark = pytest.mark.unit


def per_rank(rank: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.tensor([[rank + 1.0, -rank], [2.0 * rank, 5.0]]).to(dtype)


@pytest.mark.parametrize(
    ("op", "expected"),
    [
        ("sum", [[6.0, -3.0], [6.0, 15.0]]),
        ("avg", [[2.0, -1.0], [2.0, 5.0]]),
        ("min", [[1.0, -2.0], [0.0, 5.0]]),
        ("max", [[3.0, 0.0], [4.0, 5.0]]),
    ],
)
def test_all_reduce_is_in_place_on_every_rank(op: str, expected: list[list[float]]) -> None:
    group = ThreadedGroup(3)

    def body(rank: int) -> bool:
        tensor = per_rank(rank)
        returned = collectives.all_reduce(tensor, op, group=group.collectives(rank))
        assert torch.equal(tensor, torch.tensor(expected))
        return returned is tensor

    assert group.run(body) == [True, True, True]


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.float64, torch.bfloat16])
def test_all_reduce_keeps_the_dtype(dtype: torch.dtype) -> None:
    group = ThreadedGroup(2)
    results = group.run(lambda rank: group.collectives(rank).all_reduce(per_rank(rank, dtype)))
    for result in results:
        assert result.dtype == dtype
        assert torch.equal(result, (per_rank(0) + per_rank(1)).to(dtype))


def test_a_non_contiguous_tensor_that_requires_grad_is_updated_in_place() -> None:
    group = ThreadedGroup(2)

    def body(rank: int) -> torch.Tensor:
        leaf = torch.arange(6.0).reshape(2, 3).add(rank).requires_grad_(True)
        view = leaf.detach().t()  # non-contiguous
        group.collectives(rank).all_reduce(view, "sum")
        return view

    for result in group.run(body):
        assert torch.equal(result, (torch.arange(6.0).reshape(2, 3) * 2 + 1).t())


def test_broadcast_copies_the_source_rank_in_place() -> None:
    group = ThreadedGroup(3)
    results = group.run(
        lambda rank: collectives.broadcast(per_rank(rank), 1, group=group.collectives(rank))
    )
    for result in results:
        assert torch.equal(result, per_rank(1))


def test_broadcast_tensors_sends_many_tensors_of_mixed_dtypes_in_one_collective() -> None:
    group = ThreadedGroup(2)

    def body(rank: int) -> list[torch.Tensor]:
        tensors = [
            torch.full((3,), float(rank)),
            torch.tensor([rank, rank * 7], dtype=torch.int64),
            torch.tensor([rank == 0]),
            torch.empty(0),
        ]
        group.collectives(rank).broadcast_tensors(tensors, src=0)
        return tensors

    for tensors in group.run(body):
        assert torch.equal(tensors[0], torch.zeros(3))
        assert torch.equal(tensors[1], torch.tensor([0, 0]))
        assert bool(tensors[2].item())
    assert [op for _, op in group.log] == [pb.COLLECTIVE_OP_BROADCAST]


def test_all_gather_returns_every_rank_in_rank_order() -> None:
    group = ThreadedGroup(3)
    results = group.run(
        lambda rank: collectives.all_gather(per_rank(rank), group=group.collectives(rank))
    )
    for parts in results:
        assert len(parts) == 3
        for rank, part in enumerate(parts):
            assert torch.equal(part, per_rank(rank))


def test_ranks_out_of_inputs_do_not_take_part() -> None:
    group = ThreadedGroup(3, out=[1])
    collective = {rank: group.collectives(rank) for rank in (0, 2)}

    def body(rank: int) -> tuple[torch.Tensor, list[torch.Tensor], int]:
        mean = collective[rank].all_reduce(per_rank(rank), "avg")
        return mean, collective[rank].all_gather(per_rank(rank)), collective[rank].last_contributors

    for mean, parts, contributors in group.run(body):
        assert torch.equal(mean, (per_rank(0) + per_rank(2)) / 2)
        assert [p.tolist() for p in parts] == [per_rank(0).tolist(), per_rank(2).tolist()]
        assert contributors == 2


def test_barrier_waits_for_the_last_rank() -> None:
    group = ThreadedGroup(3)
    arrived: list[float] = []
    lock = threading.Lock()

    def body(rank: int) -> float:
        if rank == 2:
            time.sleep(0.3)
        with lock:
            arrived.append(time.monotonic())
        collectives.barrier(group=group.collectives(rank))
        return time.monotonic()

    left = group.run(body)
    assert min(left) >= max(arrived)


class Wrapper:
    """Stands in for the model wrapper: anything with a `.collectives`."""

    def __init__(self, group: ThreadedGroup) -> None:
        self.collectives = group.collectives(0)


def test_a_wrapper_is_a_group_and_anything_else_is_refused() -> None:
    group = ThreadedGroup(1)
    tensor = torch.ones(2)
    assert collectives.all_reduce(tensor, "sum", group=Wrapper(group)) is tensor
    with pytest.raises(ValueError, match="group must be a gradsync"):
        collectives.barrier(group=object())


def test_torch_reduce_ops_are_accepted_by_name() -> None:
    distributed = pytest.importorskip("torch.distributed")
    if not distributed.is_available():
        pytest.skip("this torch build has no torch.distributed")
    group = ThreadedGroup(2)
    results = group.run(
        lambda rank: group.collectives(rank).all_reduce(per_rank(rank), distributed.ReduceOp.MAX)
    )
    assert torch.equal(results[0], torch.maximum(per_rank(0), per_rank(1)))


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda c: c.all_reduce(torch.ones(2, dtype=torch.int64), "avg"), "needs a floating"),
        (lambda c: c.all_reduce(torch.ones(2, dtype=torch.bool)), "cannot reduce bool"),
        (lambda c: c.all_reduce(torch.ones(2, dtype=torch.complex64)), "complex64"),
        (lambda c: c.all_reduce(torch.ones(2), "bxor"), "unsupported reduce op"),
        (lambda c: c.all_reduce(torch.ones(2).to_sparse()), "dense"),
        (lambda c: c.broadcast(torch.ones(2), 3), "src must be a rank"),
        (lambda c: c.all_gather([1.0]), "torch.Tensor"),
    ],
)
def test_unsupported_inputs_are_refused_before_anything_is_sent(call: object, message: str) -> None:
    group = ThreadedGroup(2)
    with pytest.raises(ValueError, match=message):
        call(group.collectives(0))  # type: ignore[operator]
    assert group.log == []


def test_settings_are_checked() -> None:
    with pytest.raises(ValueError, match="out of range"):
        Collectives(lambda: None, 2, 2, 1.0)  # type: ignore[arg-type, return-value]
    with pytest.raises(ValueError, match="timeout_s"):
        Collectives(lambda: None, 0, 2, 0.0)  # type: ignore[arg-type, return-value]
