"""Staggered starts, uneven inputs, 16-bit wire and ended jobs over real gRPC.

A waiting rank that heartbeats outlives the heartbeat timeout; a silent one
is dropped without failing the job and may join again; a refused join is
reported to the ranks that wait; a rank lost before the state broadcast
fails the others at once. Uneven inputs and float16 buckets complete as
agreed, and `Status` keeps a finished job's outcome.
"""

from __future__ import annotations

import grpc
import numpy as np
from gradsync_proto.v1 import gradsync_pb2 as pb
from support.rawclient import (
    BUCKET_BYTES,
    CHUNK,
    RawWorker,
    assembled_job,
    bucket_values,
    coordinator,
    gradient,
    run,
    wait_until_joined,
)
from support.waiting import eventually


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_waiting_rank_that_heartbeats_stays_and_a_silent_one_is_dropped() -> None:
    async def scenario() -> None:
        async with coordinator(world_size=3, heartbeat_timeout_s=5.0) as (running, channel):
            clock = FakeClock()
            running.servicer.clock = clock
            alive, silent = RawWorker(channel), RawWorker(channel)
            await alive.join(0, world_size=3)
            first = (await alive.expect_kind("assembly")).assembly
            assert list(first.missing_ranks) == [1, 2] and first.heartbeat_interval_s > 0
            await wait_until_joined(running, 0)
            await silent.join(1, world_size=3)
            await wait_until_joined(running, 1)
            assert list((await alive.expect_kind("assembly")).assembly.joined_ranks) == [0, 1]
            for _ in range(3):  # 12 s of waiting, far past the heartbeat timeout
                clock.now += 4.0
                await alive.send(pb.WorkerMessage(heartbeat=pb.Heartbeat(step=0)))
                await alive.settle(running)
                running.servicer.check_liveness()
            end = (await silent.expect_kind("stream_end")).stream_end
            assert end.reason == pb.END_REASON_DECLARED_DEAD
            dropped = (await alive.expect_kind("assembly")).assembly
            assert list(dropped.joined_ranks) == [0] and list(dropped.missing_ranks) == [1, 2]
            # The periodic report (10 s after the last message) tells who is missing.
            clock.now += 10.5
            await alive.send(pb.WorkerMessage(heartbeat=pb.Heartbeat(step=0)))
            await alive.settle(running)
            running.servicer.check_liveness()
            report = (await alive.expect_kind("assembly")).assembly
            assert report.waited_s >= 22.0 and list(report.missing_ranks) == [1, 2]
            # The dropped rank joins again, a third arrives: the job assembles.
            again, last = RawWorker(channel), RawWorker(channel)
            await again.join(1, world_size=3)
            await last.join(2, world_size=3)
            for worker in (alive, again, last):
                await worker.expect_kind("welcome")

    run(scenario)


def test_a_refused_join_is_reported_to_the_waiting_ranks() -> None:
    async def scenario() -> None:
        async with coordinator(world_size=2) as (running, channel):
            waiting, wrong = RawWorker(channel), RawWorker(channel)
            await waiting.join(0)
            await waiting.expect_kind("assembly")
            await wait_until_joined(running, 0)
            await wrong.join(1, world_size=3)
            await wrong.expect_status(grpc.StatusCode.INVALID_ARGUMENT)
            refused = (await waiting.expect_kind("assembly")).assembly.refused
            assert refused.startswith("rank 1: ") and "world size 3" in refused

    run(scenario)


def test_a_rank_lost_before_the_state_broadcast_fails_the_others_at_once() -> None:
    async def scenario() -> None:
        async with coordinator(world_size=2) as (_, channel):
            workers = [RawWorker(channel) for _ in range(2)]
            for rank, worker in enumerate(workers):
                await worker.join(rank)
            for worker in workers:
                await worker.expect_kind("welcome")
            workers[0].call.cancel()  # rank 0 dies while serializing its state
            end = (await workers[1].expect_kind("stream_end")).stream_end
            assert end.reason == pb.END_REASON_PEER_LOST
            assert "before rank 0's initial state broadcast completed" in end.message
            await workers[1].expect_status(grpc.StatusCode.ABORTED)

    run(scenario)


def test_uneven_inputs_over_grpc() -> None:
    async def scenario() -> None:
        async with coordinator(world_size=2) as (_, channel):
            workers = await assembled_job(channel)
            await workers[1].send(pb.WorkerMessage(out_of_inputs=pb.OutOfInputs(step=0)))
            progress = (await workers[1].expect_kind("join_progress")).join_progress
            assert list(progress.joined_ranks) == [1] and progress.next_step == 0
            values = bucket_values(0, 0)
            await workers[0].upload_bucket(0, values)
            averaged = await workers[0].receive_bucket(0)
            np.testing.assert_array_equal(averaged, values / np.float32(2))  # world size
            progress = (await workers[1].expect_kind("join_progress")).join_progress
            assert progress.next_step == 1 and not progress.all_joined
            await workers[0].send(pb.WorkerMessage(out_of_inputs=pb.OutOfInputs(step=1)))
            for worker in workers:
                done = (await worker.expect_kind("join_progress")).join_progress
                assert done.all_joined and done.last_joiner == 0 and done.next_step == 1
            for worker in workers:
                await worker.leave()

    run(scenario)


def test_float16_wire_over_grpc_and_the_finished_job_in_status() -> None:
    async def scenario() -> None:
        async with coordinator(world_size=2) as (running, channel):
            workers = await assembled_job(channel)
            halves = [bucket_values(rank, 0).astype(np.float16) for rank in range(2)]
            for rank, worker in enumerate(workers):
                raw = halves[rank].tobytes()  # 4160 bytes: chunks of 4096 and 64
                for offset in range(0, len(raw), CHUNK):
                    chunk = gradient(
                        0, offset, raw[offset : offset + CHUNK], dtype=pb.DTYPE_FLOAT16
                    )
                    await worker.send(chunk)
            expected = (
                (halves[0].astype(np.float32) + halves[1].astype(np.float32)) / np.float32(2)
            ).astype(np.float16)
            for worker in workers:
                result = bytearray(BUCKET_BYTES // 2)
                for _ in range(2):
                    chunk = (await worker.expect_kind("gradient")).gradient
                    assert chunk.dtype == pb.DTYPE_FLOAT16
                    result[chunk.offset : chunk.offset + len(chunk.payload)] = chunk.payload
                np.testing.assert_array_equal(np.frombuffer(bytes(result), np.float16), expected)
            for worker in workers:
                await worker.leave()
            request = pb.StatusRequest(job_id="job").SerializeToString()

            async def ended_in_status() -> bool:
                reply = await running.servicer.status(request, None)  # type: ignore[arg-type]
                return any(job.ended for job in reply.jobs)

            await eventually(ended_in_status, "the finished job in Status")
            reply = await running.servicer.status(request, None)  # type: ignore[arg-type]
            (ended,) = reply.jobs
            assert (ended.state, ended.ended, ended.outcome) == (
                "finished",
                True,
                "finished after 1 steps",
            )

    run(scenario)
