"""Every bad input gets its status code and a message with the values involved,
nothing is averaged, and the coordinator keeps serving other jobs afterwards.

These talk to an in-process coordinator over real gRPC on loopback.
"""

from __future__ import annotations

import grpc
import numpy as np
from gradsync_proto import int8_wire
from gradsync_proto.v1 import gradsync_pb2 as pb
from support.rawclient import (
    BUCKET_BYTES,
    CHUNK,
    RawWorker,
    assembled_job,
    bucket_values,
    coordinator,
    gradient,
    healthy_step,
    run,
    run_step,
    signature,
    wait_until_joined,
)

CODE = grpc.StatusCode
#: The test bucket's elements: as int8, one chunk of this many bytes (CHUNK is 4096).
ELEMENTS = BUCKET_BYTES // 4


def test_rank_out_of_range() -> None:
    async def scenario() -> None:
        async with coordinator() as (_, channel):
            worker = RawWorker(channel)
            await worker.join(5)
            details = await worker.expect_status(CODE.INVALID_ARGUMENT)
            assert "rank 5" in details and "world size 2" in details
            await healthy_step(channel)

    run(scenario)


def test_world_size_mismatch_names_both_values() -> None:
    async def scenario() -> None:
        async with coordinator() as (_, channel):
            worker = RawWorker(channel)
            await worker.join(0, world_size=3)
            details = await worker.expect_status(CODE.INVALID_ARGUMENT)
            assert "world size 3" in details and "world size 2" in details
            await healthy_step(channel)

    run(scenario)


def test_live_rank_claimed_twice() -> None:
    async def scenario() -> None:
        async with coordinator() as (running, channel):
            first, second = RawWorker(channel), RawWorker(channel)
            await first.join(0)
            await wait_until_joined(running, 0)
            await second.join(0)
            details = await second.expect_status(CODE.ALREADY_EXISTS)
            assert "rank 0" in details and "already connected" in details
            # The first claimant is unaffected: the job assembles around it.
            third = RawWorker(channel)
            await third.join(1)
            await first.expect_kind("welcome")
            await third.expect_kind("welcome")

    run(scenario)


def test_signature_mismatch_refuses_every_rank() -> None:
    async def scenario() -> None:
        async with coordinator() as (running, channel):
            good, bad = RawWorker(channel), RawWorker(channel)
            await good.join(0)
            await wait_until_joined(running, 0)
            await bad.join(1, sig=signature(weight_shape=(64, 31)))
            for worker in (good, bad):
                details = await worker.expect_status(CODE.INVALID_ARGUMENT)
                assert "rank 1" in details and "fc.weight" in details
                assert "[64, 31] float32" in details and "[64, 32] float32" in details
            await healthy_step(channel, job_id="job")  # the same job id is usable again

    run(scenario)


def test_inconsistent_signature_is_refused() -> None:
    async def scenario() -> None:
        async with coordinator() as (_, channel):
            sig = signature()
            sig.buckets[0].num_elements += 1
            worker = RawWorker(channel)
            await worker.join(0, sig=sig)
            details = await worker.expect_status(CODE.INVALID_ARGUMENT)
            assert "bucket 0 declares 2081 elements" in details and "2080" in details

    run(scenario)


def test_first_message_must_be_join() -> None:
    async def scenario() -> None:
        async with coordinator() as (_, channel):
            worker = RawWorker(channel)
            await worker.send(gradient(0, 0, bytes(CHUNK)))
            details = await worker.expect_status(CODE.FAILED_PRECONDITION)
            assert "must be a Join" in details and "gradient" in details

    run(scenario)


def test_garbage_bytes_before_join() -> None:
    async def scenario() -> None:
        async with coordinator() as (_, channel):
            worker = RawWorker(channel)
            await worker.send(b"\xff\xff\xff\xff not a protobuf")
            details = await worker.expect_status(CODE.INVALID_ARGUMENT)
            assert "do not parse" in details
            await healthy_step(channel)

    run(scenario)


async def expect_aborted(workers: list[RawWorker], culprit: int, code: int, *needles: str) -> None:
    """The culprit gets `code`, the others ABORTED naming the culprit; nothing averaged."""
    for rank, worker in enumerate(workers):
        message = await worker.expect_kind("step_aborted")
        aborted = message.step_aborted
        assert aborted.culprit_rank == culprit
        if rank == culprit:
            assert aborted.code == code, aborted
            assert aborted.reason == pb.ABORT_REASON_MESSAGE_REJECTED
        else:
            assert aborted.code == CODE.ABORTED.value[0]
            assert aborted.reason == pb.ABORT_REASON_PEER_MESSAGE_REJECTED
            assert f"rank {culprit}" in aborted.message
        for needle in needles:
            assert needle in aborted.message, (needle, aborted.message)


def in_band_case(
    bad: pb.WorkerMessage | bytes, code: grpc.StatusCode, *needles: str, partial_upload: bool = True
) -> None:
    """Rank 1 sends `bad` during step 0; the step is aborted; step 1 then works."""

    async def scenario() -> None:
        async with coordinator() as (_, channel):
            workers = await assembled_job(channel)
            if partial_upload:  # rank 0 has started the step: its buffers must be freed
                await workers[0].send(gradient(0, 0, bucket_values(0, 0).tobytes()[:CHUNK]))
            await workers[1].send(bad)
            await expect_aborted(workers, 1, code.value[0], *needles)
            # Later steps are unaffected: step 1 averages correctly.
            await run_step(workers, 1)
            for worker in workers:
                await worker.leave()
            await healthy_step(channel)

    run(scenario)


def test_future_step() -> None:
    in_band_case(
        gradient(7, 0, bytes(CHUNK)), CODE.FAILED_PRECONDITION, "future step 7", "expected step 0"
    )


def test_wrong_membership_epoch() -> None:
    in_band_case(
        gradient(0, 0, bytes(CHUNK), epoch=3),
        CODE.FAILED_PRECONDITION,
        "epoch 3",
        "expected epoch 0",
    )


def test_bucket_index_out_of_range() -> None:
    in_band_case(
        gradient(0, 0, bytes(CHUNK), bucket=4), CODE.INVALID_ARGUMENT, "bucket 4", "1 buckets"
    )


def test_dtype_mismatch() -> None:
    in_band_case(
        gradient(0, 0, bytes(CHUNK), dtype=pb.DTYPE_FLOAT64),
        CODE.INVALID_ARGUMENT,
        "bucket 0",
        "float64",
        "expected float32",
    )


def test_misaligned_offset() -> None:
    in_band_case(
        gradient(0, 100, bytes(CHUNK)), CODE.INVALID_ARGUMENT, "offset 100", f"multiples of {CHUNK}"
    )


def test_wrong_chunk_length() -> None:
    in_band_case(
        gradient(0, 2 * CHUNK, bytes(100)),
        CODE.INVALID_ARGUMENT,
        "100 bytes",
        "expected 128",
        f"{BUCKET_BYTES} bytes",
    )


def test_oversize_chunk_names_the_limit() -> None:
    in_band_case(
        gradient(0, 0, bytes(CHUNK + 1)),
        CODE.RESOURCE_EXHAUSTED,
        f"{CHUNK + 1} bytes",
        f"limit is {CHUNK} bytes",
    )


def test_garbage_bytes_after_join() -> None:
    in_band_case(b"\x0a\xff\xff\xff\xff\x0f", CODE.INVALID_ARGUMENT, "do not parse")


def test_empty_message() -> None:
    in_band_case(pb.WorkerMessage(), CODE.INVALID_ARGUMENT, "empty")


def test_duplicate_chunk() -> None:
    async def scenario() -> None:
        async with coordinator() as (_, channel):
            workers = await assembled_job(channel)
            await workers[1].send(gradient(0, 0, bytes(CHUNK)))
            await workers[1].send(gradient(0, 0, bytes(CHUNK)))
            await expect_aborted(workers, 1, CODE.INVALID_ARGUMENT.value[0], "offset 0", "twice")
            await run_step(workers, 1)

    run(scenario)


def test_stale_step_after_completion() -> None:
    async def scenario() -> None:
        async with coordinator() as (_, channel):
            workers = await assembled_job(channel)
            await run_step(workers, 0)
            await workers[0].send(gradient(0, 0, bytes(CHUNK)))
            await expect_aborted(
                workers, 0, CODE.FAILED_PRECONDITION.value[0], "stale step 0", "expected step 1"
            )
            await run_step(workers, 2)

    run(scenario)


def test_message_above_grpc_limit_is_refused_and_peers_are_told() -> None:
    async def scenario() -> None:
        async with coordinator() as (running, channel):
            workers = await assembled_job(channel)
            huge = gradient(0, 0, bytes(running.servicer.config.max_message_bytes + 1))
            await workers[1].send(huge)
            details = await workers[1].expect_status(CODE.RESOURCE_EXHAUSTED)
            assert str(running.servicer.config.max_message_bytes) in details
            aborted = (await workers[0].expect_kind("step_aborted")).step_aborted
            assert aborted.reason == pb.ABORT_REASON_PEER_LOST and "rank 1" in aborted.message
            await healthy_step(channel)

    run(scenario)


def test_buffer_budget_exhausted() -> None:
    async def scenario() -> None:
        async with coordinator(max_buffered_bytes=2 * CHUNK, max_job_buffered_bytes=2 * CHUNK) as (
            running,
            channel,
        ):
            workers = await assembled_job(channel, world_size=2)
            raw = bucket_values(1, 0).tobytes()
            # Rank 1 runs ahead of rank 0: its chunks are parked until rank 0's arrive.
            await workers[1].send(gradient(0, 0, raw[:CHUNK]))
            await workers[1].send(gradient(0, CHUNK, raw[CHUNK : 2 * CHUNK]))
            await workers[1].send(gradient(0, 2 * CHUNK, raw[2 * CHUNK :]))
            await expect_aborted(
                workers, 1, CODE.RESOURCE_EXHAUSTED.value[0], f"limit {2 * CHUNK} bytes"
            )
            assert running.servicer.budget.used == 0, "aborted step's buffers were not freed"

    run(scenario)


def test_disconnected_peer_aborts_the_step_for_the_others() -> None:
    async def scenario() -> None:
        async with coordinator() as (running, channel):
            workers = await assembled_job(channel)
            await workers[0].send(gradient(0, 0, bytes(CHUNK)))
            workers[1].call.cancel()
            aborted = (await workers[0].expect_kind("step_aborted")).step_aborted
            assert aborted.reason == pb.ABORT_REASON_PEER_LOST
            assert "rank 1 disconnected" in aborted.message and "step 0" in aborted.message
            assert running.servicer.budget.used == 0
            await healthy_step(channel)

    run(scenario)


def test_state_from_a_rank_other_than_zero_refuses_the_job() -> None:
    async def scenario() -> None:
        async with coordinator() as (_, channel):
            workers = [RawWorker(channel), RawWorker(channel)]
            for rank, worker in enumerate(workers):
                await worker.join(rank)
            for worker in workers:
                await worker.expect_kind("welcome")
            await workers[1].send(
                pb.WorkerMessage(state=pb.StateChunk(offset=0, payload=bytes(CHUNK)))
            )
            for worker in workers:
                details = await worker.expect_status(CODE.INVALID_ARGUMENT)
                assert "only rank 0 broadcasts" in details
            await healthy_step(channel)

    run(scenario)


def test_averages_are_independent_of_upload_order() -> None:
    async def scenario() -> None:
        async with coordinator(world_size=3) as (_, channel):
            results = []
            for attempt, order in enumerate(([0, 1, 2], [2, 0, 1], [1, 2, 0])):
                workers = await assembled_job(channel, job_id=f"order{attempt}", world_size=3)
                for rank in order:
                    await workers[rank].upload_bucket(0, bucket_values(rank, 0))
                results.append([await w.receive_bucket(0) for w in workers])
                for worker in workers:
                    await worker.leave()
            flat = [r.tobytes() for per_job in results for r in per_job]
            assert len(set(flat)) == 1
            assert np.isfinite(results[0][0]).all()

    run(scenario)


def int8_chunk(
    scale: float, payload: bytes = bytes(ELEMENTS), reply: int = pb.DTYPE_FLOAT32
) -> pb.WorkerMessage:
    """Step 0's one chunk of the bucket on the int8 wire (as DiLoCo's ranks send it)."""
    chunk = pb.GradientChunk(
        step=0, dtype=pb.DTYPE_INT8, reply_dtype=reply, scale=scale, payload=payload
    )  # type: ignore[arg-type]
    return pb.WorkerMessage(gradient=chunk)


def test_int8_chunks_are_answered_in_float32_with_each_ranks_scale() -> None:
    async def scenario() -> None:
        async with coordinator() as (_, channel):
            workers = await assembled_job(channel)
            sent = [int8_wire.quantize(bucket_values(r, 0), [(0, ELEMENTS)]) for r in range(2)]
            for worker, (q, scales) in zip(workers, sent, strict=True):
                await worker.send(int8_chunk(scales[0], q.tobytes()))
            total = np.zeros(ELEMENTS, dtype=np.float32)
            for q, scales in sent:  # in rank order, in float32
                total += int8_wire.dequantize(q, scales[0])
            expected = total / np.float32(2)
            for worker in workers:
                np.testing.assert_array_equal(await worker.receive_bucket(0), expected)

    run(scenario)


def test_int8_without_a_float32_reply_names_both_dtypes() -> None:
    in_band_case(
        int8_chunk(0.5, reply=pb.DTYPE_UNSPECIFIED),
        CODE.INVALID_ARGUMENT,
        "rank 1 sent bucket 0 of step 0",
        "as int8",
        "float32 only",
        partial_upload=False,  # rank 0's float32 chunk would refuse it for its dtype first
    )


def test_int8_with_a_negative_scale() -> None:
    in_band_case(
        int8_chunk(-0.5), CODE.INVALID_ARGUMENT, "offset 0", "negative scale", partial_upload=False
    )


def test_int8_payload_that_is_not_one_byte_per_element() -> None:
    in_band_case(
        int8_chunk(0.5, bytes(ELEMENTS + 1)),
        CODE.INVALID_ARGUMENT,
        f"{ELEMENTS + 1} bytes",
        f"expected {ELEMENTS}",
        partial_upload=False,
    )


def test_a_scale_on_a_float32_chunk() -> None:
    message = gradient(0, 0, bytes(CHUNK))
    message.gradient.scale = 2.0
    in_band_case(message, CODE.INVALID_ARGUMENT, "as float32 with a scale", partial_upload=False)
