"""Liveness and straggler bookkeeping with an injected clock: no sleeps."""

from __future__ import annotations

import grpc
from gradsync_proto.v1 import gradsync_pb2 as pb
from gradsync_server.control.job import Job
from gradsync_server.control.settings import JobSettings
from gradsync_server.dataplane.budget import ByteBudget
from gradsync_server.dataplane.progress import StepProgress
from support.rawclient import CHUNK, assembled_job, coordinator, gradient, run, signature


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_step_progress_names_late_ranks_and_measures_lag() -> None:
    clock = FakeClock()
    progress = StepProgress([2, 1], clock)
    assert progress.record(0, 0) is None  # first of two chunks
    clock.now += 0.5
    assert progress.record(0, 0) == 0.0  # rank 0 completes bucket 0 first
    assert progress.late_ranks([0, 1, 2]) == {1: [0], 2: [0]}
    clock.now += 1.25
    progress.record(2, 0)
    assert progress.record(2, 0) == 1.25  # 1.25 s after rank 0
    assert progress.late_ranks([0, 1, 2]) == {1: [0]}
    assert progress.age() == 1.75
    progress.reset()
    assert progress.late_ranks([0, 1, 2]) == {} and progress.age() == 0.0


def test_silent_ranks_follow_the_clock() -> None:
    clock = FakeClock()
    job = Job("j", JobSettings(2, CHUNK, CHUNK * 2), ByteBudget(1 << 20), clock=clock)
    for rank in (0, 1):
        job.join(rank, pb.Join(job_id="j", rank=rank, world_size=2, signature=signature()))
    clock.now += 3.0
    job.liveness.touch(0)
    clock.now += 2.5
    assert job.silent_ranks(timeout_s=5.0) == [1]
    assert job.silent_ranks(timeout_s=6.0) == []


def test_watchdog_declares_a_silent_rank_dead_and_tells_the_others() -> None:
    async def scenario() -> None:
        async with coordinator(heartbeat_timeout_s=5.0) as (running, channel):
            clock = FakeClock()
            running.servicer.clock = clock
            workers = await assembled_job(channel)
            await workers[0].send(gradient(0, 0, bytes(CHUNK)))
            await workers[0].send(pb.WorkerMessage(heartbeat=pb.Heartbeat(step=0)))
            clock.now += 4.0
            await workers[0].send(pb.WorkerMessage(heartbeat=pb.Heartbeat(step=0)))
            await workers[0].settle(running)
            running.servicer.check_liveness()
            assert running.servicer.jobs["job"].members.keys() == {0, 1}, "4 s is not 5 s"
            running.servicer.metrics.observe_bucket_arrival(1, 0.25)
            clock.now += 1.5  # rank 1 silent for 5.5 s, rank 0 for 1.5 s
            running.servicer.check_liveness()
            aborted = (await workers[0].expect_kind("step_aborted")).step_aborted
            assert aborted.reason == pb.ABORT_REASON_PEER_LOST and aborted.culprit_rank == 1
            assert "rank 1 was declared dead after 5s without a heartbeat" in aborted.message
            # The dead rank hears why before its stream ends: not UNAVAILABLE, which
            # would send it down the reconnect path as if the coordinator were gone.
            end = (await workers[1].expect_kind("stream_end")).stream_end
            assert end.reason == pb.END_REASON_DECLARED_DEAD
            assert end.code == grpc.StatusCode.ABORTED.value[0]
            details = await workers[1].expect_status(grpc.StatusCode.ABORTED)
            assert "declared dead" in details and details == end.message
            # It left for good: its straggler statistics do not follow a later rank 1.
            assert running.servicer.metrics.lag_tracker.samples(1) == 0

    run(scenario)
