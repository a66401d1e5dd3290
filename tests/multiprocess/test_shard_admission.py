"""A real shard refuses data streams it cannot admit within moments, not a heartbeat timeout.

A real `gradsync serve --shards 2` (its shard 1 a real `gradsync shard` child) with a
30 s heartbeat timeout, as the review ran it (a shard used to hold such a stream for
all of it); two raw workers join a job, so the shard knows it.
Hand-made `Shard.Data` streams then name a job nobody started, a rank the job does
not have, and a member's rank with an incarnation the leader never announced: each is
refused within 2.5 s (a shard waits only a short grace for the leader's view of a job
or rank it has not heard of, and judges a member at once), naming rank, job and
incarnations and never the session. A member's own hello is admitted (issue 22).
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import grpc
import pytest
from gradsync.path.shard_streams import SHARD_DATA_METHOD, shard_target
from gradsync_proto import auth
from gradsync_proto.v1 import gradsync_pb2 as pb
from support.rawclient import RawWorker, run
from support.shards import wait_for_shards

#: Longest a refusal may take: the shard's grace for a view (1 s) plus a loaded machine.
REFUSED_WITHIN_S = 2.5


async def _heartbeats(workers: list[RawWorker]) -> None:
    """Keep the job's ranks alive at the leader (raw workers send nothing by themselves)."""
    while True:
        for worker in workers:
            await worker.send(pb.WorkerMessage(heartbeat=pb.Heartbeat(step=0)))
        await asyncio.sleep(0.25)


async def _refusal(target: str, hello: pb.ShardHello) -> tuple[grpc.StatusCode, str, float]:
    """Open a data stream with `hello`; (status, details, seconds from hello to the end)."""
    async with grpc.aio.insecure_channel(target) as channel:
        await asyncio.wait_for(channel.channel_ready(), 10)  # time the hello, not the connect
        call = channel.stream_stream(
            SHARD_DATA_METHOD,
            request_serializer=lambda raw: raw,
            response_deserializer=pb.CoordinatorMessage.FromString,
        )()
        started = time.monotonic()
        await call.write(pb.WorkerMessage(shard_hello=hello).SerializeToString())
        with contextlib.suppress(grpc.aio.AioRpcError):
            while await asyncio.wait_for(call.read(), 10) is not grpc.aio.EOF:
                pass
        code = await call.code()
        return code, await call.details(), time.monotonic() - started


async def _admitted(target: str, hello: pb.ShardHello) -> bool:
    """Whether a stream with `hello` is still open a while after it (then it says goodbye)."""
    async with grpc.aio.insecure_channel(target) as channel:
        call = channel.stream_stream(
            SHARD_DATA_METHOD,
            request_serializer=lambda raw: raw,
            response_deserializer=pb.CoordinatorMessage.FromString,
        )()
        await call.write(pb.WorkerMessage(shard_hello=hello).SerializeToString())
        # Not wait_for: cancelling a read cancels the whole call.
        reading = asyncio.ensure_future(call.read())
        done, _ = await asyncio.wait({reading}, timeout=2 * REFUSED_WITHIN_S)
        if done:
            raise AssertionError(f"a member's data stream got {reading.result()}")
        leave = pb.WorkerMessage(leave=pb.Leave(reason="test done"))
        await call.write(leave.SerializeToString())
        await call.done_writing()
        assert await asyncio.wait_for(reading, 5) is grpc.aio.EOF
        return await asyncio.wait_for(call.code(), 5) == grpc.StatusCode.OK


@pytest.mark.timeout(120)
def test_streams_a_shard_cannot_admit_are_refused_within_moments(coordinator_factory) -> None:
    leader = coordinator_factory(2, "--shards", "2", "--heartbeat-timeout", "30")
    wait_for_shards(leader.address, 2, 60)

    async def scenario() -> None:
        async with grpc.aio.insecure_channel(leader.address) as channel:
            workers = [RawWorker(channel) for _ in range(2)]
            for rank, worker in enumerate(workers):
                await worker.join(rank, world_size=2)
            welcomes = [(await worker.expect_kind("welcome")).welcome for worker in workers]
            alive = asyncio.create_task(_heartbeats(workers))
            (shard,) = [s for s in welcomes[0].shards if s.index == 1]
            target = shard_target(shard.address, leader.address)
            # What rank 1 presents to shard 1: that shard's derivative of its session.
            session = auth.shard_session(welcomes[1].session, 1)

            def hello(job_id: str, rank: int, incarnation: str) -> pb.ShardHello:
                return pb.ShardHello(
                    job_id=job_id,
                    rank=rank,
                    incarnation=incarnation,
                    shard_index=1,
                    session=session,
                )

            cases = {
                "unknown job": (hello("no-such-job", 1, "test-1"), ["'no-such-job'", "rank 1"]),
                "not a member": (hello("job", 7, "test-7"), ["rank 7", "job 'job'"]),
                "unknown incarnation": (
                    hello("job", 1, "forged"),
                    ["rank 1", "job 'job'", "'forged'", "'test-1'"],
                ),
            }
            timings = {}
            for case, (message, needles) in cases.items():
                code, details, seconds = await _refusal(target, message)
                timings[case] = seconds
                assert code == grpc.StatusCode.FAILED_PRECONDITION, (case, code, details)
                for needle in needles:
                    assert needle in details, (case, needle, details)
                assert session.hex() not in details and repr(session) not in details
            slow = {case: f"{s:.1f} s" for case, s in timings.items() if s > REFUSED_WITHIN_S}
            assert not slow, f"refused only after {slow}"
            # The member itself, on its own session, is admitted.
            assert await _admitted(target, hello("job", 1, "test-1"))
            alive.cancel()
            await asyncio.gather(alive, return_exceptions=True)

    run(scenario, timeout_s=60)
