"""Collectives-only sessions over real gRPC: what a torch.distributed group joins with.

A Join with an empty ModelSignature (no parameters, buffers or buckets) is a
collectives-only session: the coordinator assembles it with no state broadcast,
runs collectives and heartbeats on it and lists it in status, with each rank's
lag behind the first input of its collectives; its world size is
the Join's own, from 1 up to --world-size (a subgroup), never beyond. A
signature with buckets but no parameters is still refused. A restarted
coordinator takes a group's collective numbering back from its ranks' claims.
"""

from __future__ import annotations

import asyncio

import grpc
import numpy as np
from gradsync_proto.v1 import gradsync_pb2 as pb
from support.rawclient import RawWorker, coordinator, run

EMPTY = pb.ModelSignature()
#: How long after rank 0 rank 1 sends its input to a collective.
LATE_S = 0.2


def test_a_subgroup_of_two_runs_a_collective_beside_the_coordinators_world_of_three() -> None:
    """Rank 1 sends its input late: status and the lag histogram name it."""

    async def scenario() -> None:
        async with coordinator(world_size=3) as (running, channel):
            workers = [RawWorker(channel) for _ in range(2)]
            for rank, worker in enumerate(workers):
                await worker.join(rank, world_size=2, job_id="run.pg-sub", sig=EMPTY)
            for worker in workers:
                welcome = (await worker.expect_kind("welcome")).welcome
                assert welcome.world_size == 2 and welcome.state_bytes == 0
            for rank, worker in enumerate(workers):
                if rank == 1:
                    await asyncio.sleep(LATE_S)
                raw = np.array([rank + 1.0, 2.0], dtype=np.float32).tobytes()
                chunk = pb.CollectiveChunk(
                    sequence=0,
                    op=pb.COLLECTIVE_OP_SUM,
                    dtype=pb.DTYPE_FLOAT32,
                    total_bytes=len(raw),
                    offset=0,
                    payload=raw,
                )
                await worker.send(pb.WorkerMessage(collective=chunk))
            for worker in workers:
                result = (await worker.expect_kind("collective")).collective
                assert result.contributors == 2
                values = np.frombuffer(result.payload, dtype=np.float32)
                np.testing.assert_array_equal(values, [3.0, 4.0])
            job = running.servicer.jobs["run.pg-sub"]
            assert job.world_size == 2 and job.state.value == "running"
            stub = channel.unary_unary(
                "/gradsync.v1.Coordinator/Status",
                request_serializer=pb.StatusRequest.SerializeToString,
                response_deserializer=pb.StatusReply.FromString,
            )
            (status,) = (await stub(pb.StatusRequest(job_id="run.pg-sub"), timeout=5)).jobs
            lags = {member.rank: member.mean_lag_s for member in status.members}
            # Rank 1's sleep starts once rank 0's send returned; the coordinator stamps rank
            # 0's arrival when it reads it, up to a few ms later under load.
            assert lags[0] == 0.0 and LATE_S - 0.05 <= lags[1] < LATE_S + 1.0, lags
            registry = running.servicer.metrics.registry
            for rank in (0, 1):
                count = registry.get_sample_value(
                    "gradsync_rank_lag_seconds_count", {"rank": str(rank)}
                )
                assert count == 1, (rank, count)

    run(scenario)


def test_a_collectives_only_session_larger_than_the_coordinators_world_is_refused() -> None:
    async def scenario() -> None:
        async with coordinator(world_size=2) as (_, channel):
            worker = RawWorker(channel)
            await worker.join(2, world_size=3, job_id="run.pg-world", sig=EMPTY)
            details = await worker.expect_status(grpc.StatusCode.INVALID_ARGUMENT)
            assert "rank 2 is out of range for world size 2" in details

    run(scenario)


def test_buckets_without_parameters_are_still_refused() -> None:
    async def scenario() -> None:
        async with coordinator(world_size=2) as (_, channel):
            worker = RawWorker(channel)
            sig = pb.ModelSignature(buckets=[pb.BucketSpec(num_elements=4)])
            await worker.join(0, world_size=2, job_id="odd", sig=sig)
            details = await worker.expect_status(grpc.StatusCode.INVALID_ARGUMENT)
            assert "lists no trainable parameters" in details

    run(scenario)


def test_a_restarted_coordinator_resumes_a_groups_collectives_at_the_lowest_claim() -> None:
    """Ranks of a process group rejoining a restarted coordinator claim the lowest
    collective they have no result for; the job goes on from the lowest claim, and a
    rank ahead (it had collective 4's result) sends 4 again for the rank behind."""

    async def scenario() -> None:
        async with coordinator(world_size=2) as (_, channel):
            workers = [RawWorker(channel) for _ in range(2)]
            for rank, (worker, claim) in enumerate(zip(workers, (5, 4), strict=True)):
                join = pb.Join(
                    job_id="run.pg-world",
                    rank=rank,
                    world_size=2,
                    signature=EMPTY,
                    incarnation=f"test-{rank}",
                    collective_resume=pb.CollectiveResume(sequence=claim),
                )
                await worker.send(pb.WorkerMessage(join=join))
            for worker in workers:
                welcome = (await worker.expect_kind("welcome")).welcome
                assert welcome.next_collective == 4
            for sequence in (4, 5):
                for rank, worker in enumerate(workers):
                    raw = np.full(sequence - 3, rank + sequence, np.float32).tobytes()
                    chunk = pb.CollectiveChunk(
                        sequence=sequence,
                        op=pb.COLLECTIVE_OP_SUM,
                        dtype=pb.DTYPE_FLOAT32,
                        total_bytes=len(raw),
                        payload=raw,
                    )
                    await worker.send(pb.WorkerMessage(collective=chunk))
                for worker in workers:
                    result = (await worker.expect_kind("collective")).collective
                    assert result.sequence == sequence and result.contributors == 2
                    values = np.frombuffer(result.payload, dtype=np.float32)
                    np.testing.assert_array_equal(values, [2 * sequence + 1] * (sequence - 3))

    run(scenario)
