"""The hub's per-rank collectives as pure logic: chunks of every rank in random
interleavings, against numpy / torch references, with no sockets.

Each rank gets its own part (and only it); sixteen-bit reductions give the same
bits in every interleaving; a rank lost from a per-rank op fails it for the
others and frees every byte; per-rank ops refuse to open without every rank.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from gradsync_proto.codes import Code
from gradsync_proto.v1 import gradsync_pb2 as pb
from gradsync_server.control.collectives import Collectives
from gradsync_server.dataplane.actions import Action, Send
from gradsync_server.dataplane.budget import ByteBudget
from gradsync_server.errors import RejectedMessage


def sent(message: pb.CoordinatorMessage | bytes) -> pb.CoordinatorMessage:
    """A Send's message (a result chunk travels encoded once for all its ranks)."""
    return pb.CoordinatorMessage.FromString(message) if isinstance(message, bytes) else message


CHUNK = 256
WORLD = 3


def chunks_of(
    rank: int, raw: bytes, op: int, dtype: int, **fields: object
) -> list[tuple[int, pb.CollectiveChunk]]:
    spans = [(o, raw[o : o + CHUNK]) for o in range(0, len(raw), CHUNK)] or [(0, b"")]
    return [
        (
            rank,
            pb.CollectiveChunk(
                sequence=0,
                op=op,  # type: ignore[arg-type]
                dtype=dtype,  # type: ignore[arg-type]
                total_bytes=len(raw),
                offset=offset,
                payload=payload,
                **fields,  # type: ignore[arg-type]
            ),
        )
        for offset, payload in spans
    ]


def interleaved(
    per_rank: list[list[tuple[int, pb.CollectiveChunk]]], seed: int
) -> list[tuple[int, pb.CollectiveChunk]]:
    """Every rank's chunks in its own order, the ranks interleaved at random."""
    rng = random.Random(seed)
    queues = [list(chunks) for chunks in per_rank]
    out = []
    while any(queues):
        queue = rng.choice([q for q in queues if q])
        out.append(queue.pop(0))
    return out


def results(collectives: Collectives, messages: list[tuple[int, pb.CollectiveChunk]]) -> dict:
    """Each rank's whole result, from the Send actions addressed to it."""
    actions: list[Action] = []
    for rank, chunk in messages:
        actions += collectives.accept(rank, chunk, list(range(WORLD)))
    by_rank: dict[int, bytearray] = {}
    for action in actions:
        assert isinstance(action, Send)
        chunk = sent(action.message).collective
        assert not chunk.error, chunk.error
        for rank in action.ranks:
            out = by_rank.setdefault(rank, bytearray(chunk.total_bytes))
            out[chunk.offset : chunk.offset + len(chunk.payload)] = chunk.payload
    return {rank: bytes(out) for rank, out in by_rank.items()}


def engine(budget: ByteBudget) -> Collectives:
    return Collectives(WORLD, CHUNK, 1 << 20, budget.for_owner("job"))


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_sixteen_bit_reduce_scatter_is_the_same_bits_in_every_interleaving(dtype: str) -> None:
    torch_dtype = getattr(torch, dtype)
    wire = pb.DTYPE_BFLOAT16 if dtype == "bfloat16" else pb.DTYPE_FLOAT16
    generator = torch.Generator().manual_seed(0)
    tensors = [
        (torch.randn(WORLD * 300, generator=generator) * 4.0**r).to(torch_dtype)
        for r in range(WORLD)
    ]
    raws = [t.view(torch.int16).numpy().tobytes() for t in tensors]
    expected = ((tensors[0].float() + tensors[1].float()) + tensors[2].float()).to(torch_dtype)
    whole = expected.view(torch.int16).numpy().tobytes()
    part = len(whole) // WORLD
    for seed in range(6):
        per_rank = [
            chunks_of(r, raws[r], pb.COLLECTIVE_OP_REDUCE_SCATTER, wire,
                      reduce_op=pb.COLLECTIVE_OP_SUM)
            for r in range(WORLD)
        ]  # fmt: skip
        budget = ByteBudget(1 << 24)
        got = results(engine(budget), interleaved(per_rank, seed))
        assert got == {r: whole[r * part : (r + 1) * part] for r in range(WORLD)}, seed
        assert budget.used == 0


@pytest.mark.parametrize("seed", range(4))
def test_all_to_all_in_any_interleaving(seed: int) -> None:
    rng = np.random.default_rng(seed)
    rows = rng.integers(0, 200, (WORLD, WORLD))
    parts = [
        [rng.integers(0, 1 << 30, rows[s][r]).astype(np.int32).tobytes() for r in range(WORLD)]
        for s in range(WORLD)
    ]
    per_rank = [
        chunks_of(
            s, b"".join(parts[s]), pb.COLLECTIVE_OP_ALL_TO_ALL, pb.DTYPE_INT32,
            send_splits=[4 * int(n) for n in rows[s]],
            receive_splits=[4 * int(rows[j][s]) for j in range(WORLD)],
        )
        for s in range(WORLD)
    ]  # fmt: skip
    budget = ByteBudget(1 << 24)
    got = results(engine(budget), interleaved(per_rank, seed))
    assert got == {r: b"".join(parts[s][r] for s in range(WORLD)) for r in range(WORLD)}
    assert budget.used == 0


def test_a_rank_lost_from_a_per_rank_op_fails_it_and_frees_every_byte() -> None:
    budget = ByteBudget(1 << 24)
    collectives = engine(budget)
    raw = bytes(WORLD * 4 * 200)
    whole = chunks_of(0, raw, pb.COLLECTIVE_OP_REDUCE_SCATTER, pb.DTYPE_FLOAT32,
                      reduce_op=pb.COLLECTIVE_OP_SUM)  # fmt: skip
    for _, chunk in whole:
        assert collectives.accept(0, chunk, list(range(WORLD))) == []
    half = chunks_of(1, raw, pb.COLLECTIVE_OP_REDUCE_SCATTER, pb.DTYPE_FLOAT32,
                     reduce_op=pb.COLLECTIVE_OP_SUM)  # fmt: skip
    for _, chunk in half[:2]:
        collectives.accept(1, chunk, list(range(WORLD)))
    assert budget.used > 0
    (told,) = collectives.drop_participant(2)
    assert isinstance(told, Send) and told.ranks == (0,)  # rank 1's input is not whole yet
    assert isinstance(told.message, pb.CoordinatorMessage)
    error = told.message.collective.error
    assert "rank 2 stopped taking part in collective 0 (reduce_scatter sum)" in error, error
    assert budget.used == 0
    actions: list[Action] = []
    for _, chunk in half[2:]:  # the rest of rank 1's input is dropped; then it is told
        actions += collectives.accept(1, chunk, [0, 1])
    assert [a.ranks for a in actions if isinstance(a, Send)] == [(1,)]
    assert budget.used == 0 and collectives.open_sequences() == []


def test_per_rank_ops_need_every_rank() -> None:
    collectives = engine(ByteBudget(1 << 24))
    ((_, chunk),) = chunks_of(0, bytes(8), pb.COLLECTIVE_OP_GATHER, pb.DTYPE_FLOAT32, root=1)
    with pytest.raises(RejectedMessage) as caught:
        collectives.accept(0, chunk, [0, 1])
    assert caught.value.code is Code.FAILED_PRECONDITION
    assert "needs every rank of the job, but ranks [2] take no part now" in caught.value.message
    assert collectives.open_sequences() == []
