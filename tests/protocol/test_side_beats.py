"""`Coordinator.Beat`: a side-channel heartbeat counts only when it proves the rank's session.

Real gRPC to an in-process coordinator with an injected clock: a beat with the
session's MAC keeps a rank that says nothing on its Sync stream alive past the
heartbeat timeout, and from its first beat on only beats count; a forged,
replayed, moved or unknown beat is refused with a reason naming rank, job and
sequence, and keeps nothing alive.
"""

from __future__ import annotations

import grpc
import pytest
from gradsync.control.transport import BEAT_METHOD
from gradsync_proto import auth
from gradsync_proto.v1 import gradsync_pb2 as pb
from support.rawclient import assembled_job, coordinator, run


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _beat(
    session: bytes, rank: int, sequence: int, step: int = 0, job: str = "job"
) -> pb.BeatRequest:
    proof = auth.beat_proof(session, job, rank, sequence, step)
    return pb.BeatRequest(job_id=job, rank=rank, sequence=sequence, step=step, proof=proof)


def test_an_authenticated_beat_keeps_a_rank_alive_and_others_are_refused() -> None:
    async def scenario() -> None:
        async with coordinator(heartbeat_timeout_s=5.0) as (running, channel):
            clock = FakeClock()
            running.servicer.clock = clock
            workers = await assembled_job(channel)
            job = running.servicer.jobs["job"]
            beat = channel.unary_unary(
                BEAT_METHOD,
                request_serializer=pb.BeatRequest.SerializeToString,
                response_deserializer=pb.BeatReply.FromString,
            )
            session = job.membership.session_of(1)
            assert session

            async def refused(request: pb.BeatRequest, code: grpc.StatusCode) -> str:
                with pytest.raises(grpc.aio.AioRpcError) as raised:
                    await beat(request, timeout=5)
                assert raised.value.code() == code, raised.value.details()
                return str(raised.value.details())

            # Rank 1 says nothing on its stream for 8 s but beats on the side every 3 s.
            for sequence in (1, 2):
                clock.now += 3.0
                reply = await beat(_beat(session, 1, sequence, step=7), timeout=5)
                assert reply.member
                await workers[0].send(pb.WorkerMessage(heartbeat=pb.Heartbeat(step=0)))
                await workers[0].settle(running)
            clock.now += 2.0
            assert job.silent_ranks(timeout_s=5.0) == []
            assert job.liveness.reported_step(1) == 7
            running.servicer.check_liveness()
            assert job.members.keys() == {0, 1}

            # None of these counts: the last sign of life stays at the beat of 2 s ago.
            forged = await refused(
                _beat(b"x" * len(session), 1, 3), grpc.StatusCode.PERMISSION_DENIED
            )
            assert "rank 1 of job 'job', beat 3" in forged and "session" in forged
            replayed = await refused(
                _beat(session, 1, 2, step=7), grpc.StatusCode.FAILED_PRECONDITION
            )
            assert "sequence 2 is not above 2" in replayed
            moved = _beat(session, 1, 5)
            moved.rank = 0  # rank 1's proof presented for rank 0
            await refused(moved, grpc.StatusCode.PERMISSION_DENIED)
            await refused(_beat(session, 1, 6, job="other"), grpc.StatusCode.NOT_FOUND)
            await refused(_beat(session, 9, 7), grpc.StatusCode.NOT_FOUND)
            with pytest.raises(grpc.aio.AioRpcError) as garbage:
                await channel.unary_unary(BEAT_METHOD)(b"\xff\xff", timeout=5)
            assert garbage.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            # Once it beats on the side, its Sync stream no longer counts: a frozen
            # worker's kernel would go on delivering what its send queue holds.
            for worker in workers:
                await worker.send(pb.WorkerMessage(heartbeat=pb.Heartbeat(step=8)))
                await worker.settle(running)
            clock.now += 3.5  # 5.5 s after rank 1's last good beat
            assert job.silent_ranks(timeout_s=5.0) == [1]
            assert job.liveness.reported_step(1) == 7

    run(scenario)
