"""Shards authenticate as shards, over real gRPC on loopback.

The attack being closed: a shard learns every member of every job, and the
leader used to admit any holder of the workers' token as a shard, even under
the address of a live one (which it then displaced). Now `ShardLink` takes a
shard token the workers do not hold, a registration never displaces a shard
that is still heard from, and what a shard learns of each session is a keyed
derivative that is of no use anywhere but at that shard.
"""

from __future__ import annotations

import asyncio

import grpc
from gradsync_proto import auth
from gradsync_proto.v1 import gradsync_pb2 as pb
from support.rawclient import RawWorker, coordinator, run
from support.shards import FakeShard
from support.waiting import eventually

TOKEN = "workers-token-for-shard-credential-tests"
SHARD_TOKEN = "shards-own-token-for-shard-credential-tests"
WORKER = auth.metadata(TOKEN)
SHARD = auth.metadata(SHARD_TOKEN)


def secured(**overrides: object):  # type: ignore[no-untyped-def]
    settings: dict[str, object] = {
        "shard_count": 2,
        "token": TOKEN,
        "shard_token": SHARD_TOKEN,
        "heartbeat_timeout_s": 3.0,
    }
    settings.update(overrides)
    return coordinator(**settings)


def test_the_workers_token_cannot_open_a_shard_link() -> None:
    async def scenario() -> None:
        async with secured() as (running, channel):
            for metadata in (WORKER, (), auth.metadata("a-guess-that-is-long-enough")):
                rogue = FakeShard(channel, metadata)
                await rogue.register(silent=True)
                details = await rogue.expect_status(grpc.StatusCode.UNAUTHENTICATED)
                assert "shard token" in details and auth.ENV_SHARD_TOKEN in details, details
                assert TOKEN not in details and SHARD_TOKEN not in details
                rogue.close()
            assert running.servicer.shard_control.registry.registered() == []

    run(scenario)


def test_a_leader_without_a_shard_token_admits_no_shard_when_it_has_a_token() -> None:
    async def scenario() -> None:
        async with coordinator(token=TOKEN) as (_running, channel):
            rogue = FakeShard(channel, WORKER)
            await rogue.register(silent=True)
            details = await rogue.expect_status(grpc.StatusCode.UNAUTHENTICATED)
            assert "has no shard token" in details and "--shard-token-file" in details
            rogue.close()

    run(scenario)


def test_a_live_shard_is_never_displaced_even_by_a_shard_token_holder() -> None:
    async def scenario() -> None:
        async with secured() as (running, channel):
            genuine = FakeShard(channel, SHARD)
            await genuine.register()
            assert (await genuine.expect("accepted")).accepted.shard_index == 1
            record = running.servicer.shard_control.registry.get(1)
            impostor = FakeShard(channel, SHARD)
            await impostor.register()  # the same address as the live shard
            end = (await impostor.expect("stream_end")).stream_end
            assert end.code == grpc.StatusCode.ALREADY_EXISTS.value[0], end
            assert "shard 1" in end.message and "heartbeat timeout" in end.message
            await impostor.expect_status(grpc.StatusCode.ALREADY_EXISTS)
            impostor.close()
            # The live shard keeps its registration and its stream.
            assert running.servicer.shard_control.registry.get(1) is record
            await genuine.send(pb.ShardMessage(stats=pb.ShardStats()))
            await asyncio.sleep(0.3)
            assert running.servicer.shard_control.registry.get(1) is record
            genuine.close()

    run(scenario)


def test_a_silent_shard_is_replaced_by_a_new_registration_at_its_address() -> None:
    async def scenario() -> None:
        async with secured(heartbeat_interval_s=0.2, heartbeat_timeout_s=1.0) as (
            running,
            channel,
        ):
            silent = FakeShard(channel, SHARD)
            await silent.register(silent=True)
            await silent.expect("accepted")
            registry = running.servicer.shard_control.registry
            first = registry.get(1)
            await eventually(lambda: registry.get(1) is not first, "the silent shard lost", 5)
            successor = FakeShard(channel, SHARD)
            await successor.register()
            assert (await successor.expect("accepted")).accepted.shard_index == 1
            silent.close()
            successor.close()

    run(scenario)


def test_shards_learn_a_keyed_derivative_of_each_session_never_the_secret() -> None:
    async def scenario() -> None:
        async with secured() as (_running, channel):
            shard = FakeShard(channel, SHARD)
            await shard.register()
            await shard.expect("accepted")
            workers = [RawWorker(channel, WORKER) for _ in range(2)]
            for rank, worker in enumerate(workers):
                await worker.join(rank)
            sessions = {
                rank: (await worker.expect_kind("welcome")).welcome.session
                for rank, worker in enumerate(workers)
            }
            view = await shard.expect("job")
            members = {m.rank: m.session for m in view.job.members}
            assert members == {r: auth.shard_session(s, 1) for r, s in sessions.items()}
            raw = view.SerializeToString()
            assert not any(secret in raw for secret in sessions.values())
            # The derivative is one-way and per shard: no use at another index.
            assert auth.shard_session(sessions[0], 1) != auth.shard_session(sessions[0], 2)
            shard.close()

    run(scenario)
