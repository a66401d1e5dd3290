"""A job's assembly, uneven inputs, 16-bit wire, normal finish and ended-job history.

Pure method calls on `Job` with an injected clock: what each situation sends
to whom, and that the byte budget balances afterwards.
"""

from __future__ import annotations

import numpy as np
import pytest
from gradsync_proto.codec import ChunkHeader, decode_gradient
from gradsync_proto.codes import Code
from gradsync_proto.v1 import gradsync_pb2 as pb
from gradsync_server.control.job import Job, JobState
from gradsync_server.control.settings import JobSettings
from gradsync_server.control.status import EndedJobs, status_reply
from gradsync_server.dataplane.actions import Action, Send, Terminate
from gradsync_server.dataplane.budget import ByteBudget
from gradsync_server.errors import RejectedMessage

CHUNK = 4096
ELEMENTS = 64 * 32 + 32
BUCKET_BYTES = ELEMENTS * 4


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def join(rank: int, world_size: int = 3) -> pb.Join:
    signature = pb.ModelSignature(
        parameters=[
            pb.TensorSpec(name="fc.weight", shape=[64, 32], dtype=pb.DTYPE_FLOAT32),
            pb.TensorSpec(name="fc.bias", shape=[32], dtype=pb.DTYPE_FLOAT32),
        ],
        buckets=[
            pb.BucketSpec(parameter_indices=[1, 0], dtype=pb.DTYPE_FLOAT32, num_elements=ELEMENTS)
        ],
    )
    return pb.Join(job_id="job", rank=rank, world_size=world_size, signature=signature)


def kinds(actions: list[Action], kind: str) -> list[tuple[tuple[int, ...], pb.CoordinatorMessage]]:
    return [
        (a.ranks, a.message)
        for a in actions
        if isinstance(a, Send)
        and not isinstance(a.message, bytes)
        and a.message.WhichOneof("kind") == kind
    ]


def averaged(actions: list[Action]) -> dict[int, tuple[tuple[int, ...], ChunkHeader, np.ndarray]]:
    out = {}
    for action in actions:
        if isinstance(action, Send) and isinstance(action.message, bytes):
            decoded = decode_gradient(action.message)
            assert decoded is not None
            header, payload = decoded
            dtype = np.float16 if header.dtype == pb.DTYPE_FLOAT16 else np.float32
            out[header.offset] = (action.ranks, header, np.frombuffer(payload, dtype=dtype))
    return out


def running_job(budget: ByteBudget, world_size: int = 3) -> tuple[Job, FakeClock]:
    clock = FakeClock()
    job = Job("job", JobSettings(world_size, CHUNK, 2 * CHUNK), budget, clock=clock)
    for rank in range(world_size):
        job.join(rank, join(rank, world_size))
    for offset in range(0, BUCKET_BYTES, CHUNK):
        payload = bytes(min(CHUNK, BUCKET_BYTES - offset))
        job.on_state_chunk(0, pb.StateChunk(offset=offset, payload=payload))
    return job, clock


def upload(
    job: Job, rank: int, step: int, value: float, dtype: int = pb.DTYPE_FLOAT32
) -> list[Action]:
    wire = np.float16 if dtype == pb.DTYPE_FLOAT16 else np.float32
    raw = np.full(ELEMENTS, value, dtype=wire).tobytes()
    actions: list[Action] = []
    for offset in range(0, len(raw), CHUNK):
        header = ChunkHeader(step=step, offset=offset, dtype=dtype)
        actions += job.on_gradient(rank, header, memoryview(raw[offset : offset + CHUNK]))
    return actions


def test_assembly_reports_joins_drops_and_refusals_and_every_period() -> None:
    clock = FakeClock()
    job = Job(
        "job",
        JobSettings(3, CHUNK, 2 * CHUNK, heartbeat_interval_s=0.5),
        ByteBudget(1 << 20),
        clock=clock,
    )
    ((ranks, first),) = kinds(job.join(0, join(0)), "assembly")
    assert ranks == (0,) and list(first.assembly.missing_ranks) == [1, 2]
    assert first.assembly.heartbeat_interval_s == 0.5
    clock.now += 4.0
    ((ranks, second),) = kinds(job.join(2, join(2)), "assembly")
    assert ranks == (0, 2) and list(second.assembly.joined_ranks) == [0, 2]
    assert second.assembly.waited_s == 4.0
    ((ranks, refused),) = kinds(job.refused_join(1, "world size 4, expected 3"), "assembly")
    assert ranks == (0, 2) and refused.assembly.refused == "rank 1: world size 4, expected 3"
    assert job.assembly_report() is None  # just told
    clock.now += 10.0
    report = job.assembly_report()
    assert report is not None
    actions, line = report
    assert line.startswith("job 'job': waiting for ranks [1] of 3 (14 s)")
    assert kinds(actions, "assembly")[0][0] == (0, 2)
    # A waiting rank that vanished is dropped, not a failure; the others hear it.
    ((ranks, dropped),) = kinds(job.detach(2, orderly=False), "assembly")
    assert ranks == (0,) and list(dropped.assembly.missing_ranks) == [1, 2]
    assert job.state is JobState.ASSEMBLING
    assert kinds(job.join(2, join(2)), "assembly")  # it may join again
    assert kinds(job.join(1, join(1)), "welcome")


def test_a_rank_lost_before_the_state_broadcast_fails_the_others_at_once() -> None:
    job = Job("job", JobSettings(3, CHUNK, 2 * CHUNK), ByteBudget(1 << 20), clock=FakeClock())
    for rank in range(3):
        job.join(rank, join(rank))
    job.on_state_chunk(0, pb.StateChunk(offset=0, payload=bytes(CHUNK)))
    (end,) = job.detach(0, orderly=False)
    assert isinstance(end, Terminate) and end.ranks == (1, 2)
    assert end.code is Code.ABORTED and end.reason == pb.END_REASON_PEER_LOST
    assert "rank 0 disconnected from job 'job' before rank 0's initial state" in end.details


def test_uneven_inputs_divide_by_the_world_size_and_end_with_the_last_joiner() -> None:
    budget = ByteBudget(1 << 20)
    job, _ = running_job(budget)
    upload(job, 0, 0, 3.0)
    upload(job, 1, 0, 6.0)
    # Rank 2 runs out while the others' chunks of step 0 are pending: they complete now.
    actions = job.on_out_of_inputs(2, pb.OutOfInputs(step=0))
    results = averaged(actions)
    assert len(results) == 3
    for ranks, header, values in results.values():
        assert ranks == (0, 1) and header.contributors == 2
        np.testing.assert_array_equal(values, np.float32(9.0) / np.float32(3))  # world size
    ((ranks, progress),) = kinds(actions, "join_progress")
    assert ranks == (2,) and list(progress.join_progress.joined_ranks) == [2]
    assert progress.join_progress.next_step == 1 and not progress.join_progress.all_joined
    # Step 1 without rank 2: a JoinProgress follows the completed step.
    upload(job, 0, 1, 1.0)
    actions = upload(job, 1, 1, 2.0)
    assert all(v[0] == (0, 1) for v in averaged(actions).values())
    ((ranks, progress),) = kinds(actions, "join_progress")
    assert ranks == (2,) and progress.join_progress.next_step == 2
    with pytest.raises(RejectedMessage, match="open step is 2"):
        job.on_out_of_inputs(1, pb.OutOfInputs(step=1))
    job.on_out_of_inputs(1, pb.OutOfInputs(step=2))
    ((ranks, done),) = kinds(job.on_out_of_inputs(0, pb.OutOfInputs(step=2)), "join_progress")
    assert ranks == (0, 1, 2)
    assert done.join_progress.all_joined and done.join_progress.last_joiner == 0
    assert (done.join_progress.next_step, done.join_progress.next_collective) == (2, 0)
    assert budget.used == 0
    # Everyone takes part again: a full step over all three, divided by 3.
    for rank in range(3):
        actions = upload(job, rank, 2, 1.0)
    assert all(v[1].contributors == 3 for v in averaged(actions).values())


def test_sixteen_bit_wire_is_accumulated_in_float32_and_answered_in_kind() -> None:
    budget = ByteBudget(1 << 20)
    job, _ = running_job(budget)
    upload(job, 0, 0, 60000.0, pb.DTYPE_FLOAT16)  # the fp16 sum of three would overflow
    upload(job, 1, 0, 60000.0, pb.DTYPE_FLOAT16)
    results = averaged(upload(job, 2, 0, 60000.0, pb.DTYPE_FLOAT16))
    assert len(results) == 2  # 8320 bytes of float32 travel as 4160 bytes of float16
    for _, header, values in results.values():
        assert header.dtype == pb.DTYPE_FLOAT16
        assert values.tolist() == [60000.0] * len(values)
    upload(job, 0, 1, 1.0, pb.DTYPE_FLOAT16)
    aborted = kinds(upload(job, 1, 1, 1.0, pb.DTYPE_BFLOAT16)[:2], "step_aborted")
    message = aborted[0][1].step_aborted.message
    assert "rank 1 sent bucket 0 of step 1 as bfloat16, but rank 0 sent it as float16" in message
    assert budget.used == 0


def test_a_normal_finish_is_quiet_and_kept_in_the_status_history() -> None:
    clock = FakeClock()
    job, _ = running_job(ByteBudget(1 << 20), world_size=2)
    job.in_flight.steps_completed = 5
    assert job.detach(1, orderly=True) == []
    assert job.state is JobState.FINISHING
    assert job.detach(0, orderly=True) == []
    ended = EndedJobs(clock, keep=2, keep_s=600.0)
    snapshot = ended.record(job)
    assert (snapshot.state, snapshot.outcome, snapshot.ended) == (
        "finished",
        "finished after 5 steps",
        True,
    )
    clock.now += 30.0
    reply = status_reply([], "", 5.0, ended=ended.snapshots())
    assert [(j.job_id, j.state, j.ended_s_ago) for j in reply.jobs] == [("job", "finished", 30.0)]
    clock.now += 600.0
    assert ended.snapshots() == []


def test_a_rank_that_goes_on_after_a_peer_left_hears_why() -> None:
    job, _ = running_job(ByteBudget(1 << 20), world_size=2)
    job.detach(1, orderly=True)
    ((_, aborted),) = kinds(upload(job, 0, 0, 1.0)[:1], "step_aborted")
    assert "rank 1 left job 'job'" in aborted.step_aborted.message
    (end,) = job.on_collective(
        0, pb.CollectiveChunk(op=pb.COLLECTIVE_OP_BARRIER, dtype=pb.DTYPE_UINT8)
    )
    assert isinstance(end, Terminate) and end.reason == pb.END_REASON_PEER_LOST
