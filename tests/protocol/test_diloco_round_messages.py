"""DiLoCo's straggler settings on the wire: partial rounds, late answers, weights, bad inputs.

An in-process coordinator over real gRPC on loopback, driven by raw workers that
send exactly the chunks a test wants, so every number can be checked: the outer
optimizer is plain SGD with lr 1 (global -= average), the round closes as soon as
`min_contributors` ranks contributed (deadline 0), a late upload is answered with
the current global parameters and `next_step`, merged late contributions are summed
after the live ranks in rank order, and bad weights and settings get status codes
whose messages name the rank, the round and both values.
"""

from __future__ import annotations

import grpc
import numpy as np
import pytest
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
from support.waiting import eventually

CODE = grpc.StatusCode


def outer_signature(**settings: object) -> pb.ModelSignature:
    """The raw client's model, its one bucket held as parameters by an outer SGD (lr 1)."""
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


def all_began(running: Running, world_size: int) -> bool:
    progress = running.servicer.jobs["job"].in_flight.progress
    return progress is not None and all(progress.delivered_any(r) for r in range(world_size))


async def upload_together(
    running: Running, workers: list[RawWorker], step: int, values: list[np.ndarray]
) -> None:
    """Every rank's first chunk (until the coordinator has them all), then the rest: all
    have begun before any is complete, so a round with deadline 0 waits for them all."""
    raws = [v.astype(np.float32).tobytes() for v in values]
    for offset in range(0, BUCKET_BYTES, CHUNK):
        for worker, raw in zip(workers, raws, strict=True):
            message = gradient(step, offset, raw[offset : offset + CHUNK])
            message.gradient.reply_dtype = pb.DTYPE_FLOAT32
            await worker.send(message)
        if offset == 0:
            await eventually(lambda: all_began(running, len(workers)), "every first chunk")


async def answer(worker: RawWorker) -> tuple[np.ndarray, list[pb.GradientChunk]]:
    """Every answered chunk of bucket 0 of one round, and their headers."""
    result, received, chunks = bytearray(BUCKET_BYTES), 0, []
    while received < BUCKET_BYTES:
        chunk = (await worker.expect_kind("gradient")).gradient
        result[chunk.offset : chunk.offset + len(chunk.payload)] = chunk.payload
        received += len(chunk.payload)
        chunks.append(chunk)
    return np.frombuffer(bytes(result), dtype=np.float32), chunks


async def seeded(workers: list[RawWorker], weight: float = 0.0) -> np.ndarray:
    """Run the seed round (every rank, whatever the policy); return the global parameters."""
    params = bucket_values(9, 0)
    for worker in workers:
        await upload(worker, 0, params, weight)
    total = params.copy()
    for _ in workers[1:]:
        total += params  # (W p) / W: the mean of identical parameters, in rank order
    expected = total / np.float32(len(workers))
    for worker in workers:
        got, _ = await answer(worker)
        np.testing.assert_array_equal(got, expected)
    return expected


@pytest.mark.parametrize("late", ["drop", "merge"])
def test_a_round_closes_with_k_ranks_and_the_late_one_gets_the_global_parameters(
    late: str,
) -> None:
    settings: dict[str, object] = {"min_contributors": 2}
    if late == "merge":
        settings.update(merge_late=True, max_staleness=1)

    async def scenario() -> None:
        async with coordinator(world_size=3) as (running, channel):
            workers = await assembled_job(channel, world_size=3, sig=outer_signature(**settings))
            params = await seeded(workers)
            g = [bucket_values(rank, 1) for rank in range(3)]
            for rank in (0, 1):  # rank 2 is slow: the round closes with ranks 0 and 1
                await upload(workers[rank], 1, g[rank])
            global1 = params - (g[0] + g[1]) / np.float32(2)
            for rank in (0, 1):
                got, chunks = await answer(workers[rank])
                np.testing.assert_array_equal(got, global1)
                assert {(c.step, c.contributors, c.next_step) for c in chunks} == {(1, 2, 0)}
            await upload(workers[2], 1, g[2])  # late: answered at once, alone
            got, chunks = await answer(workers[2])
            np.testing.assert_array_equal(got, global1)
            assert {(c.step, c.next_step, c.contributors) for c in chunks} == {(1, 2, 0)}
            h = [bucket_values(rank, 2) for rank in range(3)]
            await upload_together(running, workers, 2, h)
            total = h[0] + h[1] + h[2]
            if late == "merge":
                total = total + g[2]  # summed after the live ranks
            global2 = global1 - total / np.float32(4 if late == "merge" else 3)
            for worker in workers:
                got, chunks = await answer(worker)
                np.testing.assert_array_equal(got, global2)
                merged = 1 if late == "merge" else 0
                assert {(c.contributors, c.merged_late, c.staleness) for c in chunks} == {
                    (3, merged, merged)
                }

    run(scenario)


def test_weighted_rounds_divide_by_the_sum_of_the_weights() -> None:
    async def scenario() -> None:
        async with coordinator() as (_, channel):
            workers = await assembled_job(channel, sig=outer_signature(weighted=True))
            params = await seeded(workers, weight=1.0)  # the seed ignores weights
            g = [bucket_values(rank, 1) for rank in range(2)]
            weights = [3.0, 5.0]
            # Arrival order does not matter: rank 1 first.
            await upload(workers[1], 1, g[1], weights[1])
            await upload(workers[0], 1, g[0], weights[0])
            total = np.float32(3.0) * g[0]
            total = total + np.float32(5.0) * g[1]
            expected = params - total / np.float32(8.0)
            for worker in workers:
                got, _ = await answer(worker)
                np.testing.assert_array_equal(got, expected)

    run(scenario)


async def expect_refused_round(workers: list[RawWorker], *needles: str) -> None:
    for worker in workers:
        aborted = (await worker.expect_kind("step_aborted")).step_aborted
        assert aborted.culprit_rank == 1
        for needle in needles:
            assert needle in aborted.message, (needle, aborted.message)


@pytest.mark.parametrize(
    ("first", "second", "needles"),
    [
        (float("nan"), None, ("weight nan", "finite weight in [9.5367431640625e-07,")),
        (-2.0, None, ("weight -2.0", "finite weight in [9.5367431640625e-07,")),
        (0.0, None, ("weight 0.0", "finite weight in [9.5367431640625e-07,")),
        (1e300, None, ("weight 1e+300", "9.0072e+15")),
        (2.0, 3.0, ("weight 3.0", "claimed weight 2.0", "offset 4096")),
    ],
    ids=["nan", "negative", "missing", "huge", "changing"],
)
def test_bad_weights_abort_the_round_naming_rank_round_and_both_values(
    first: float, second: float | None, needles: tuple[str, ...]
) -> None:
    async def scenario() -> None:
        async with coordinator() as (_, channel):
            workers = await assembled_job(channel, sig=outer_signature(weighted=True))
            await seeded(workers, weight=1.0)
            raw = bucket_values(1, 1).tobytes()
            message = gradient(1, 0, raw[:CHUNK])
            message.gradient.reply_dtype = pb.DTYPE_FLOAT32
            message.gradient.weight = first
            await workers[1].send(message)
            if second is not None:
                message = gradient(1, CHUNK, raw[CHUNK : 2 * CHUNK])
                message.gradient.reply_dtype = pb.DTYPE_FLOAT32
                message.gradient.weight = second
                await workers[1].send(message)
            await expect_refused_round(workers, "rank 1", "round (step) 1", *needles)

    run(scenario)


def test_a_weight_in_an_unweighted_job_is_refused() -> None:
    async def scenario() -> None:
        async with coordinator() as (_, channel):
            workers = await assembled_job(channel, sig=outer_signature())
            await seeded(workers)
            message = gradient(1, 0, bucket_values(1, 1).tobytes()[:CHUNK])
            message.gradient.reply_dtype = pb.DTYPE_FLOAT32
            message.gradient.weight = 4.0
            await workers[1].send(message)
            await expect_refused_round(workers, "weight 4.0", "not weighted (expected 0)")

    run(scenario)


@pytest.mark.parametrize(
    ("settings", "code", "needle"),
    [
        ({"min_contributors": 3}, CODE.FAILED_PRECONDITION, "min_contributors=3 is more than"),
        ({"min_contributors": 1, "round_deadline_s": -1.0}, CODE.INVALID_ARGUMENT, "got -1"),
        ({"round_deadline_s": 2.0}, CODE.INVALID_ARGUMENT, "needs min_contributors >= 1"),
        ({"merge_late": True}, CODE.INVALID_ARGUMENT, "merge_late needs partial rounds"),
        (
            {"min_contributors": 1, "merge_late": True},
            CODE.INVALID_ARGUMENT,
            "max_staleness >= 1 round, got 0",
        ),
        ({"min_contributors": 1, "max_staleness": 2}, CODE.INVALID_ARGUMENT, "are dropped"),
    ],
    ids=[
        "k-above-world",
        "negative-deadline",
        "deadline-alone",
        "merge-alone",
        "no-bound",
        "bound-alone",
    ],
)
def test_bad_round_settings_refuse_the_job(
    settings: dict[str, object], code: grpc.StatusCode, needle: str
) -> None:
    async def scenario() -> None:
        async with coordinator() as (_, channel):
            workers = [RawWorker(channel) for _ in range(2)]
            for rank, worker in enumerate(workers):
                await worker.join(rank, sig=outer_signature(**settings))
            details = await workers[0].expect_status(code)
            assert needle in details, details

    run(scenario)
