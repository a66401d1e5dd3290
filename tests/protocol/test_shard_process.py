"""A coordinator shard over real gRPC, driven by a fake leader and hand-driven data streams.

The fake leader serves `Coordinator.ShardLink` in-process and sends exactly
the views, aborts and job ends a test wants; the workers are raw `Shard.Data`
streams. Together they pin the shard's side of the contract: registration,
admission by (rank, incarnation), averaging bitwise as one coordinator would,
refusals reported to the leader, and every way a data stream ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import urllib.request
from collections.abc import AsyncIterator

import grpc
import numpy as np
import pytest
from gradsync import __version__
from gradsync_proto import chunking
from gradsync_proto.v1 import gradsync_pb2 as pb
from gradsync_server.app import EXIT_REFUSED, Running, serve, start
from gradsync_server.config import CoordinatorConfig, Role
from support.rawclient import run

CHUNK = 4096
ELEMENTS = 3000  # shard 1 of 2 holds elements 1500..3000: bytes 6000..12000 as float32
HEARTBEAT_INTERVAL_S = 0.2
HEARTBEAT_TIMEOUT_S = 2.0


class FakeLeader:
    """A `Coordinator.ShardLink` server that accepts (or refuses) and sends what tests queue."""

    def __init__(self, refuse: str | None = None) -> None:
        self.refuse = refuse
        self.registers: list[pb.ShardRegister] = []
        self.received: asyncio.Queue[pb.ShardMessage] = asyncio.Queue()
        self.outbox: asyncio.Queue[pb.LeaderMessage | None] = asyncio.Queue()
        self.connected = asyncio.Event()
        #: Stop the heartbeats (the stream stays open): the shard must notice the silence.
        self.silent = False
        self.server = grpc.aio.server()
        self.server.add_generic_rpc_handlers(
            (
                grpc.method_handlers_generic_handler(
                    "gradsync.v1.Coordinator",
                    {
                        "ShardLink": grpc.stream_stream_rpc_method_handler(
                            self.link,
                            request_deserializer=pb.ShardMessage.FromString,
                            response_serializer=pb.LeaderMessage.SerializeToString,
                        )
                    },
                ),
            )
        )
        self.port = self.server.add_insecure_port("127.0.0.1:0")

    async def link(
        self, requests: AsyncIterator[pb.ShardMessage], context: grpc.aio.ServicerContext
    ) -> None:
        first = await anext(aiter(requests))
        self.registers.append(first.register)
        if self.refuse is not None:
            end = pb.StreamEnd(
                code=grpc.StatusCode.FAILED_PRECONDITION.value[0], message=self.refuse
            )
            await context.write(pb.LeaderMessage(stream_end=end))
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, self.refuse)
        accepted = pb.ShardAccepted(
            shard_index=1,
            shard_count=2,
            heartbeat_interval_s=HEARTBEAT_INTERVAL_S,
            heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S,
        )
        await context.write(pb.LeaderMessage(accepted=accepted))
        self.connected.set()

        async def read() -> None:
            async for message in requests:
                await self.received.put(message)

        reader = asyncio.create_task(read())
        try:
            while True:
                try:
                    item = await asyncio.wait_for(self.outbox.get(), HEARTBEAT_INTERVAL_S)
                except TimeoutError:
                    if self.silent:
                        continue
                    item = pb.LeaderMessage(heartbeat=pb.Heartbeat())
                if item is None:
                    return  # the test ends the control stream: the leader is "lost"
                await context.write(item)
        finally:
            self.connected.clear()
            reader.cancel()
            await asyncio.gather(reader, return_exceptions=True)

    async def next_of(self, kind: str, timeout_s: float = 5.0) -> pb.ShardMessage:
        """The next message of `kind` from the shard (stats are skipped unless asked for)."""
        while True:
            message = await asyncio.wait_for(self.received.get(), timeout_s)
            if message.WhichOneof("kind") == kind:
                return message


def job_view(
    members: dict[int, str], epoch: int = 0, job_id: str = "job", elements: int = ELEMENTS
) -> pb.LeaderMessage:
    view = pb.ShardJobView(
        job_id=job_id,
        world_size=len(members),
        membership_epoch=epoch,
        members=[pb.ShardMember(rank=r, incarnation=i) for r, i in members.items()],
        start_step=0,
        buckets=[pb.BucketSpec(dtype=pb.DTYPE_FLOAT32, num_elements=elements)],
        chunk_bytes=CHUNK,
        shard_count=2,
    )
    return pb.LeaderMessage(job=view)


class DataWorker:
    """One raw `Shard.Data` stream."""

    def __init__(self, channel: grpc.aio.Channel) -> None:
        self.call = channel.stream_stream(
            "/gradsync.v1.Shard/Data",
            request_serializer=lambda raw: raw,
            response_deserializer=pb.CoordinatorMessage.FromString,
        )()

    async def send(self, message: pb.WorkerMessage) -> None:
        await asyncio.wait_for(self.call.write(message.SerializeToString()), 5)

    async def hello(self, rank: int, incarnation: str, job_id: str = "job", index: int = 1) -> None:
        hello = pb.ShardHello(job_id=job_id, rank=rank, incarnation=incarnation, shard_index=index)
        await self.send(pb.WorkerMessage(shard_hello=hello))

    async def upload(self, step: int, values: np.ndarray, offsets: list[int] | None = None) -> None:
        raw = values.astype("<f4").tobytes()
        lo, hi = chunking.shard_byte_range(len(values), 4, 2, 1)
        for offset, length in chunking.range_chunk_spans(lo, hi, CHUNK):
            if offsets is not None and offset not in offsets:
                continue
            chunk = pb.GradientChunk(
                step=step,
                bucket_index=0,
                offset=offset,
                dtype=pb.DTYPE_FLOAT32,
                payload=raw[offset : offset + length],
            )
            await self.send(pb.WorkerMessage(gradient=chunk))

    async def receive_range(self, step: int) -> bytes:
        lo, hi = chunking.shard_byte_range(ELEMENTS, 4, 2, 1)
        result = bytearray(hi - lo)
        received = 0
        while received < hi - lo:
            message = await asyncio.wait_for(self.call.read(), 5)
            assert message is not grpc.aio.EOF, "the stream ended"
            assert message.WhichOneof("kind") == "gradient", message
            chunk = message.gradient
            assert chunk.step == step
            result[chunk.offset - lo : chunk.offset - lo + len(chunk.payload)] = chunk.payload
            received += len(chunk.payload)
        return bytes(result)

    async def expect_end(self, code: grpc.StatusCode, reason: int | None = None) -> str:
        """Read to the end: a StreamEnd (for an error) agreeing with the status; the details."""
        end = None
        with contextlib.suppress(grpc.aio.AioRpcError):
            while True:
                message = await asyncio.wait_for(self.call.read(), 5)
                if message is grpc.aio.EOF:
                    break
                if message.WhichOneof("kind") == "stream_end":
                    end = message.stream_end
        status = await asyncio.wait_for(self.call.code(), 5)
        details: str = await self.call.details()
        assert status == code, (status, details)
        if code != grpc.StatusCode.OK:
            assert end is not None, "an error end is announced by a StreamEnd"
            assert (end.code, end.message) == (code.value[0], details)
            if reason is not None:
                assert end.reason == reason
        return details


@contextlib.asynccontextmanager
async def shard_and_leader(
    refuse: str | None = None, metrics_port: int | None = None
) -> AsyncIterator[tuple[Running, FakeLeader, grpc.aio.Channel]]:
    leader = FakeLeader(refuse)
    await leader.server.start()
    config = CoordinatorConfig(
        role=Role.SHARD,
        leader=f"127.0.0.1:{leader.port}",
        port=0,
        chunk_bytes=CHUNK,
        register_timeout_s=2.0,
        reconnect_backoff_max_s=0.2,
        metrics_port=metrics_port,
    )
    running = await start(config)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{running.port}")
    try:
        if refuse is None:
            await running.wait_registered(5)
        yield running, leader, channel
    finally:
        await channel.close()
        await running.stop()
        await leader.server.stop(0)


def values_of(rank: int, step: int) -> np.ndarray:
    return np.random.default_rng(10 * rank + step).standard_normal(ELEMENTS).astype(np.float32)


async def view_applied(running: Running, job_id: str = "job") -> None:
    for _ in range(500):
        if job_id in running.servicer.jobs:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"the shard never learned job {job_id!r}")


async def joined_workers(
    running: Running, leader: FakeLeader, channel: grpc.aio.Channel
) -> list[DataWorker]:
    await leader.outbox.put(job_view({0: "a", 1: "b"}))
    await view_applied(running)
    workers = [DataWorker(channel), DataWorker(channel)]
    for rank, worker in enumerate(workers):
        await worker.hello(rank, "ab"[rank])
    for _ in range(500):
        if running.servicer.connection_count() == 2:
            return workers
        await asyncio.sleep(0.01)
    raise AssertionError("the data streams were not admitted")


# ------------------------------------------------------------------ tests
def test_a_shard_registers_and_sends_stats_every_heartbeat() -> None:
    async def scenario() -> None:
        async with shard_and_leader() as (running, leader, _):
            register = leader.registers[0]
            assert register.version == __version__
            assert register.advertise == f"127.0.0.1:{running.port}"
            assert register.chunk_bytes == CHUNK
            assert register.max_message_bytes == CHUNK + chunking.HEADER_SLACK_BYTES
            assert running.servicer.index == 1
            await leader.next_of("stats", timeout_s=1.0)
            await leader.next_of("stats", timeout_s=1.0)

    run(scenario)


def test_data_streams_are_admitted_only_for_announced_ranks_and_incarnations() -> None:
    async def scenario() -> None:
        async with shard_and_leader() as (running, leader, channel):
            # A hello that arrives before the leader's view waits for it.
            early = DataWorker(channel)
            await early.hello(0, "a")
            await asyncio.sleep(0.1)
            await leader.outbox.put(job_view({0: "a", 1: "b"}))
            for _ in range(500):
                if running.servicer.connection_count() == 1:
                    break
                await asyncio.sleep(0.01)
            assert running.servicer.connection_count() == 1

            impostor = DataWorker(channel)
            await impostor.hello(1, "not-b")
            details = await impostor.expect_end(grpc.StatusCode.FAILED_PRECONDITION)
            assert "'not-b'" in details and "'b'" in details

            lost = DataWorker(channel)
            await lost.hello(1, "b", index=2)
            details = await lost.expect_end(grpc.StatusCode.INVALID_ARGUMENT)
            assert "shard 2" in details and f"shard 1 at 127.0.0.1:{running.port}" in details

            stranger = DataWorker(channel)
            await stranger.hello(0, "a", job_id="other")
            details = await stranger.expect_end(grpc.StatusCode.FAILED_PRECONDITION)
            assert "does not know job 'other'" in details

            rude = DataWorker(channel)
            await rude.send(pb.WorkerMessage(heartbeat=pb.Heartbeat()))
            details = await rude.expect_end(grpc.StatusCode.FAILED_PRECONDITION)
            assert "must be a ShardHello" in details

    run(scenario)


def test_averages_are_bitwise_those_of_one_coordinator() -> None:
    async def scenario() -> None:
        async with shard_and_leader() as (running, leader, channel):
            workers = await joined_workers(running, leader, channel)
            for step in range(2):
                values = [values_of(rank, step) for rank in range(2)]
                # Rank 1 first: the shard still sums in rank order.
                await workers[1].upload(step, values[1])
                await workers[0].upload(step, values[0])
                expected = ((values[0] + values[1]) / np.float32(2)).astype("<f4").tobytes()
                lo, hi = chunking.shard_byte_range(ELEMENTS, 4, 2, 1)
                for worker in workers:
                    assert await worker.receive_range(step) == expected[lo:hi]
            stats = (await leader.next_of("stats")).stats
            while stats.bytes_sent == 0:  # one sent before the averages went out
                stats = (await leader.next_of("stats")).stats
            assert stats.connections == 2 and stats.buckets_completed == 2
            assert stats.bytes_received == 2 * 2 * 6000 and stats.bytes_sent == 2 * 2 * 6000

    run(scenario)


def test_a_bad_chunk_is_reported_to_the_leader_naming_shard_rank_step_and_bucket() -> None:
    async def scenario() -> None:
        async with shard_and_leader() as (running, leader, channel):
            workers = await joined_workers(running, leader, channel)
            bad = pb.GradientChunk(
                step=0, bucket_index=0, offset=0, dtype=pb.DTYPE_FLOAT32, payload=bytes(CHUNK)
            )
            await workers[1].send(pb.WorkerMessage(gradient=bad))
            rejected = (await leader.next_of("rejected")).rejected
            assert (rejected.job_id, rejected.rank, rejected.step, rejected.bucket_index) == (
                "job",
                1,
                0,
                0,
            )
            assert rejected.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
            assert "offset 0" in rejected.message and "[6000, 12000)" in rejected.message
            assert f"shard 1 at 127.0.0.1:{running.port}" in rejected.message

    run(scenario)


def test_an_abort_drops_the_step_and_chunks_ahead_of_it_wait_for_it() -> None:
    async def scenario() -> None:
        async with shard_and_leader() as (running, leader, channel):
            workers = await joined_workers(running, leader, channel)
            await workers[0].upload(0, values_of(0, 0))  # rank 1 never sends step 0
            values = [values_of(rank, 1) for rank in range(2)]
            for rank, worker in enumerate(workers):
                await worker.upload(1, values[rank])  # ahead of the shard: they wait
            await asyncio.sleep(0.2)
            await leader.outbox.put(pb.LeaderMessage(abort=pb.ShardAbort(job_id="job", step=0)))
            expected = ((values[0] + values[1]) / np.float32(2)).astype("<f4").tobytes()
            lo, hi = chunking.shard_byte_range(ELEMENTS, 4, 2, 1)
            for worker in workers:
                assert await worker.receive_range(1) == expected[lo:hi]
            assert running.servicer.budget.used == 0

    run(scenario)


def test_garbage_on_an_admitted_stream_is_reported_and_the_stream_stays() -> None:
    async def scenario() -> None:
        async with shard_and_leader() as (running, leader, channel):
            workers = await joined_workers(running, leader, channel)
            await asyncio.wait_for(workers[0].call.write(b"\xff\xff\xff"), 5)
            rejected = (await leader.next_of("rejected")).rejected
            assert rejected.rank == 0 and rejected.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
            assert "not a gradient chunk" in rejected.message
            assert running.servicer.connection_count() == 2

    run(scenario)


def test_a_shard_serves_its_own_metrics() -> None:
    async def scenario() -> None:
        async with shard_and_leader(metrics_port=0) as (running, leader, channel):
            workers = await joined_workers(running, leader, channel)
            for rank, worker in enumerate(workers):
                await worker.upload(0, values_of(rank, 0))
            for worker in workers:
                await worker.receive_range(0)
            assert running.metrics_server is not None
            url = running.metrics_server.url
            text = await asyncio.to_thread(lambda: urllib.request.urlopen(url, timeout=5).read())
            body = text.decode()
            assert "gradsync_shard_index 1.0" in body
            assert "gradsync_buckets_completed_total 1.0" in body
            assert "gradsync_received_bytes_total 12000.0" in body

    run(scenario)


@pytest.mark.parametrize("code", [grpc.StatusCode.OK, grpc.StatusCode.ABORTED])
def test_a_job_end_ends_its_data_streams_with_the_leaders_status(code: grpc.StatusCode) -> None:
    async def scenario() -> None:
        async with shard_and_leader() as (running, leader, channel):
            workers = await joined_workers(running, leader, channel)
            await workers[0].upload(0, values_of(0, 0))
            end = pb.ShardJobEnd(job_id="job", code=code.value[0], message="job 'job' ended")
            await leader.outbox.put(pb.LeaderMessage(job_end=end))
            for worker in workers:
                details = await worker.expect_end(code)
                if code != grpc.StatusCode.OK:
                    assert details == "job 'job' ended"
            assert "job" not in running.servicer.jobs
            assert running.servicer.budget.used == 0

    run(scenario)


def test_losing_the_leader_ends_every_data_stream_as_shard_lost_and_registers_again() -> None:
    async def scenario() -> None:
        async with shard_and_leader() as (running, leader, channel):
            workers = await joined_workers(running, leader, channel)
            await leader.outbox.put(None)  # the control stream ends
            for worker in workers:
                details = await worker.expect_end(
                    grpc.StatusCode.UNAVAILABLE, pb.END_REASON_SHARD_LOST
                )
                assert f"shard 1 at 127.0.0.1:{running.port} lost its leader" in details
            assert running.servicer.jobs == {}
            for _ in range(500):
                if len(leader.registers) == 2 and leader.connected.is_set():
                    break
                await asyncio.sleep(0.01)
            assert len(leader.registers) == 2, "the shard registers again"

    run(scenario)


def test_a_silent_leader_is_lost_within_the_heartbeat_timeout() -> None:
    async def scenario() -> None:
        async with shard_and_leader() as (running, leader, channel):
            workers = await joined_workers(running, leader, channel)
            leader.silent = True
            started = asyncio.get_running_loop().time()
            details = await workers[0].expect_end(
                grpc.StatusCode.UNAVAILABLE, pb.END_REASON_SHARD_LOST
            )
            assert "silent for more than the heartbeat timeout of 2s" in details
            assert asyncio.get_running_loop().time() - started < HEARTBEAT_TIMEOUT_S + 1

    run(scenario)


def test_a_refused_shard_exits_2_with_the_leaders_message(
    capsys: pytest.CaptureFixture[str],
) -> None:
    message = "shard at :1 has version 0.0.1, the leader 0.4.0"

    async def scenario() -> None:
        leader = FakeLeader(refuse=message)
        await leader.server.start()
        try:
            config = CoordinatorConfig(
                role=Role.SHARD,
                leader=f"127.0.0.1:{leader.port}",
                port=0,
                chunk_bytes=CHUNK,
                register_timeout_s=2,
            )
            assert await serve(config) == EXIT_REFUSED
        finally:
            await leader.server.stop(0)

    run(scenario)
    err = capsys.readouterr().err
    assert "gradsync shard listening on 127.0.0.1:" in err
    assert message in err
