"""Hostile input against a real coordinator over real gRPC: every resource stays bounded.

Issue 11: job slots taken by quick Joins, one job holding the whole buffer
budget, a newline in a reason forging a log line, unbounded connections, streams
that never say who they are, and handler bugs that ended a stream with OK.
Each test drives a real in-process coordinator through `RawWorker` and uses
small configurable limits so it runs in about a second.
"""

from __future__ import annotations

import asyncio
import logging

import grpc
import pytest
from gradsync_proto.v1 import gradsync_pb2 as pb
from gradsync_server.control.job import Job
from support.rawclient import (
    CHUNK,
    RawWorker,
    assembled_job,
    bucket_values,
    coordinator,
    gradient,
    healthy_step,
    run,
    signature,
    wait_until_joined,
)

CODE = grpc.StatusCode


async def _heartbeats(worker: RawWorker, stop: asyncio.Event) -> None:
    """Keep a waiting rank alive, as a squatter would."""
    while not stop.is_set():
        await worker.send(pb.WorkerMessage(heartbeat=pb.Heartbeat(step=0)))
        await asyncio.sleep(0.05)


def test_job_slots_taken_by_joins_that_never_assemble_come_back() -> None:
    """Two squatters (alive, heartbeating) hold both job slots; the assembly timeout frees them."""

    async def scenario() -> None:
        async with coordinator(max_jobs=2, assembly_timeout_s=0.6, heartbeat_timeout_s=5.0) as (
            running,
            channel,
        ):
            stop = asyncio.Event()
            squatters = [RawWorker(channel), RawWorker(channel)]
            beats = []
            for index, squatter in enumerate(squatters):
                await squatter.join(0, job_id=f"squat-{index}")
                await wait_until_joined(running, 0, f"squat-{index}")
                beats.append(asyncio.create_task(_heartbeats(squatter, stop)))
            refused = RawWorker(channel)
            await refused.join(0, job_id="real")
            assert "limit 2" in await refused.expect_status(CODE.RESOURCE_EXHAUSTED)
            for squatter in squatters:
                details = await squatter.expect_status(CODE.DEADLINE_EXCEEDED)
                assert "did not assemble within 0.6s" in details and "ranks [1]" in details
            stop.set()
            await asyncio.gather(*beats, return_exceptions=True)
            assert not running.servicer.jobs, "the squatters' jobs still hold their slots"
            await healthy_step(channel, "real")

    run(scenario)


def test_one_job_cannot_hold_the_budget_another_job_needs() -> None:
    """A job that parks chunks it never completes holds at most its share; others train on."""
    budget = 16 * CHUNK
    hog_signature = signature((64, 320))  # one bucket of 82048 bytes: 21 chunks

    async def scenario() -> None:
        async with coordinator(max_buffered_bytes=budget) as (running, channel):
            hog = [RawWorker(channel), RawWorker(channel)]
            for rank, worker in enumerate(hog):
                await worker.join(rank, job_id="hog", sig=hog_signature)
            for worker in hog:
                await worker.expect_kind("welcome")
            state = bytes(82048 + 8)  # parameters and the int64 buffer
            for offset in range(0, len(state), CHUNK):
                piece = state[offset : offset + CHUNK]
                await hog[0].send(
                    pb.WorkerMessage(state=pb.StateChunk(offset=offset, payload=piece))
                )
            for _ in range(0, len(state), CHUNK):
                await hog[1].expect_kind("state")
            # Rank 1 runs ahead of rank 0, which never sends: its chunks stay parked.
            for index in range(9):
                await hog[1].send(gradient(0, index * CHUNK, bytes(CHUNK)))
            aborted = (await hog[1].expect_kind("step_aborted")).step_aborted
            assert aborted.code == CODE.RESOURCE_EXHAUSTED.value[0]
            assert f"limit {budget // 2} bytes" in aborted.message, aborted.message
            for index in range(8):  # exactly its share, for step 1: accepted and held
                await hog[1].send(gradient(1, index * CHUNK, bytes(CHUNK)))
            for _ in range(100):
                if running.servicer.budget.held_by("hog") == 8 * CHUNK:
                    break
                await asyncio.sleep(0.01)
            assert running.servicer.budget.held_by("hog") == 8 * CHUNK
            await healthy_step(channel, "other")  # the other half is the others'
            assert running.servicer.budget.held_by("hog") == 8 * CHUNK

    run(scenario)


def test_a_newline_in_a_leave_reason_cannot_forge_a_log_line(
    caplog: pytest.LogCaptureFixture,
) -> None:
    forged = "done\n2026-01-01 ERROR gradsync.server: job 'x': rank 0 is an impostor"

    async def scenario() -> None:
        async with coordinator() as (_, channel):
            workers = await assembled_job(channel)
            await workers[0].send(pb.WorkerMessage(leave=pb.Leave(reason=forged)))
            await workers[0].expect_status(CODE.OK)
            await workers[1].send(pb.WorkerMessage(leave=pb.Leave(reason="x" * 60_000)))
            await workers[1].expect_status(CODE.OK)

    with caplog.at_level(logging.INFO, logger="gradsync.server"):
        run(scenario)
    left = [r.getMessage() for r in caplog.records if " left (" in r.getMessage()]
    assert len(left) == 2, left
    assert repr(forged) in left[0] and "\n" not in left[0]
    assert len(left[1]) < 1000 and "more characters" in left[1]


def test_a_huge_abandon_reason_is_not_relayed_to_every_rank() -> None:
    async def scenario() -> None:
        async with coordinator() as (_, channel):
            workers = await assembled_job(channel)
            await workers[0].upload_bucket(0, bucket_values(0, 0))
            reason = "line one\nline two" + "y" * 60_000
            await workers[1].send(pb.WorkerMessage(abandon=pb.AbandonStep(step=0, reason=reason)))
            for worker in workers:
                message = (await worker.expect_kind("step_aborted")).step_aborted.message
                assert len(message) < 1000 and "'line one\\nline two" in message, message[:300]

    run(scenario)


def test_streams_beyond_max_connections_are_refused() -> None:
    async def scenario() -> None:
        async with coordinator(max_connections=2) as (running, channel):
            first, second = RawWorker(channel), RawWorker(channel)
            await first.join(0, job_id="one")
            await second.join(0, job_id="two")
            await wait_until_joined(running, 0, "two")
            # Refused before its first message is read: a join written here would race the
            # refusal, and gRPC then reports its own INTERNAL instead of the coordinator's code.
            third = RawWorker(channel)
            details = await third.expect_status(CODE.RESOURCE_EXHAUSTED)
            assert "limit 2, --max-connections" in details
            assert running.servicer.stream_count.active == 2
            second.call.cancel()
            for _ in range(200):
                if running.servicer.stream_count.active < 2:
                    break
                await asyncio.sleep(0.01)
            assert running.servicer.stream_count.active == 1, "a closed stream still counts"

    run(scenario)


def test_a_stream_that_never_says_who_it_is_is_ended_at_the_deadline() -> None:
    async def scenario() -> None:
        async with coordinator(first_message_timeout_s=0.3) as (running, channel):
            silent = RawWorker(channel)
            message = await silent.recv(timeout=5)
            assert message.stream_end.code == CODE.DEADLINE_EXCEEDED.value[0]
            details = await silent.expect_status(CODE.DEADLINE_EXCEEDED)
            assert "no first message" in details and "--first-message-timeout-s" in details
            for _ in range(200):
                if running.servicer.stream_count.active == 0:
                    break
                await asyncio.sleep(0.01)
            assert running.servicer.stream_count.active == 0
            # A stream that joins in time is not affected by the deadline.
            workers = await assembled_job(channel)
            await asyncio.sleep(0.5)
            await workers[0].upload_bucket(0, bucket_values(0, 0))
            await workers[1].upload_bucket(0, bucket_values(1, 0))
            await workers[0].receive_bucket(0)

    run(scenario)


def test_a_handler_bug_ends_the_stream_with_internal_naming_it(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def broken(self: Job, rank: int, abandon: pb.AbandonStep) -> list[object]:
        raise RuntimeError("boom in on_abandon")

    monkeypatch.setattr(Job, "on_abandon", broken)

    async def scenario() -> None:
        async with coordinator() as (_, channel):
            workers = await assembled_job(channel)
            await workers[1].send(pb.WorkerMessage(abandon=pb.AbandonStep(step=0, reason="x")))
            details = await workers[1].expect_status(CODE.INTERNAL)
            assert details == "internal error in Sync: RuntimeError: boom in on_abandon"

    with caplog.at_level(logging.ERROR, logger="gradsync.server"):
        run(scenario)
    assert any(r.exc_info and "internal error in Sync" in r.getMessage() for r in caplog.records)


def test_a_status_handler_bug_is_internal_not_unknown(monkeypatch: pytest.MonkeyPatch) -> None:
    import gradsync_server.rpc.leader_role as servicer_module

    def broken(*args: object, **kwargs: object) -> None:
        raise KeyError("no such job")

    monkeypatch.setattr(servicer_module, "status_reply", broken)

    async def scenario() -> None:
        async with coordinator() as (_, channel):
            call = channel.unary_unary(
                "/gradsync.v1.Coordinator/Status",
                request_serializer=pb.StatusRequest.SerializeToString,
                response_deserializer=pb.StatusReply.FromString,
            )
            with pytest.raises(grpc.aio.AioRpcError) as raised:
                await call(pb.StatusRequest(), timeout=5)
            assert raised.value.code() == CODE.INTERNAL
            assert raised.value.details() == "internal error in Status: KeyError: 'no such job'"

    run(scenario)


def test_oversized_signatures_and_free_text_in_join_are_refused() -> None:
    async def scenario() -> None:
        async with coordinator() as (_, channel):
            long_name = signature()
            long_name.parameters[0].name = "w" * 5000
            worker = RawWorker(channel)
            await worker.join(0, sig=long_name)
            assert "at most 1024 characters" in await worker.expect_status(CODE.INVALID_ARGUMENT)
            worker = RawWorker(channel)
            join = pb.Join(job_id="job", rank=0, world_size=2, signature=signature())
            join.incarnation = "evil\nERROR forged"
            await worker.send(pb.WorkerMessage(join=join))
            details = await worker.expect_status(CODE.INVALID_ARGUMENT)
            assert "Join.incarnation 'evil\\nERROR forged'" in details

    run(scenario)


def test_members_with_equal_signatures_share_one_copy() -> None:
    async def scenario() -> None:
        async with coordinator() as (running, channel):
            await assembled_job(channel)
            members = running.servicer.jobs["job"].members
            assert members[0].signature is members[1].signature

    run(scenario)
