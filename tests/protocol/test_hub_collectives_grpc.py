"""The hub's per-rank collectives over real gRPC: each rank receives only its own part.

Raw workers send CollectiveChunks as the contract describes: reduce_scatter
(every reduce op), gather, scatter, all_to_all with unequal splits and the
product all_reduce, checked against numpy (and torch for bfloat16). Sixteen-bit
reductions give the same bits whichever rank arrives first. Sizes are claims
checked before anything is buffered; ranks that disagree (reduce op, root,
splits) fail every rank with both values named; a rank lost from a per-rank
collective (elastic) fails it for the others.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import grpc
import numpy as np
import pytest
import torch
from gradsync_proto.v1 import gradsync_pb2 as pb
from support.rawclient import CHUNK, RawWorker, assembled_job, coordinator, run

WORLD = 3


async def receive_result(worker: RawWorker, sequence: int) -> tuple[bytes, int]:
    """One collective's whole result (and its contributors), checked chunk by chunk."""
    first = (await worker.expect_kind("collective")).collective
    assert first.sequence == sequence and not first.error, first
    result = bytearray(first.total_bytes)
    received = 0
    chunk = first
    while True:
        result[chunk.offset : chunk.offset + len(chunk.payload)] = chunk.payload
        received += len(chunk.payload)
        if received >= first.total_bytes:
            return bytes(result), first.contributors
        chunk = (await worker.expect_kind("collective")).collective
        assert chunk.sequence == sequence, chunk


async def send(
    worker: RawWorker,
    sequence: int,
    op: int,
    dtype: int,
    raw: bytes,
    *,
    root: int = 0,
    reduce_op: int = 0,
    send_splits: Sequence[int] = (),
    receive_splits: Sequence[int] = (),
) -> None:
    """Send `raw` as one rank's input to collective `sequence`, chunk by chunk."""
    spans = [(o, raw[o : o + CHUNK]) for o in range(0, len(raw), CHUNK)] or [(0, b"")]
    for offset, payload in spans:
        chunk = pb.CollectiveChunk(
            sequence=sequence,
            op=op,  # type: ignore[arg-type]
            dtype=dtype,  # type: ignore[arg-type]
            total_bytes=len(raw),
            offset=offset,
            payload=payload,
            root=root,
            reduce_op=reduce_op,  # type: ignore[arg-type]
            send_splits=list(send_splits),
            receive_splits=list(receive_splits),
        )
        await worker.send(pb.WorkerMessage(collective=chunk))


def inputs_of(dtype: np.dtype, n: int) -> list[np.ndarray]:
    rng = np.random.default_rng(7)
    if np.issubdtype(dtype, np.integer):
        return [rng.integers(-5, 6, n).astype(dtype) for _ in range(WORLD)]
    return [(rng.standard_normal(n) + 1.5).astype(dtype) for _ in range(WORLD)]


REDUCTIONS = {
    "sum": (pb.COLLECTIVE_OP_SUM, lambda xs: xs[0] + xs[1] + xs[2]),
    "avg": (pb.COLLECTIVE_OP_AVG, lambda xs: (xs[0] + xs[1] + xs[2]) / np.float32(WORLD)),
    "min": (pb.COLLECTIVE_OP_MIN, lambda xs: np.minimum(np.minimum(xs[0], xs[1]), xs[2])),
    "max": (pb.COLLECTIVE_OP_MAX, lambda xs: np.maximum(np.maximum(xs[0], xs[1]), xs[2])),
    "product": (pb.COLLECTIVE_OP_PRODUCT, lambda xs: xs[0] * xs[1] * xs[2]),
}


@pytest.mark.parametrize("name", sorted(REDUCTIONS))
def test_reduce_scatter_sends_each_rank_only_its_part(name: str) -> None:
    reduce_op, reference = REDUCTIONS[name]
    part = 1500  # elements per rank: each input spans several chunks

    async def scenario() -> None:
        async with coordinator(world_size=WORLD) as (_, channel):
            workers = await assembled_job(channel, world_size=WORLD)
            inputs = inputs_of(np.dtype(np.float32), WORLD * part)
            for rank in (1, 2, 0):
                await send(
                    workers[rank], 0, pb.COLLECTIVE_OP_REDUCE_SCATTER, pb.DTYPE_FLOAT32,
                    inputs[rank].tobytes(), reduce_op=reduce_op,
                )  # fmt: skip
            expected = reference(inputs).astype(np.float32)
            for rank, worker in enumerate(workers):
                result, contributors = await receive_result(worker, 0)
                assert contributors == WORLD
                assert len(result) == part * 4  # only its part travels back
                mine = expected[rank * part : (rank + 1) * part]
                np.testing.assert_array_equal(np.frombuffer(result, np.float32), mine)

    run(scenario)


def test_product_all_reduce_of_floats_and_integers() -> None:
    async def scenario() -> None:
        async with coordinator(world_size=WORLD) as (_, channel):
            workers = await assembled_job(channel, world_size=WORLD)
            for sequence, (dtype, wire) in enumerate(
                ((np.float32, pb.DTYPE_FLOAT32), (np.int32, pb.DTYPE_INT32))
            ):
                inputs = inputs_of(np.dtype(dtype), 700)
                for rank, worker in enumerate(workers):
                    await send(
                        worker, sequence, pb.COLLECTIVE_OP_PRODUCT, wire, inputs[rank].tobytes()
                    )
                expected = (inputs[0] * inputs[1] * inputs[2]).astype(dtype).tobytes()
                for worker in workers:
                    assert await receive_result(worker, sequence) == (expected, WORLD)

    run(scenario)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_sixteen_bit_reductions_are_bitwise_independent_of_arrival_order(dtype: str) -> None:
    """The same inputs, sent in every arrival order, give the same bits: the fp32 sum
    in rank order, narrowed once (what torch computes in fp32 and casts)."""
    torch_dtype = getattr(torch, dtype)
    wire = pb.DTYPE_BFLOAT16 if dtype == "bfloat16" else pb.DTYPE_FLOAT16
    generator = torch.Generator().manual_seed(3)
    # Values of very different magnitudes: a sum in another order rounds differently.
    tensors = [
        (torch.randn(WORLD * 512, generator=generator) * 10.0 ** (2 * r)).to(torch_dtype)
        for r in range(WORLD)
    ]
    raws = [t.view(torch.int16).numpy().tobytes() for t in tensors]
    wide = [t.float() for t in tensors]
    orders = list(itertools.permutations(range(WORLD)))

    async def scenario() -> None:
        async with coordinator(world_size=WORLD) as (_, channel):
            workers = await assembled_job(channel, world_size=WORLD)
            answers: dict[str, set[bytes]] = {"all_reduce": set(), "reduce_scatter": set()}
            for index, order in enumerate(orders):
                for rank in order:
                    await send(workers[rank], 2 * index, pb.COLLECTIVE_OP_SUM, wire, raws[rank])
                    await send(
                        workers[rank], 2 * index + 1, pb.COLLECTIVE_OP_REDUCE_SCATTER, wire,
                        raws[rank], reduce_op=pb.COLLECTIVE_OP_SUM,
                    )  # fmt: skip
                for rank, worker in enumerate(workers):
                    whole, _ = await receive_result(worker, 2 * index)
                    mine, _ = await receive_result(worker, 2 * index + 1)
                    answers["all_reduce"].add(whole)
                    answers["reduce_scatter"].add(whole[rank * 1024 : (rank + 1) * 1024])
                    assert mine == whole[rank * 1024 : (rank + 1) * 1024]
            expected = ((wide[0] + wide[1]) + wide[2]).to(torch_dtype)
            assert answers["all_reduce"] == {expected.view(torch.int16).numpy().tobytes()}
            assert len(answers["reduce_scatter"]) == WORLD  # one part per rank, every order

    run(scenario)


def test_gather_and_scatter_reach_only_who_needs_them() -> None:
    async def scenario() -> None:
        async with coordinator(world_size=WORLD) as (_, channel):
            workers = await assembled_job(channel, world_size=WORLD)
            parts = [np.full(2000, 10 * rank + 1, np.int64).tobytes() for rank in range(WORLD)]
            for rank in (2, 0, 1):
                await send(
                    workers[rank], 0, pb.COLLECTIVE_OP_GATHER, pb.DTYPE_INT64, parts[rank], root=1
                )
            for rank, worker in enumerate(workers):
                expected = b"".join(parts) if rank == 1 else b""
                assert await receive_result(worker, 0) == (expected, WORLD)
            for rank, worker in enumerate(workers):
                data = b"".join(parts) if rank == 2 else b""
                await send(worker, 1, pb.COLLECTIVE_OP_SCATTER, pb.DTYPE_INT64, data, root=2)
            for rank, worker in enumerate(workers):
                assert await receive_result(worker, 1) == (parts[rank], WORLD)

    run(scenario)


def test_all_to_all_with_unequal_splits() -> None:
    # rows[s][r]: how many float32 values rank s sends rank r.
    rows = [[1, 0, 3000], [2, 5, 0], [0, 1200, 4]]

    async def scenario() -> None:
        async with coordinator(world_size=WORLD) as (_, channel):
            workers = await assembled_job(channel, world_size=WORLD)
            parts = [
                [np.full(rows[s][r], 100 * s + r, np.float32).tobytes() for r in range(WORLD)]
                for s in range(WORLD)
            ]
            for rank in (1, 0, 2):
                await send(
                    workers[rank], 0, pb.COLLECTIVE_OP_ALL_TO_ALL, pb.DTYPE_FLOAT32,
                    b"".join(parts[rank]),
                    send_splits=[4 * n for n in rows[rank]],
                    receive_splits=[4 * rows[s][rank] for s in range(WORLD)],
                )  # fmt: skip
            for rank, worker in enumerate(workers):
                expected = b"".join(parts[s][rank] for s in range(WORLD))
                assert await receive_result(worker, 0) == (expected, WORLD)

    run(scenario)


@pytest.mark.parametrize(
    ("first", "second", "needles"),
    [
        (
            {"op": pb.COLLECTIVE_OP_REDUCE_SCATTER, "reduce_op": pb.COLLECTIVE_OP_SUM},
            {"op": pb.COLLECTIVE_OP_REDUCE_SCATTER, "reduce_op": pb.COLLECTIVE_OP_MAX},
            ["as reduce_scatter max", "rank 0 sent reduce_scatter sum"],
        ),
        (
            {"op": pb.COLLECTIVE_OP_GATHER, "root": 0},
            {"op": pb.COLLECTIVE_OP_GATHER, "root": 1},
            ["(gather) from root 1", "rank 0 named root 0"],
        ),
        (
            {"op": pb.COLLECTIVE_OP_ALL_TO_ALL, "send_splits": [8, 8], "receive_splits": [8, 8]},
            {"op": pb.COLLECTIVE_OP_ALL_TO_ALL, "send_splits": [4, 12], "receive_splits": [8, 8]},
            ["(all_to_all)", "sends 4 bytes to rank 0, but rank 0 expects 8 bytes from it"],
        ),
    ],
    ids=["reduce op", "root", "splits"],
)
def test_disagreeing_ranks_fail_every_rank_naming_both_values(
    first: dict[str, object], second: dict[str, object], needles: list[str]
) -> None:
    async def scenario() -> None:
        async with coordinator(world_size=2) as (_, channel):
            workers = await assembled_job(channel)
            for rank, fields in ((0, first), (1, second)):
                await send(workers[rank], 0, dtype=pb.DTYPE_FLOAT32, raw=bytes(16), **fields)  # type: ignore[arg-type]
            details = await workers[1].expect_status(grpc.StatusCode.INVALID_ARGUMENT)
            failure = (await workers[0].expect_kind("collective")).collective
            assert failure.error == details and not failure.payload
            assert "rank 1 sent collective 0" in details
            for needle in needles:
                assert needle in details, details

    run(scenario)


@pytest.mark.parametrize(
    ("fields", "raw_bytes", "code", "needles"),
    [
        (
            {"op": pb.COLLECTIVE_OP_REDUCE_SCATTER, "reduce_op": pb.COLLECTIVE_OP_SUM},
            12,
            grpc.StatusCode.INVALID_ARGUMENT,
            ["12 bytes", "not 2 equal parts"],
        ),
        (
            {"op": pb.COLLECTIVE_OP_REDUCE_SCATTER, "reduce_op": pb.COLLECTIVE_OP_SUM},
            2 * 4096,
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            ["8192 bytes", "the limit is 4096 bytes (--max-collective-mb)"],
        ),
        (
            {"op": pb.COLLECTIVE_OP_REDUCE_SCATTER, "reduce_op": pb.COLLECTIVE_OP_BROADCAST},
            16,
            grpc.StatusCode.INVALID_ARGUMENT,
            ["needs a reduce op of sum, avg, min, max or product"],
        ),
        (
            {"op": pb.COLLECTIVE_OP_ALL_TO_ALL, "send_splits": [8, 4], "receive_splits": [8, 8]},
            16,
            grpc.StatusCode.INVALID_ARGUMENT,
            ["send_splits [8, 4] sum to 12, not 16"],
        ),
        (
            {"op": pb.COLLECTIVE_OP_ALL_TO_ALL, "send_splits": [8, 8], "receive_splits": [8]},
            16,
            grpc.StatusCode.INVALID_ARGUMENT,
            ["1 receive_splits, expected one per rank (2)"],
        ),
        (
            {
                "op": pb.COLLECTIVE_OP_ALL_TO_ALL,
                "send_splits": [8, 8],
                "receive_splits": [4096, 4096],
            },
            16,
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            ["receive_splits sum to 8192 bytes, above the limit of 4096 bytes"],
        ),
        (
            {"op": pb.COLLECTIVE_OP_SCATTER, "root": 0},
            12,
            grpc.StatusCode.INVALID_ARGUMENT,
            ["not 2 equal parts"],
        ),
        (
            {"op": pb.COLLECTIVE_OP_GATHER, "root": 0},
            4096,
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            ["gathered over 2 ranks that makes 8192 bytes, above the limit of 4096 bytes"],
        ),
    ],
    ids=[
        "reduce_scatter uneven",
        "reduce_scatter over limit",
        "reduce_scatter bad op",
        "splits sum",
        "splits count",
        "receive over limit",
        "scatter uneven",
        "gather over limit",
    ],
)
def test_size_claims_are_refused_before_anything_is_buffered(
    fields: dict[str, object], raw_bytes: int, code: grpc.StatusCode, needles: list[str]
) -> None:
    async def scenario() -> None:
        async with coordinator(max_collective_bytes=4096) as (running, channel):
            workers = await assembled_job(channel)
            # Only the first chunk is sent: the claim alone is refused.
            chunk = pb.CollectiveChunk(
                sequence=0,
                dtype=pb.DTYPE_FLOAT32,
                total_bytes=raw_bytes,
                payload=bytes(min(raw_bytes, CHUNK)),
                **fields,  # type: ignore[arg-type]
            )
            await workers[0].send(pb.WorkerMessage(collective=chunk))
            details = await workers[0].expect_status(code)
            assert "rank 0 sent collective 0" in details, details
            for needle in needles:
                assert needle in details, details
            assert running.servicer.budget.used == 0

    run(scenario)


def test_a_rank_lost_from_a_reduce_scatter_fails_it_for_the_others() -> None:
    async def scenario() -> None:
        elastic = {"on_failure": "elastic", "min_workers": 1, "heartbeat_timeout_s": 30.0}
        async with coordinator(world_size=WORLD, **elastic) as (running, channel):
            workers = await assembled_job(channel, world_size=WORLD)
            raw = np.ones(WORLD * 4, np.float32).tobytes()
            for rank in (0, 1):
                await send(
                    workers[rank], 0, pb.COLLECTIVE_OP_REDUCE_SCATTER, pb.DTYPE_FLOAT32, raw,
                    reduce_op=pb.COLLECTIVE_OP_SUM,
                )  # fmt: skip
            workers[2].call.cancel()
            for worker in workers[:2]:
                message = await worker.recv()
                while message.WhichOneof("kind") != "collective":
                    message = await worker.recv()
                assert not message.collective.payload
                assert "rank 2 stopped taking part in collective 0 (reduce_scatter sum)" in (
                    message.collective.error
                ), message.collective.error
            assert running.servicer.budget.used == 0

    run(scenario)
