"""Session secrets: what acts for a rank must arrive on that rank's session.

A real leader and a real shard over gRPC, driven by raw streams. The attack
being closed: Status shows every member's incarnation, and a shard used to
admit a data stream by (rank, incarnation) alone, so anyone who could read
Status could upload gradients as any rank. Now the leader issues a random
session secret to each rank in its own Welcome, announces it to the shards,
and a shard admits only the stream that presents it.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
from gradsync_proto import auth
from gradsync_proto.net.frame_stream import FRAME_PORT_METHOD
from gradsync_proto.v1 import gradsync_pb2 as pb
from gradsync_server.app import Running, start
from gradsync_server.config import CoordinatorConfig, Role
from gradsync_server.control.membership import SESSION_BYTES
from gradsync_server.store.checkpoint_file import FileCheckpointStore
from support.frameclient import frame_workers
from support.rawclient import (
    CHUNK,
    RawWorker,
    assembled_job,
    bucket_values,
    coordinator,
    run,
    run_step,
    signature,
)
from support.waiting import eventually


@contextlib.asynccontextmanager
async def leader_and_shard() -> AsyncIterator[tuple[Running, grpc.aio.Channel, Running]]:
    """A coordinator cut into 2 shards, and its shard 1 running in this process."""
    async with coordinator(shard_count=2, heartbeat_timeout_s=3.0) as (running, channel):
        shard = await start(
            CoordinatorConfig(
                role=Role.SHARD, leader=f"127.0.0.1:{running.port}", host="127.0.0.1", port=0
            )
        )
        try:
            await shard.wait_registered(5)
            yield running, channel, shard
        finally:
            await shard.stop()


async def data_stream(shard: Running, hello: pb.ShardHello) -> grpc.aio.StreamStreamCall:
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{shard.port}")
    call = channel.stream_stream(
        "/gradsync.v1.Shard/Data",
        request_serializer=lambda raw: raw,
        response_deserializer=pb.CoordinatorMessage.FromString,
    )()
    await call.write(pb.WorkerMessage(shard_hello=hello).SerializeToString())
    return call


async def ended(call: grpc.aio.StreamStreamCall) -> tuple[grpc.StatusCode, str]:
    with contextlib.suppress(grpc.aio.AioRpcError):
        while await asyncio.wait_for(call.read(), 5) is not grpc.aio.EOF:
            pass
    return await call.code(), await call.details()


def test_a_shard_admits_a_data_stream_only_on_the_session_its_rank_was_issued() -> None:
    async def scenario() -> None:
        async with leader_and_shard() as (_running, channel, shard):
            workers = [RawWorker(channel), RawWorker(channel)]
            for rank, worker in enumerate(workers):
                await worker.join(rank)
            welcomes = [(await worker.expect_kind("welcome")).welcome for worker in workers]
            sessions = [welcome.session for welcome in welcomes]
            # Each rank gets its own secret, in its own Welcome only.
            assert all(len(session) == SESSION_BYTES for session in sessions)
            assert sessions[0] != sessions[1]
            # What an attacker can read: Status shows rank 0's incarnation, not its session.
            stub = channel.unary_unary(
                "/gradsync.v1.Coordinator/Status",
                request_serializer=pb.StatusRequest.SerializeToString,
                response_deserializer=pb.StatusReply.FromString,
            )
            status = await stub(pb.StatusRequest())
            (job,) = status.jobs
            incarnation = {m.rank: m.incarnation for m in job.members}[0]
            assert incarnation == "test-0"
            raw_status = status.SerializeToString()
            assert not any(session in raw_status for session in sessions)

            def hello(session: bytes) -> pb.ShardHello:
                return pb.ShardHello(
                    job_id="job", rank=0, incarnation=incarnation, shard_index=1, session=session
                )

            # None, guessed, rank 1's, rank 0's raw secret (a shard never holds or takes
            # it), and rank 0's derivative for another shard.
            forged_sessions = (
                b"",
                bytes(SESSION_BYTES),
                auth.shard_session(sessions[1], 1),
                sessions[0],
                auth.shard_session(sessions[0], 2),
            )
            for forged in forged_sessions:
                call = await data_stream(shard, hello(forged))
                code, details = await ended(call)
                assert code == grpc.StatusCode.PERMISSION_DENIED, (code, details)
                assert "rank 0 of job 'job'" in details and "session" in details
                assert sessions[0].hex() not in details  # no secret in a message
            assert shard.servicer.connection_count() == 0
            # The rank itself, with this shard's derivative of its session, is admitted.
            genuine = await data_stream(shard, hello(auth.shard_session(sessions[0], 1)))
            for _ in range(300):
                if shard.servicer.connection_count() == 1:
                    break
                await asyncio.sleep(0.01)
            assert shard.servicer.connection_count() == 1
            genuine.cancel()

    run(scenario)


def test_a_shard_serves_its_data_streams_on_its_frame_port_too() -> None:
    """A shard answers FramePort like the leader, and its frame port admits a ShardHello."""

    async def scenario() -> None:
        async with leader_and_shard() as (_running, channel, shard):
            workers = [RawWorker(channel), RawWorker(channel)]
            for rank, worker in enumerate(workers):
                await worker.join(rank)
            welcome = (await workers[0].expect_kind("welcome")).welcome
            await workers[1].expect_kind("welcome")
            async with grpc.aio.insecure_channel(f"127.0.0.1:{shard.port}") as shard_channel:
                ask = shard_channel.unary_unary(
                    FRAME_PORT_METHOD, response_deserializer=pb.FramePortReply.FromString
                )
                reply = await ask(pb.FramePortRequest().SerializeToString())
            assert shard.frames is not None and reply.port == shard.frames.port != shard.port
            hello = pb.ShardHello(
                job_id="job",
                rank=0,
                incarnation="test-0",
                shard_index=1,
                session=auth.shard_session(welcome.session, 1),
            )
            async with frame_workers(reply.port) as connect:
                on_frames = await connect()
                await on_frames.send(pb.WorkerMessage(shard_hello=hello))
                await eventually(lambda: shard.servicer.connection_count() == 1, "admitted")
                assert len(shard.frames.connections) == 1

    run(scenario)


def test_abandon_and_checkpoint_from_another_job_cannot_touch_this_job(tmp_path: Path) -> None:
    """Everything a Sync stream sends acts for the rank that stream joined as, in its own job:
    job B's rank 0 abandoning "step 0" or uploading a checkpoint leaves job A alone."""

    async def scenario() -> None:
        store_dir = tmp_path / "store"
        async with coordinator(checkpoint_store=str(store_dir)) as (_running, channel):
            job_a = await assembled_job(channel, "a")
            job_b = await assembled_job(channel, "b")
            await job_b[0].send(pb.WorkerMessage(abandon=pb.AbandonStep(step=0, reason="attack")))
            aborted = (await job_b[0].expect_kind("step_aborted")).step_aborted
            assert aborted.step == 0  # job B's own step 0: the abandon acts in B only
            blob = b"planted" * 100
            await job_b[0].send(
                pb.WorkerMessage(
                    checkpoint=pb.CheckpointChunk(
                        step=0, offset=0, total_bytes=len(blob), payload=blob
                    )
                )
            )
            saved = await job_b[0].expect_kind("checkpoint_saved")
            assert saved.checkpoint_saved.durable
            # Job A's step 0 completes with the exact average: nothing of B reached it.
            await run_step(job_a, 0)
            store = FileCheckpointStore(store_dir)
            assert store.steps("a") == [] and store.steps("b") == [0]
            # A rank other than 0 cannot upload a checkpoint at all.
            await job_a[1].send(
                pb.WorkerMessage(
                    checkpoint=pb.CheckpointChunk(
                        step=1, offset=0, total_bytes=len(blob), payload=blob
                    )
                )
            )
            details = await job_a[1].expect_status(grpc.StatusCode.INVALID_ARGUMENT)
            assert "only rank 0" in details
            assert store.steps("a") == []

    run(scenario)


def test_a_checkpoint_ahead_of_the_steps_seen_is_refused_naming_both(tmp_path: Path) -> None:
    async def scenario() -> None:
        store_dir = tmp_path / "store"
        async with coordinator(checkpoint_store=str(store_dir)) as (_running, channel):
            workers = await assembled_job(channel, "job")
            await run_step(workers, 0)
            blob = b"state" * 100
            await workers[0].send(
                pb.WorkerMessage(
                    checkpoint=pb.CheckpointChunk(
                        step=1000, offset=0, total_bytes=len(blob), payload=blob
                    )
                )
            )
            details = await workers[0].expect_status(grpc.StatusCode.INVALID_ARGUMENT)
            assert "step 1000" in details and "step 1," in details, details
            assert FileCheckpointStore(store_dir).steps("job") == []

    run(scenario)


def test_a_checkpoint_of_another_model_under_the_same_job_id_refuses_the_job(
    tmp_path: Path,
) -> None:
    """Model X saves step 1 of job 'job'; model Y (other shapes) joins 'job': it is refused
    with the job, step, store and mismatch named, and X's checkpoint stays."""

    async def scenario() -> None:
        store_dir = tmp_path / "store"
        async with coordinator(checkpoint_store=str(store_dir)) as (running, channel):
            workers = await assembled_job(channel, "job")
            await run_step(workers, 0)
            blob = bucket_values(0, 0).tobytes()[:CHUNK]
            await workers[0].send(
                pb.WorkerMessage(
                    checkpoint=pb.CheckpointChunk(
                        step=1, offset=0, total_bytes=len(blob), payload=blob
                    )
                )
            )
            assert (await workers[0].expect_kind("checkpoint_saved")).checkpoint_saved.durable
            for worker in workers:
                await worker.leave()
            await eventually(lambda: "job" not in running.servicer.jobs, "model X's job to end")
            other = RawWorker(channel)
            await other.join(0, sig=signature(weight_shape=(CHUNK // 4, 2)))
            details = await other.expect_status(grpc.StatusCode.FAILED_PRECONDITION)
            assert "job 'job'" in details and "step 1" in details and "different model" in details
            assert FileCheckpointStore(store_dir).steps("job") == [1]

    run(scenario)


ELASTIC_TOKEN = "elastic-test-token-0123456789abcdef"


async def collect_kinds(worker: RawWorker, kinds: list[str]) -> None:
    """Append the kind of every message `worker` receives (a read cancelled by a
    timeout would cancel the whole call, so one task reads for the whole test)."""
    while (message := await worker.call.read()) is not grpc.aio.EOF:
        kinds.append(message.WhichOneof("kind"))


def test_a_lost_ranks_slot_and_state_cannot_be_taken_without_the_token() -> None:
    """The elastic takeover: once rank 1 is lost, whoever joins as rank 1 gets rank 0's
    state. Without the token the join is refused before any state change: the job's
    membership is untouched and rank 0 is never asked for its state; the rightful
    rank 1, with the token, still rejoins and is healed."""
    credentials = auth.metadata(ELASTIC_TOKEN)

    async def scenario() -> None:
        async with coordinator(
            token=ELASTIC_TOKEN, on_failure="elastic", min_workers=1, heartbeat_timeout_s=3.0
        ) as (running, channel):
            workers = await assembled_job(channel, metadata=credentials)
            await run_step(workers, 0)
            workers[1].call.cancel()
            for _ in range(500):
                if 1 not in running.servicer.jobs["job"].members:
                    break
                await asyncio.sleep(0.01)
            else:
                raise AssertionError("rank 1 was never dropped from the job")
            received: list[str] = []
            reader = asyncio.create_task(collect_kinds(workers[0], received))
            for stolen in ((), auth.metadata("wrong-token-0123456789abcdef")):
                thief = RawWorker(channel, stolen)
                with contextlib.suppress(grpc.aio.AioRpcError, asyncio.InvalidStateError):
                    await thief.join(1)
                details = await thief.expect_status(grpc.StatusCode.UNAUTHENTICATED)
                assert "token" in details and ELASTIC_TOKEN not in details
            assert 1 not in running.servicer.jobs["job"].members
            await asyncio.sleep(0.3)
            assert "state_request" not in received, received
            rightful = RawWorker(channel, credentials)
            await rightful.join(1)
            for _ in range(300):
                if "state_request" in received:
                    break
                await asyncio.sleep(0.01)
            else:
                raise AssertionError(f"rank 0 was never asked to heal rank 1: {received}")
            reader.cancel()

    run(scenario)
