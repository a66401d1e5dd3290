"""Every stream the coordinator ends with an error is announced by a StreamEnd naming the cause.

The status code alone cannot tell "you were declared dead" from "the
coordinator is going away"; the StreamEnd sent just before the status can, and
UNAVAILABLE is reserved for the coordinator going away. (Declared dead is
covered in test_liveness.py.)
"""

from __future__ import annotations

import asyncio

import grpc
from gradsync_proto.v1 import gradsync_pb2 as pb
from gradsync_server.app import start
from gradsync_server.config import CoordinatorConfig
from support.rawclient import (
    CHUNK,
    RawWorker,
    assembled_job,
    coordinator,
    run,
    signature,
    wait_until_joined,
)


async def expect_end(worker: RawWorker, reason: int, code: grpc.StatusCode) -> pb.StreamEnd:
    """The StreamEnd must be the stream's last message and agree with its status."""
    end = (await worker.expect_kind("stream_end")).stream_end
    details = await worker.expect_status(code)
    assert (end.reason, end.code, end.message) == (reason, code.value[0], details)
    return end


def test_a_refused_job_ends_every_stream_as_refused() -> None:
    async def scenario() -> None:
        async with coordinator() as (_, channel):
            first, second = RawWorker(channel), RawWorker(channel)
            await first.join(0)
            await second.join(1, sig=signature(weight_shape=(63, 32)))
            for worker in (first, second):
                end = await expect_end(
                    worker, pb.END_REASON_JOB_REFUSED, grpc.StatusCode.INVALID_ARGUMENT
                )
                assert "signatures differ" in end.message

    run(scenario)


def test_too_many_jobs_is_resource_exhausted() -> None:
    async def scenario() -> None:
        async with coordinator(max_jobs=1) as (running, channel):
            first = RawWorker(channel)
            await first.join(0, job_id="one")
            await wait_until_joined(running, 0, "one")
            late = RawWorker(channel)
            await late.join(0, job_id="two")
            end = await expect_end(
                late, pb.END_REASON_RESOURCE_EXHAUSTED, grpc.StatusCode.RESOURCE_EXHAUSTED
            )
            assert "limit 1" in end.message

    run(scenario)


def test_a_message_refused_alone_carries_no_special_reason() -> None:
    async def scenario() -> None:
        async with coordinator() as (_, channel):
            worker = RawWorker(channel)
            await worker.send(pb.WorkerMessage(heartbeat=pb.Heartbeat(step=0)))
            await expect_end(worker, pb.END_REASON_UNSPECIFIED, grpc.StatusCode.FAILED_PRECONDITION)

    run(scenario)


def test_a_join_while_draining_is_refused_as_shutting_down() -> None:
    async def scenario() -> None:
        async with coordinator() as (running, channel):
            running.servicer.draining = True  # as Running.stop sets it first
            worker = RawWorker(channel)
            await worker.join(0)
            await expect_end(worker, pb.END_REASON_SHUTTING_DOWN, grpc.StatusCode.UNAVAILABLE)

    run(scenario)


def test_shutdown_ends_open_streams_as_shutting_down() -> None:
    async def scenario() -> None:
        config = CoordinatorConfig(
            world_size=2, host="127.0.0.1", port=0, chunk_bytes=CHUNK, shutdown_grace_s=0.2
        )
        running = await start(config)
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{running.port}")
        try:
            workers = await assembled_job(channel)
            stopping = asyncio.create_task(running.stop())
            for worker in workers:
                end = await expect_end(
                    worker, pb.END_REASON_SHUTTING_DOWN, grpc.StatusCode.UNAVAILABLE
                )
                assert "shutting down" in end.message
            await asyncio.wait_for(stopping, timeout=5)
        finally:
            await channel.close()

    run(scenario)
