"""Collectives on user tensors over real gRPC: every op, and disagreeing ranks.

Raw workers send CollectiveChunks exactly as the contract describes; the
coordinator answers every participant with the result, chunked by the
coordinator's chunk size, or ends a disagreeing rank's stream with
INVALID_ARGUMENT naming the rank, the sequence and both values.
"""

from __future__ import annotations

import asyncio

import grpc
import numpy as np
import pytest
from gradsync_proto.v1 import gradsync_pb2 as pb
from support.rawclient import CHUNK, RawWorker, assembled_job, coordinator, run

WORLD = 3


async def send_input(
    worker: RawWorker, sequence: int, op: int, dtype: int, raw: bytes, root: int = 0
) -> None:
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
        )
        await worker.send(pb.WorkerMessage(collective=chunk))


async def receive_result(worker: RawWorker, sequence: int) -> tuple[bytes, int]:
    first = (await worker.expect_kind("collective")).collective
    assert first.sequence == sequence
    result = bytearray(first.total_bytes)
    result[first.offset : first.offset + len(first.payload)] = first.payload
    received = len(first.payload)
    while received < first.total_bytes:
        chunk = (await worker.expect_kind("collective")).collective
        result[chunk.offset : chunk.offset + len(chunk.payload)] = chunk.payload
        received += len(chunk.payload)
    return bytes(result), first.contributors


OPS = {
    "sum": (pb.COLLECTIVE_OP_SUM, lambda xs: xs[0] + xs[1] + xs[2]),
    "avg": (pb.COLLECTIVE_OP_AVG, lambda xs: (xs[0] + xs[1] + xs[2]) / np.float32(3)),
    "min": (pb.COLLECTIVE_OP_MIN, lambda xs: np.minimum(np.minimum(xs[0], xs[1]), xs[2])),
    "max": (pb.COLLECTIVE_OP_MAX, lambda xs: np.maximum(np.maximum(xs[0], xs[1]), xs[2])),
}


@pytest.mark.parametrize("name", sorted(OPS))
def test_all_reduce_over_grpc(name: str) -> None:
    op, reference = OPS[name]

    async def scenario() -> None:
        async with coordinator(world_size=WORLD) as (_, channel):
            workers = await assembled_job(channel, world_size=WORLD)
            inputs = [
                np.random.default_rng(rank).standard_normal(3000).astype(np.float32)
                for rank in range(WORLD)
            ]
            for rank in (2, 0, 1):  # arrival order does not matter
                await send_input(workers[rank], 0, op, pb.DTYPE_FLOAT32, inputs[rank].tobytes())
            expected = reference(inputs).astype(np.float32).tobytes()
            for worker in workers:
                assert await receive_result(worker, 0) == (expected, WORLD)

    run(scenario)


def test_broadcast_all_gather_and_barrier_over_grpc() -> None:
    async def scenario() -> None:
        async with coordinator(world_size=WORLD) as (_, channel):
            workers = await assembled_job(channel, world_size=WORLD)
            payload = np.arange(5000, dtype=np.int64).tobytes()
            for rank, worker in enumerate(workers):
                data = payload if rank == 2 else b""
                await send_input(worker, 0, pb.COLLECTIVE_OP_BROADCAST, pb.DTYPE_INT64, data, 2)
            for worker in workers:
                assert await receive_result(worker, 0) == (payload, WORLD)
            for rank, worker in enumerate(workers):
                data = np.full(4, rank, dtype=np.int32).tobytes()
                await send_input(worker, 1, pb.COLLECTIVE_OP_ALL_GATHER, pb.DTYPE_INT32, data)
            gathered = np.repeat(np.arange(WORLD, dtype=np.int32), 4).tobytes()
            for worker in workers:
                assert await receive_result(worker, 1) == (gathered, WORLD)
            for worker in workers:
                await send_input(worker, 2, pb.COLLECTIVE_OP_BARRIER, pb.DTYPE_UINT8, b"")
            for worker in workers:
                assert await receive_result(worker, 2) == (b"", WORLD)
            for worker in workers:
                await worker.leave()

    run(scenario)


@pytest.mark.parametrize(
    ("op", "dtype", "nbytes", "needles"),
    [
        (
            pb.COLLECTIVE_OP_MAX,
            pb.DTYPE_FLOAT32,
            16,
            ["all_reduce max", "rank 0 sent all_reduce sum"],
        ),
        (pb.COLLECTIVE_OP_SUM, pb.DTYPE_INT32, 16, ["as int32", "rank 0 sent float32"]),
        (pb.COLLECTIVE_OP_SUM, pb.DTYPE_FLOAT32, 8, ["8 bytes", "rank 0 sent 16 bytes"]),
    ],
    ids=["op", "dtype", "size"],
)
def test_a_disagreeing_rank_is_ended_and_the_others_are_told(
    op: int, dtype: int, nbytes: int, needles: list[str]
) -> None:
    async def scenario() -> None:
        async with coordinator(world_size=2) as (running, channel):
            workers = await assembled_job(channel)
            await send_input(workers[0], 0, pb.COLLECTIVE_OP_SUM, pb.DTYPE_FLOAT32, bytes(16))
            job = running.servicer.jobs["job"]
            for _ in range(500):  # rank 0's input is the reference: wait until it is in
                if job.collectives.waiting_ranks() == (0,):
                    break
                await asyncio.sleep(0.01)
            await send_input(workers[1], 0, op, dtype, bytes(nbytes))
            details = await workers[1].expect_status(grpc.StatusCode.INVALID_ARGUMENT)
            assert "rank 1 sent collective 0" in details
            for needle in needles:
                assert needle in details, details
            # Rank 0 waits in that collective: it is ended at once, naming the cause.
            end = (await workers[0].expect_kind("step_aborted")).step_aborted
            assert end.reason == pb.ABORT_REASON_PEER_LOST
            details = await workers[0].expect_status(grpc.StatusCode.ABORTED)
            assert "rank 1 disconnected" in details

    run(scenario)
