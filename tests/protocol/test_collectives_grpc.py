"""Collectives on user tensors over real gRPC: every op, disagreeing ranks, memory.

Raw workers send CollectiveChunks exactly as the contract describes; the
coordinator answers every participant with the result, chunked by the
coordinator's chunk size, or ends a disagreeing rank's stream with
INVALID_ARGUMENT naming the rank, the sequence and both values. Inputs waiting
for other ranks are counted in the coordinator's buffered-bytes budget: an input
beyond it is refused (RESOURCE_EXHAUSTED, naming rank, job, sizes and the flag),
and what a rank sent is given back within moments of its stream ending, not at
the heartbeat timeout (issue 22).
"""

from __future__ import annotations

import asyncio
import time

import grpc
import numpy as np
import pytest
from gradsync_proto.v1 import gradsync_pb2 as pb
from support.rawclient import CHUNK, RawWorker, assembled_job, coordinator, run
from support.waiting import eventually

WORLD = 3


async def send_input(
    worker: RawWorker,
    sequence: int,
    op: int,
    dtype: int,
    raw: bytes,
    root: int = 0,
    *,
    sent_bytes: int | None = None,
) -> None:
    """Send `raw` as `sequence`'s input; only its first `sent_bytes` when given."""
    end = len(raw) if sent_bytes is None else sent_bytes
    spans = [(o, raw[o : o + CHUNK]) for o in range(0, end, CHUNK)] or [(0, b"")]
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
            # Rank 0 waits in that collective: its result is the same error (so it
            # waits no more), then it hears in-band that the job broke, naming the cause.
            failure = (await workers[0].expect_kind("collective")).collective
            assert failure.sequence == 0 and failure.error == details and not failure.payload
            end = (await workers[0].expect_kind("step_aborted")).step_aborted
            assert end.reason == pb.ABORT_REASON_PEER_LOST
            assert "rank 1 disconnected" in end.message, end.message

    run(scenario)


#: One rank's input in the memory tests: many chunks, small enough for the suite.
BIG = 64 * CHUNK


@pytest.mark.parametrize("policy", ["abort", "elastic"])
def test_collective_inputs_are_charged_and_freed_when_the_stream_ends(policy: str) -> None:
    """Rank 0 sends two whole inputs and half of a third, which rank 1 never matches,
    then its stream vanishes: while it lives its bytes are the job's in the budget;
    after, the job breaks (abort) and gives back everything at once, or (elastic) the
    half-sent input is given back at once and the collectives go on over rank 1."""
    elastic = {"on_failure": "elastic", "min_workers": 1} if policy == "elastic" else {}

    async def scenario() -> None:
        async with coordinator(heartbeat_timeout_s=30.0, **elastic) as (running, channel):
            budget = running.servicer.budget
            workers = await assembled_job(channel)
            inputs = [
                np.full(BIG // 4, sequence + 1, np.float32).tobytes() for sequence in range(3)
            ]
            for sequence, sent in ((0, BIG), (1, BIG), (2, BIG // 2)):
                await send_input(
                    workers[0], sequence, pb.COLLECTIVE_OP_SUM, pb.DTYPE_FLOAT32,
                    inputs[sequence], sent_bytes=sent,
                )  # fmt: skip
            charged = 2 * BIG + BIG // 2
            await eventually(lambda: budget.held_by("job") == charged, "rank 0's inputs charged")
            assert budget.used == charged
            started = time.monotonic()
            workers[0].call.cancel()
            kept = 2 * BIG if policy == "elastic" else 0  # rank 0's whole inputs still count
            await eventually(
                lambda: budget.used == kept,
                f"the budget to drop to {kept} bytes (holds {budget.used})",
                timeout_s=10.0,
            )
            freed_after_s = time.monotonic() - started
            assert freed_after_s < 2.0, f"freed {freed_after_s:.1f} s after the stream ended"
            if policy == "abort":
                aborted = (await workers[1].expect_kind("step_aborted")).step_aborted
                assert "rank 0 disconnected" in aborted.message, aborted.message
                return
            changed = (await workers[1].expect_kind("membership")).membership
            assert list(changed.ranks) == [1], changed
            for sequence in range(3):
                await send_input(
                    workers[1], sequence, pb.COLLECTIVE_OP_SUM, pb.DTYPE_FLOAT32, inputs[sequence]
                )
            for sequence, contributors in ((0, 2), (1, 2), (2, 1)):
                result, got = await receive_result(workers[1], sequence)
                assert got == contributors, (sequence, got)
                value = np.frombuffer(result, np.float32)
                assert (value == (sequence + 1) * contributors).all(), (sequence, value[:4])
            assert budget.used == 0

    run(scenario)


@pytest.mark.parametrize("binding", ["job share", "whole budget"])
def test_a_collective_input_beyond_the_buffered_budget_is_refused(binding: str) -> None:
    limit = 32 * CHUNK
    share = limit // 2 if binding == "job share" else limit
    flag = "--max-job-buffered-mb" if binding == "job share" else "--max-buffered-mb"

    async def scenario() -> None:
        async with coordinator(max_buffered_bytes=limit, max_job_buffered_bytes=share) as (
            running,
            channel,
        ):
            budget = running.servicer.budget
            workers = await assembled_job(channel)
            await send_input(workers[0], 0, pb.COLLECTIVE_OP_SUM, pb.DTYPE_FLOAT32, bytes(BIG // 8))
            await eventually(lambda: budget.used == BIG // 8, "the first input charged")
            # Declares `share` bytes; its chunks fit until the one sent last, which is refused.
            fitting = share - BIG // 8
            await send_input(
                workers[0], 1, pb.COLLECTIVE_OP_SUM, pb.DTYPE_FLOAT32, bytes(share),
                sent_bytes=fitting + CHUNK,
            )  # fmt: skip
            details = await workers[0].expect_status(grpc.StatusCode.RESOURCE_EXHAUSTED)
            for needle in (
                "rank 0",
                "job 'job'",
                "collective 1",
                f"{share} bytes",
                f"limit {share} bytes",
                flag,
            ):
                assert needle in details, (needle, details)
            await eventually(lambda: budget.used == 0, "the refused rank's inputs given back")
            aborted = (await workers[1].expect_kind("step_aborted")).step_aborted
            assert aborted.reason == pb.ABORT_REASON_PEER_LOST, aborted

    run(scenario)
