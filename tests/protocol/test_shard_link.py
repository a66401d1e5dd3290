"""The leader's side of `Coordinator.ShardLink`, over real gRPC on loopback.

A tiny fake shard (a grpc.aio client of the control stream, written here)
registers with an in-process sharded leader, and raw workers join jobs: the
leader must check registrations, hold jobs until every shard is in, tell the
shard about each job before its workers hear of it, turn a shard's refusal
into a step abort for every rank, end every job when a shard is lost, and
list its shards in Status.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import grpc
import pytest
from gradsync import __version__
from gradsync.status import format_status
from gradsync_proto.v1 import gradsync_pb2 as pb
from gradsync_server.app import Running
from gradsync_server.control.job import Job
from gradsync_server.rpc.connection import Connection
from gradsync_server.rpc.shard_control import peer_host_of
from prometheus_client import generate_latest
from support.rawclient import CHUNK, RawWorker, assembled_job, coordinator, run, wait_until_joined
from support.shards import ADDRESS, FakeShard
from support.waiting import eventually

STATUS = "/gradsync.v1.Coordinator/Status"


@contextlib.asynccontextmanager
async def sharded(
    **overrides: object,
) -> AsyncIterator[tuple[Running, grpc.aio.Channel]]:
    settings: dict[str, object] = {"shard_count": 2}
    settings.update(overrides)
    async with coordinator(**settings) as (running, channel):
        yield running, channel


async def accepted_shard(channel: grpc.aio.Channel, **options: object) -> FakeShard:
    shard = FakeShard(channel)
    await shard.register(**options)  # type: ignore[arg-type]
    accepted = (await shard.expect("accepted")).accepted
    assert accepted.shard_index == 1
    return shard


async def welcomed(channel: grpc.aio.Channel, world_size: int = 2) -> list[RawWorker]:
    workers = [RawWorker(channel) for _ in range(world_size)]
    for rank, worker in enumerate(workers):
        await worker.join(rank, world_size=world_size)
    for worker in workers:
        await worker.expect_kind("welcome")
    return workers


async def assert_quiet(worker: RawWorker, seconds: float = 0.3) -> None:
    """Nothing arrives for `seconds` (without cancelling a read, which cancels the call)."""
    reading = asyncio.create_task(worker.recv(timeout=60))
    done, _ = await asyncio.wait({reading}, timeout=seconds)
    assert not done, reading.result()
    reading.cancel()  # the call goes with it: only at the end of a scenario
    with contextlib.suppress(asyncio.CancelledError):
        await reading


async def heartbeats(workers: list[RawWorker]) -> None:
    """Keep raw workers alive under a short heartbeat timeout."""
    while True:
        for worker in workers:
            with contextlib.suppress(Exception):
                await worker.send(pb.WorkerMessage(heartbeat=pb.Heartbeat()))
        await asyncio.sleep(0.1)


async def status(channel: grpc.aio.Channel) -> pb.StatusReply:
    call = channel.unary_unary(
        STATUS,
        request_serializer=pb.StatusRequest.SerializeToString,
        response_deserializer=pb.StatusReply.FromString,
    )
    return await call(pb.StatusRequest(), timeout=5)  # type: ignore[no-any-return]


def test_a_shard_registers_and_hears_heartbeats() -> None:
    async def scenario() -> None:
        async with sharded(heartbeat_interval_s=0.1, heartbeat_timeout_s=2.0) as (_, channel):
            shard = FakeShard(channel)
            await shard.register()
            accepted = (await shard.expect("accepted")).accepted
            assert (accepted.shard_index, accepted.shard_count) == (1, 2)
            assert (accepted.heartbeat_interval_s, accepted.heartbeat_timeout_s) == (0.1, 2.0)
            beat = await asyncio.wait_for(shard.call.read(), timeout=2)
            assert beat.WhichOneof("kind") == "heartbeat"
            shard.close()

    run(scenario)


@pytest.mark.parametrize(
    ("options", "expected"),
    [
        ({"version": "0.0.1"}, f"has version '0.0.1', the leader {__version__}"),
        ({"chunk_bytes": 2 * CHUNK}, "--chunk-mb 0.0078125 (8192 bytes), the leader --chunk-mb"),
    ],
)
def test_a_mismatched_shard_is_refused_naming_both_values(
    options: dict[str, object], expected: str
) -> None:
    async def scenario() -> None:
        async with sharded() as (running, channel):
            shard = FakeShard(channel)
            await shard.register(silent=True, **options)  # type: ignore[arg-type]
            end = (await shard.expect("stream_end")).stream_end
            details = await shard.expect_status(grpc.StatusCode.FAILED_PRECONDITION)
            assert expected in details and end.message == details
            assert f"shard at '{ADDRESS}'" in details
            assert running.servicer.shard_control.registry.registered() == []

    run(scenario)


def test_one_shard_too_many_is_resource_exhausted() -> None:
    async def scenario() -> None:
        async with sharded() as (_, channel):
            first = await accepted_shard(channel)
            extra = FakeShard(channel)
            await extra.register(address="127.0.0.1:59998", silent=True)
            details = await extra.expect_status(grpc.StatusCode.RESOURCE_EXHAUSTED)
            assert "one shard too many" in details
            first.close()

    run(scenario)


def test_jobs_wait_for_their_shards_and_the_view_goes_out_before_the_welcome(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    events: list[tuple[str, str]] = []
    send = Connection.send

    def recording_send(conn: Connection, raw: bytes) -> None:
        kind = pb.CoordinatorMessage.FromString(raw).WhichOneof("kind") or "?"
        events.append(("worker", kind))
        send(conn, raw)

    monkeypatch.setattr(Connection, "send", recording_send)

    async def scenario() -> None:
        async with sharded() as (running, channel):
            control = running.servicer.shard_control
            broadcast = control._broadcast

            def recording_broadcast(message: pb.LeaderMessage) -> None:
                events.append(("shard", message.WhichOneof("kind") or "?"))
                broadcast(message)

            control._broadcast = recording_broadcast  # type: ignore[method-assign]
            workers = [RawWorker(channel) for _ in range(2)]
            for rank, worker in enumerate(workers):
                await worker.join(rank)
            await asyncio.sleep(0.5)
            # Assembled, but no Welcome without shard 1.
            assert running.servicer.jobs["job"].state.value == "assembling"
            assert ("worker", "welcome") not in events
            shard = await accepted_shard(channel)
            view = (await shard.expect("job")).job
            assert view.job_id == "job" and view.shard_count == 2 and view.start_step == 0
            assert [(m.rank, m.incarnation) for m in view.members] == [(0, "test-0"), (1, "test-1")]
            for worker in workers:
                welcome = (await worker.expect_kind("welcome")).welcome
                assert [(s.index, s.address) for s in welcome.shards] == [(0, ""), (1, ADDRESS)]
            assert events.index(("shard", "job")) < events.index(("worker", "welcome"))
            shard.close()

    run(scenario)


def test_a_membership_change_sends_a_new_view() -> None:
    async def scenario() -> None:
        async with sharded(on_failure="elastic") as (_, channel):
            shard = await accepted_shard(channel)
            workers = await assembled_job(channel)
            assert (await shard.expect("job")).job.membership_epoch == 0
            workers[1].call.cancel()
            view = (await shard.expect("job")).job
            assert view.membership_epoch == 1 and [m.rank for m in view.members] == [0]
            assert (await workers[0].expect_kind("membership")).membership.membership_epoch == 1
            shard.close()

    run(scenario)


def test_a_shard_rejection_aborts_the_step_for_every_rank() -> None:
    async def scenario() -> None:
        async with sharded() as (running, channel):
            shard = await accepted_shard(channel)
            workers = await welcomed(channel)
            await shard.expect("job")
            why = f"rank 1 sent bucket 0 at offset 7 for step 0 to shard 1 at {ADDRESS}"
            rejected = pb.ShardRejected(
                job_id="job", rank=1, step=0, bucket_index=0, code=3, message=why
            )
            await shard.send(pb.ShardMessage(rejected=rejected))
            culprit = (await workers[1].expect_kind("step_aborted")).step_aborted
            other = (await workers[0].expect_kind("step_aborted")).step_aborted
            assert (culprit.step, culprit.code, culprit.message) == (0, 3, why)
            assert culprit.reason == pb.ABORT_REASON_MESSAGE_REJECTED
            assert other.reason == pb.ABORT_REASON_PEER_MESSAGE_REJECTED and why in other.message
            abort = (await shard.expect("abort")).abort
            assert (abort.job_id, abort.step) == ("job", 0)
            # A rejection of a step already aborted changes nothing more.
            await shard.send(pb.ShardMessage(rejected=rejected))
            await assert_quiet(workers[0])
            assert running.servicer.jobs["job"].open_step == 1
            shard.close()

    run(scenario)


def test_a_lost_shard_ends_every_stream_naming_it_and_a_new_job_waits() -> None:
    async def scenario() -> None:
        async with sharded() as (running, channel):
            shard = await accepted_shard(channel)
            workers = await welcomed(channel)
            old_job = running.servicer.jobs["job"]
            shard.close()  # the control stream ends: the shard is lost
            for worker in workers:
                end = (await worker.expect_kind("stream_end")).stream_end
                assert end.reason == pb.END_REASON_SHARD_LOST
                assert end.code == grpc.StatusCode.UNAVAILABLE.value[0]
                assert f"shard 1 at {ADDRESS} was lost (its control stream ended)" in end.message
                assert "job 'job' stops at step 0" in end.message
                details = await worker.expect_status(grpc.StatusCode.UNAVAILABLE)
                assert details == end.message
            assert "job" not in running.servicer.jobs
            # The workers reconnect: a new job, which waits for the shard again.
            again = RawWorker(channel)
            await again.join(0)
            await wait_until_joined(running, 0)
            new_job = running.servicer.jobs["job"]
            assert isinstance(new_job, Job) and new_job is not old_job
            assert new_job.state.value == "assembling"
            reply = await status(channel)
            ended = [j for j in reply.jobs if j.ended]
            assert ended and ended[0].state == "broken" and "shard 1" in ended[0].outcome

    run(scenario)


def test_a_silent_shard_is_lost_within_the_heartbeat_timeout() -> None:
    async def scenario() -> None:
        async with sharded(heartbeat_interval_s=0.1, heartbeat_timeout_s=0.6) as (_, channel):
            shard = await accepted_shard(channel, silent=True)
            workers = await welcomed(channel)
            beating = asyncio.create_task(heartbeats(workers))
            end = (await workers[0].expect_kind("stream_end")).stream_end
            assert end.reason == pb.END_REASON_SHARD_LOST
            assert "beyond the heartbeat timeout of 0.6s" in end.message
            await shard.expect("job")
            shard_end = (await shard.expect("stream_end")).stream_end
            assert shard_end.reason == pb.END_REASON_SHARD_LOST
            await shard.expect_status(grpc.StatusCode.UNAVAILABLE)
            beating.cancel()

    run(scenario)


def test_a_join_to_a_broken_job_starts_a_new_one() -> None:
    async def scenario() -> None:
        async with sharded() as (running, channel):
            shard = await accepted_shard(channel)
            workers = await assembled_job(channel)
            old_job = running.servicer.jobs["job"]
            workers[1].call.cancel()  # abort policy: the job breaks
            assert (await workers[0].expect_kind("step_aborted")).step_aborted.step == 0
            assert old_job.state.value == "broken"
            assert (await shard.expect("job")).job.job_id == "job"
            assert (await shard.expect("abort")).abort.step == 0
            restarted = await welcomed(channel)  # both ranks restart and join again
            assert running.servicer.jobs["job"] is not old_job
            end = (await shard.expect("job_end")).job_end
            assert end.job_id == "job" and end.code == grpc.StatusCode.ABORTED.value[0]
            assert (await shard.expect("job")).job.job_id == "job"
            assert all(w.call.done() is False for w in restarted)
            # The old survivor's stream heard nothing of the new job.
            await assert_quiet(workers[0])
            shard.close()

    run(scenario)


def test_status_lists_the_leader_and_its_shards() -> None:
    async def scenario() -> None:
        async with sharded(shard_count=3) as (_, channel):
            before = await status(channel)
            assert [(s.index, s.alive) for s in before.shards] == [
                (0, True),
                (1, False),
                (2, False),
            ]
            shard = FakeShard(channel)
            await shard.register()
            await shard.expect("accepted")

            async def stats_arrived() -> bool:
                return (await status(channel)).shards[1].bytes_received > 0

            await eventually(stats_arrived, "the shard's first stats in Status")
            reply = await status(channel)
            leader, first, missing = reply.shards
            assert (leader.index, leader.address, leader.version) == (0, "", __version__)
            assert (first.index, first.address, first.alive) == (1, ADDRESS, True)
            assert (first.bytes_received, first.bytes_sent, first.connections) == (1000, 500, 2)
            assert first.version == __version__ and first.last_seen_s < 1.0
            assert (missing.index, missing.alive) == (2, False)
            shard.close()

    run(scenario)


def test_an_unsharded_coordinator_lists_no_shards_and_refuses_them() -> None:
    async def scenario() -> None:
        async with coordinator() as (_, channel):
            assert list((await status(channel)).shards) == []
            shard = FakeShard(channel)
            await shard.register(silent=True)
            details = await shard.expect_status(grpc.StatusCode.FAILED_PRECONDITION)
            assert "not sharded" in details

    run(scenario)


def test_the_leader_exports_every_shard_and_status_prints_a_table() -> None:
    async def scenario() -> None:
        async with sharded(shard_count=3) as (running, channel):
            shard = await accepted_shard(channel, address=ADDRESS)
            registry = running.servicer.metrics.registry
            received = ("gradsync_shard_bytes_received_total", {"shard": "1"})
            await eventually(
                lambda: (registry.get_sample_value(*received) or 0) > 0,
                "the shard's first stats in the metrics",
            )
            text = generate_latest(running.servicer.metrics.registry).decode()
            assert "gradsync_shards_registered 1.0" in text
            assert f'gradsync_shard_up{{address="{ADDRESS}",shard="1"}} 1.0' in text
            assert 'gradsync_shard_up{address="",shard="2"} 0.0' in text
            assert 'gradsync_shard_bytes_received_total{shard="1"} 1000.0' in text
            assert 'gradsync_shard_bytes_sent_total{shard="1"} 500.0' in text
            assert 'gradsync_shard_last_seen_seconds{shard="1"}' in text
            table = format_status(await status(channel))
            assert table.startswith("no jobs\nshards: 2/3 up")
            lines = table.splitlines()
            assert lines[2].split()[:3] == ["shard", "address", "state"]
            assert lines[3].split()[:3] == ["0", "(leader)", "up"]
            assert lines[4].split()[:3] == ["1", ADDRESS, "up"]
            assert lines[5].split()[:3] == ["2", "?", "missing"]
            shard.close()

    run(scenario)


def test_peer_hosts_are_parsed_for_port_only_addresses() -> None:
    assert peer_host_of("ipv4:10.0.0.5:41488") == "10.0.0.5"
    assert peer_host_of("ipv6:[::1]:41488") == "[::1]"
    assert peer_host_of("unix:/tmp/socket") == ""
