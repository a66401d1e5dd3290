"""DiLoCo's outer averages are finite before they are committed, whatever the weights claim.

An in-process coordinator (`--nonfinite abort`) over real gRPC on loopback, driven by raw
workers. Two ranks each claiming weight 1e-300 with finite pseudo-gradients made every
element of the average 0/0 = NaN, committed with no rank named: the weight is now refused
below the minimum, naming the rank and both values, and nothing of the round is applied.
Finite pseudo-gradients whose outer step overflows float32 are caught before the commit:
the round is aborted for every rank, no rank blamed (none sent NaN/Inf), and counted.
"""

from __future__ import annotations

import numpy as np
from gradsync_proto.v1 import gradsync_pb2 as pb
from gradsync_server.app import Running
from support.rawclient import (
    BUCKET_BYTES,
    CHUNK,
    RawWorker,
    assembled_job,
    bucket_values,
    coordinator,
    gradient,
    run,
    signature,
)

ELEMENTS = BUCKET_BYTES // 4


def outer_signature(**settings: object) -> pb.ModelSignature:
    """The raw client's model, its one bucket held by an outer SGD with lr 1, momentum 0."""
    sig = signature()
    sig.buckets[0].outer = True
    sig.outer.CopyFrom(pb.OuterOptimizer(lr=1.0, **settings))  # type: ignore[arg-type]
    return sig


async def upload(worker: RawWorker, step: int, values: np.ndarray, weight: float = 0.0) -> None:
    raw = values.astype(np.float32).tobytes()
    for offset in range(0, len(raw), CHUNK):
        message = gradient(step, offset, raw[offset : offset + CHUNK])
        message.gradient.reply_dtype = pb.DTYPE_FLOAT32
        message.gradient.weight = weight
        await worker.send(message)


async def answer(worker: RawWorker) -> np.ndarray:
    """The answered bucket 0 of one round (global parameters)."""
    result, received = bytearray(BUCKET_BYTES), 0
    while received < BUCKET_BYTES:
        chunk = (await worker.expect_kind("gradient")).gradient
        result[chunk.offset : chunk.offset + len(chunk.payload)] = chunk.payload
        received += len(chunk.payload)
    return np.frombuffer(bytes(result), dtype=np.float32)


async def seeded(workers: list[RawWorker], weight: float = 0.0) -> np.ndarray:
    """The seed round (identical parameters from every rank): the global parameters."""
    params = bucket_values(9, 0)
    for worker in workers:
        await upload(worker, 0, params, weight)
    answers = [await answer(worker) for worker in workers]
    np.testing.assert_array_equal(answers[0], answers[1])
    return answers[0]


async def aborted(workers: list[RawWorker]) -> list[pb.StepAborted]:
    return [(await worker.expect_kind("step_aborted")).step_aborted for worker in workers]


def nonfinite_count(running: Running) -> int:
    return int(running.servicer.jobs["job"].in_flight.nonfinite.count)


def test_weights_of_1e_300_are_refused_by_name_and_nothing_of_the_round_is_committed() -> None:
    async def scenario() -> None:
        async with coordinator(nonfinite="abort") as (_, channel):
            workers = await assembled_job(channel, sig=outer_signature(weighted=True))
            params = await seeded(workers, weight=1.0)
            g = [np.full(ELEMENTS, 0.5 + rank, np.float32) for rank in range(2)]
            await upload(workers[0], 1, g[0], 1e-300)
            await upload(workers[1], 1, g[1], 1e-300)
            for message in await aborted(workers):
                assert message.culprit_rank == 0, message
                for words in ("rank 0", "weight 1e-300", "minimum weight 9.5367431640625e-07"):
                    assert words in message.message, (words, message.message)
            # The next round, with real weights, starts from the seed: nothing was applied.
            await upload(workers[0], 2, g[0], 1.0)
            await upload(workers[1], 2, g[1], 3.0)
            expected = params - np.float32((0.5 * 1.0 + 1.5 * 3.0) / 4.0)
            for worker in workers:
                got = await answer(worker)
                assert np.isfinite(got).all()
                np.testing.assert_array_equal(got, expected)

    run(scenario)


def test_an_outer_step_that_overflows_is_aborted_before_it_is_committed() -> None:
    async def scenario() -> None:
        async with coordinator(nonfinite="abort") as (running, channel):
            workers = await assembled_job(channel, sig=outer_signature())
            await seeded(workers)
            push = np.full(ELEMENTS, -3e38, np.float32)  # finite; lr 1: global += 3e38
            for worker in workers:
                await upload(worker, 1, push)
            first = [await answer(worker) for worker in workers]
            assert all(np.isfinite(values).all() for values in first)
            assert nonfinite_count(running) == 0
            for worker in workers:  # 3e38 + 3e38 is past float32's largest number
                await upload(worker, 2, push)
            for message in await aborted(workers):
                assert message.reason == pb.ABORT_REASON_NONFINITE, message
                assert message.culprit_rank == -1, message
                for words in ("outer average", "no contribution held NaN/Inf", "step 2"):
                    assert words in message.message, (words, message.message)
            assert nonfinite_count(running) >= 1
            # Nothing of round 2 was committed: a finite round 3 applies to round 1's state.
            pull = np.full(ELEMENTS, 1e38, np.float32)
            for worker in workers:
                await upload(worker, 3, pull)
            for worker, before in zip(workers, first, strict=True):
                got = await answer(worker)
                np.testing.assert_array_equal(got, before - np.float32(1e38))

    run(scenario)
