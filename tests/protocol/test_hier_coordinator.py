"""Hierarchical aggregation at a real coordinator over gRPC, with hand-driven workers.

Ranks 0 and 1 join with one host id and rank 2 with none: the coordinator
must announce the group in the Welcomes, average rank 0's partial sum
(covering ranks 0 and 1) with rank 2's gradient over all three ranks, send
the averages to the unit leaders only, refuse a follower's upload and bad
covers naming the values, refuse a LOCAL_WORLD_SIZE the groups contradict
and a malformed host id, and do all of it the same through a coordinator shard.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import grpc
import numpy as np
from gradsync_proto import auth, chunking
from gradsync_proto.v1 import gradsync_pb2 as pb
from gradsync_server.app import Running, start
from gradsync_server.config import CoordinatorConfig, Role
from support.rawclient import (
    BUCKET_BYTES,
    CHUNK,
    RawWorker,
    bucket_values,
    coordinator,
    run,
)
from support.rawgroups import hier_job, join_message

ELEMENTS = BUCKET_BYTES // 4


def gradient(
    step: int, offset: int, payload: bytes, covered: tuple[int, ...] = ()
) -> pb.WorkerMessage:
    chunk = pb.GradientChunk(
        step=step,
        offset=offset,
        dtype=pb.DTYPE_FLOAT32,
        payload=payload,
        covered_ranks=covered,
    )
    return pb.WorkerMessage(gradient=chunk)


async def upload(
    worker: RawWorker,
    step: int,
    values: np.ndarray,
    covered: tuple[int, ...] = (),
    span: tuple[int, int] = (0, BUCKET_BYTES),
) -> None:
    raw = values.astype("<f4").tobytes()
    for offset, length in chunking.range_chunk_spans(span[0], span[1], CHUNK):
        await worker.send(gradient(step, offset, raw[offset : offset + length], covered))


async def receive(
    worker: RawWorker, span: tuple[int, int] = (0, BUCKET_BYTES)
) -> tuple[bytes, set[int]]:
    """The averaged bytes of `span` of bucket 0, and the contributors they name."""
    result = bytearray(span[1] - span[0])
    received, contributors = 0, set()
    while received < len(result):
        chunk = (await worker.expect_kind("gradient")).gradient
        result[chunk.offset - span[0] : chunk.offset - span[0] + len(chunk.payload)] = chunk.payload
        received += len(chunk.payload)
        contributors.add(chunk.contributors)
    return bytes(result), contributors


def expected_average(step: int) -> np.ndarray:
    partial = bucket_values(0, step) + bucket_values(1, step)  # the host's sum, local rank order
    return ((partial + bucket_values(2, step)) / np.float32(3)).astype("<f4")


# ------------------------------------------------------------------ tests
def test_groups_form_from_host_ids_and_a_partial_sum_averages_over_every_rank() -> None:
    async def scenario() -> None:
        async with coordinator(world_size=3) as (_, channel):
            workers, welcomes = await hier_job(channel)
            assert [list(w.local_ranks) for w in welcomes] == [[0, 1], [0, 1], []]
            assert len(welcomes[0].local_secret) == 32
            assert welcomes[0].local_secret == welcomes[1].local_secret
            assert welcomes[2].local_secret == b""
            partial = bucket_values(0, 0) + bucket_values(1, 0)
            await upload(workers[2], 0, bucket_values(2, 0))
            await upload(workers[0], 0, partial, covered=(0, 1))
            for leader in (workers[0], workers[2]):
                result, contributors = await receive(leader)
                assert result == expected_average(0).tobytes() and contributors == {3}
            # The follower heard no average: its next message is step 1's abort.
            await workers[1].send(gradient(1, 0, bytes(CHUNK)))
            aborted = (await workers[1].expect_kind("step_aborted")).step_aborted
            assert aborted.step == 1 and aborted.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
            assert "rank 1 sent bucket 0 of step 1" in aborted.message
            assert "only its local leader, rank 0, uploads" in aborted.message
            for leader in (workers[0], workers[2]):
                assert (await leader.expect_kind("step_aborted")).step_aborted.step == 1

    run(scenario)


def test_bad_covers_abort_the_step_naming_the_covers_and_the_group() -> None:
    async def scenario() -> None:
        async with coordinator(world_size=3) as (_, channel):
            workers, _ = await hier_job(channel)
            await workers[0].send(gradient(0, 0, bytes(CHUNK), covered=(0, 2)))
            aborted = (await workers[0].expect_kind("step_aborted")).step_aborted
            assert aborted.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
            assert aborted.culprit_rank == 0 and aborted.bucket_index == 0
            assert "rank 0 sent bucket 0 of step 0 covering ranks [0, 2]" in aborted.message
            assert "outside its local group [0, 1]" in aborted.message
            assert (await workers[2].expect_kind("step_aborted")).step_aborted.step == 0
            await workers[2].send(gradient(1, 0, bytes(CHUNK), covered=(1, 2)))
            aborted = (await workers[2].expect_kind("step_aborted")).step_aborted
            assert aborted.step == 1 and "covering ranks [1, 2]" in aborted.message
            assert "aggregates flat (local group [2])" in aborted.message

    run(scenario)


def test_a_local_world_size_the_groups_contradict_refuses_the_job() -> None:
    async def scenario() -> None:
        async with coordinator(world_size=2) as (_, channel):
            workers = [RawWorker(channel) for _ in range(2)]
            await workers[0].send(join_message(0, "host-a", 2, local_world_size=2))
            await workers[1].send(join_message(1, "host-b", 2, local_world_size=2))
            for worker in workers:
                details = await worker.expect_status(grpc.StatusCode.FAILED_PRECONDITION)
                assert "rank 0 on host_id 'host-a' has LOCAL_WORLD_SIZE 2" in details
                assert "found 1 rank(s) with that host_id: [0]" in details

    run(scenario)


def test_a_malformed_host_id_is_refused_at_join_naming_the_rank() -> None:
    async def scenario() -> None:
        async with coordinator(world_size=2) as (_, channel):
            worker = RawWorker(channel)
            await worker.send(join_message(1, "h" * 300, 2))
            details = await worker.expect_status(grpc.StatusCode.INVALID_ARGUMENT)
            assert "rank 1 sent Join.host_id" in details and "256" in details

    run(scenario)


class DataStream(RawWorker):
    """A raw `Shard.Data` stream, read and written as a worker's Sync stream is."""

    def __init__(self, channel: grpc.aio.Channel) -> None:
        self.call = channel.stream_stream(
            "/gradsync.v1.Shard/Data",
            request_serializer=lambda raw: raw,
            response_deserializer=pb.CoordinatorMessage.FromString,
        )()
        self.assembly: list[pb.AssemblyProgress] = []
        self.step_reports: list[pb.StepReport] = []


@contextlib.asynccontextmanager
async def leader_and_shard(
    world_size: int,
) -> AsyncIterator[tuple[Running, Running, grpc.aio.Channel]]:
    async with coordinator(world_size=world_size, shard_count=2) as (running, channel):
        config = CoordinatorConfig(
            role=Role.SHARD,
            leader=f"127.0.0.1:{running.port}",
            host="127.0.0.1",
            port=0,
            chunk_bytes=CHUNK,
            register_timeout_s=2.0,
            reconnect_backoff_max_s=0.2,
        )
        shard = await start(config)
        try:
            await shard.wait_registered(5)
            yield running, shard, channel
        finally:
            await shard.stop()


def test_a_partial_sum_averages_right_through_two_shards() -> None:
    async def scenario() -> None:
        async with leader_and_shard(3) as (_, shard, channel):
            workers, welcomes = await hier_job(channel)
            shard_channel = grpc.aio.insecure_channel(f"127.0.0.1:{shard.port}")
            try:
                streams = {}
                for rank in (0, 2):  # the unit leaders: followers upload nothing
                    stream = DataStream(shard_channel)
                    hello = pb.ShardHello(
                        job_id="job",
                        rank=rank,
                        incarnation=f"test-{rank}",
                        shard_index=1,
                        session=auth.shard_session(welcomes[rank].session, 1),
                    )
                    await stream.send(pb.WorkerMessage(shard_hello=hello))
                    streams[rank] = stream
                spans = [chunking.shard_byte_range(ELEMENTS, 4, 2, i) for i in range(2)]
                partial = bucket_values(0, 0) + bucket_values(1, 0)
                for rank, values, covered in ((2, bucket_values(2, 0), ()), (0, partial, (0, 1))):
                    await upload(workers[rank], 0, values, covered, spans[0])
                    await upload(streams[rank], 0, values, covered, spans[1])
                expected = expected_average(0).tobytes()
                for rank in (0, 2):
                    for source, (lo, hi) in ((workers[rank], spans[0]), (streams[rank], spans[1])):
                        result, contributors = await receive(source, (lo, hi))
                        assert result == expected[lo:hi] and contributors == {3}
                for stream in streams.values():
                    stream.call.cancel()
            finally:
                await shard_channel.close()

    run(scenario)


def test_local_posted_is_refused_from_a_flat_rank_and_for_a_missing_bucket() -> None:
    async def scenario() -> None:
        async with coordinator(world_size=3) as (_, channel):
            workers, _ = await hier_job(channel)
            # A member's notice for a real bucket of the open step is accepted silently.
            await workers[1].send(pb.WorkerMessage(local_posted=pb.LocalPosted(bucket_index=0)))
            await workers[2].send(pb.WorkerMessage(local_posted=pb.LocalPosted(bucket_index=0)))
            message = await workers[2].expect_status(grpc.StatusCode.INVALID_ARGUMENT)
            assert "rank 2" in message and "bucket 0" in message, message
            await workers[1].send(pb.WorkerMessage(local_posted=pb.LocalPosted(bucket_index=7)))
            message = await workers[1].expect_status(grpc.StatusCode.INVALID_ARGUMENT)
            assert "rank 1" in message and "bucket 7" in message, message

    run(scenario)


def test_a_followers_late_notice_of_a_finished_step_aborts_nothing_after_a_peer_left() -> None:
    """A follower posts into shared memory first and tells the coordinator after, so its
    LocalPosted can arrive once its step is averaged and a peer has left (the job
    finishing). That notice is about a completed step: answering it with an abort failed a
    rank whose step had succeeded (seen in test_staggered_start). Only a notice for a step
    that can no longer complete is answered with the abort."""

    async def scenario() -> None:
        async with coordinator(world_size=3) as (_, channel):
            workers, _ = await hier_job(channel)
            await upload(workers[2], 0, bucket_values(2, 0))
            await upload(workers[0], 0, bucket_values(0, 0) + bucket_values(1, 0), covered=(0, 1))
            for leader in (workers[0], workers[2]):
                result, _ = await receive(leader)
                assert result == expected_average(0).tobytes()
            await workers[2].send(pb.WorkerMessage(leave=pb.Leave(reason="done")))
            await workers[2].expect_status(grpc.StatusCode.OK)
            late = pb.LocalPosted(step=0, bucket_index=0)
            await workers[1].send(pb.WorkerMessage(local_posted=late))
            next_step = pb.LocalPosted(step=1, bucket_index=0)
            await workers[1].send(pb.WorkerMessage(local_posted=next_step))
            aborted = (await workers[1].expect_kind("step_aborted")).step_aborted
            assert aborted.step == 1, aborted  # not step 0, which completed
            assert "rank 2 left job" in aborted.message and "after step 0" in aborted.message

    run(scenario)
