"""The coordinator's job as a composition of pure components, driven by method calls.

No sockets: a `Job` is fed joins and chunks and its actions are inspected,
with an injected clock and a real `ByteBudget` whose books must balance
whichever way a step ends.
"""

from __future__ import annotations

import numpy as np
from gradsync_proto.codec import ChunkHeader
from gradsync_proto.codes import Code
from gradsync_proto.v1 import gradsync_pb2 as pb
from gradsync_server.control.job import Job, JobState
from gradsync_server.control.settings import JobSettings
from gradsync_server.control.status import job_status, status_reply
from gradsync_server.dataplane.actions import Action, ResumeBlob, Send, Terminate
from gradsync_server.dataplane.budget import ByteBudget
from gradsync_server.metrics import CoordinatorMetrics
from gradsync_server.store.checkpoint import Checkpoint

CHUNK = 4096
BUCKET_BYTES = (64 * 32 + 32) * 4  # two float32 parameters: chunks of 4096, 4096, 128


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def signature(weight_rows: int = 64) -> pb.ModelSignature:
    return pb.ModelSignature(
        parameters=[
            pb.TensorSpec(name="fc.weight", shape=[weight_rows, 32], dtype=pb.DTYPE_FLOAT32),
            pb.TensorSpec(name="fc.bias", shape=[32], dtype=pb.DTYPE_FLOAT32),
        ],
        buckets=[
            pb.BucketSpec(
                parameter_indices=[1, 0], dtype=pb.DTYPE_FLOAT32, num_elements=weight_rows * 32 + 32
            )
        ],
    )


def join(rank: int, world_size: int = 3, weight_rows: int = 64) -> pb.Join:
    return pb.Join(
        job_id="job",
        rank=rank,
        world_size=world_size,
        signature=signature(weight_rows),
        incarnation=f"i{rank}",
    )


def make_job(
    budget: ByteBudget,
    world_size: int = 3,
    metrics: CoordinatorMetrics | None = None,
    **options: object,
) -> tuple[Job, FakeClock]:
    clock = FakeClock()
    settings = JobSettings(world_size, CHUNK, 2 * CHUNK, **options)  # type: ignore[arg-type]
    job = Job("job", settings, budget, clock=clock, metrics=metrics)
    for rank in range(world_size):
        job.join(rank, join(rank, world_size))
    assert job.state is JobState.RUNNING
    broadcast_state(job)
    return job, clock


def broadcast_state(job: Job) -> None:
    """Rank 0's initial state broadcast (parameters only: the signature has no buffers)."""
    for offset in range(0, BUCKET_BYTES, CHUNK):
        payload = bytes(min(CHUNK, BUCKET_BYTES - offset))
        job.on_state_chunk(0, pb.StateChunk(offset=offset, payload=payload))
    assert job.broadcast.complete


def chunk(
    rank: int, step: int = 0, offset: int = 0, epoch: int = 0
) -> tuple[ChunkHeader, memoryview]:
    length = min(CHUNK, BUCKET_BYTES - offset)
    values = np.full(length // 4, float(rank + 1), dtype=np.float32)
    header = ChunkHeader(step=step, membership_epoch=epoch, offset=offset, dtype=pb.DTYPE_FLOAT32)
    return header, memoryview(values.tobytes())


def messages(actions: list[Action], kind: str) -> list[pb.CoordinatorMessage]:
    return [
        action.message
        for action in actions
        if isinstance(action, Send)
        and isinstance(action.message, pb.CoordinatorMessage)
        and action.message.WhichOneof("kind") == kind
    ]


def test_an_aborted_step_gives_back_every_buffered_byte() -> None:
    budget = ByteBudget(1 << 20)
    job, _ = make_job(budget)
    job.on_gradient(1, *chunk(1))  # parked until rank 0's arrives: order-independent sums
    job.on_gradient(2, *chunk(2, offset=CHUNK))
    assert budget.held_by("job") == budget.used > 0
    actions = job.on_gradient(0, *chunk(0, offset=3))  # misaligned: the step is aborted
    aborted = messages(actions, "step_aborted")
    assert [m.step_aborted.reason for m in aborted] == [
        pb.ABORT_REASON_MESSAGE_REJECTED,
        pb.ABORT_REASON_PEER_MESSAGE_REJECTED,
    ]
    assert (budget.used, job.open_step) == (0, 1)


def test_a_broken_job_gives_back_every_buffered_byte() -> None:
    budget = ByteBudget(1 << 20)
    job, _ = make_job(budget)
    job.on_gradient(1, *chunk(1))
    assert budget.used > 0
    actions = job.detach(2, orderly=False)
    assert job.state is JobState.BROKEN and budget.used == 0
    (lost,) = messages(actions, "step_aborted")
    assert lost.step_aborted.reason == pb.ABORT_REASON_PEER_LOST
    assert lost.step_aborted.culprit_rank == 2


def test_a_refused_job_ends_every_stream_as_refused() -> None:
    job = Job("job", JobSettings(2, CHUNK, 2 * CHUNK), ByteBudget(1 << 20), clock=FakeClock())
    (waiting,) = messages(job.join(0, join(0, 2)), "assembly")
    assert list(waiting.assembly.missing_ranks) == [1]
    actions = job.join(1, join(1, 2, weight_rows=63))
    (told,) = messages(actions, "assembly")
    assert told.assembly.refused.startswith("rank 1: ") and "fc.weight" in told.assembly.refused
    refusal = actions[-1]
    assert isinstance(refusal, Terminate)
    assert refusal.code is Code.INVALID_ARGUMENT and refusal.reason == pb.END_REASON_JOB_REFUSED
    assert refusal.ranks == (0, 1) and "fc.weight" in refusal.details


def test_elastic_loss_completes_the_step_over_the_live_ranks() -> None:
    budget = ByteBudget(1 << 20)
    job, _ = make_job(budget, on_failure="elastic", min_workers=2)
    for offset in range(0, BUCKET_BYTES, CHUNK):
        job.on_gradient(0, *chunk(0, offset=offset))
        job.on_gradient(1, *chunk(1, offset=offset))
    actions = job.detach(2, orderly=False)
    (change,) = messages(actions, "membership")
    assert change.membership.membership_epoch == 1 and list(change.membership.ranks) == [0, 1]
    averaged = [a for a in actions if isinstance(a, Send) and isinstance(a.message, bytes)]
    assert len(averaged) == 3  # every chunk completed over ranks 0 and 1
    assert (job.open_step, job.steps_completed, budget.used) == (1, 1, 0)


def test_liveness_ignores_departed_ranks_and_status_reports_it() -> None:
    job, clock = make_job(ByteBudget(1 << 20))
    clock.now += 3.0
    job.liveness.touch(0, reported_step=7)
    clock.now += 2.5
    assert job.silent_ranks(timeout_s=5.0) == [1, 2]
    job.detach(2, orderly=True)
    assert job.silent_ranks(timeout_s=5.0) == [1]
    status = job_status(job)
    assert [(m.rank, m.reported_step, m.last_seen_s) for m in status.members] == [
        (0, 7, 2.5),
        (1, 0, 5.5),
    ]
    # Rank 2 left orderly with nothing in flight: a normal finish, not a failure.
    assert status.state == "finishing" and status.last_checkpoint_step == -1
    reply = status_reply([job], "other", heartbeat_timeout_s=5.0)
    assert list(reply.jobs) == [] and reply.heartbeat_timeout_s == 5.0


def test_a_resumed_job_starts_at_the_checkpoint() -> None:
    job = Job("job", JobSettings(2, CHUNK, 2 * CHUNK), ByteBudget(1 << 20), clock=FakeClock())
    job.persistence.resume_from(Checkpoint("job", 12, 3, b"x" * (CHUNK + 1), {}))
    job.join(0, join(0, 2))
    actions = job.join(1, join(1, 2))
    welcome, other = messages(actions, "welcome")  # one per rank, each with its session
    assert welcome.welcome.session != other.welcome.session
    assert (welcome.welcome.start_step, welcome.welcome.membership_epoch) == (12, 3)
    assert welcome.welcome.resume_bytes == CHUNK + 1
    (blob,) = [
        a.message for a in actions if isinstance(a, Send) and isinstance(a.message, ResumeBlob)
    ]
    resume = [pb.CoordinatorMessage.FromString(raw).resume for raw in blob.messages()]
    assert [(c.offset, len(c.payload)) for c in resume] == [(0, CHUNK), (CHUNK, 1)]
    assert (job.open_step, job.persistence.last_checkpoint_step) == (12, 12)


def test_a_checkpoint_upload_becomes_one_persist() -> None:
    job, _ = make_job(ByteBudget(1 << 20), world_size=2)
    blob = bytes(range(256)) * 20  # 5120 bytes: two chunks
    first = pb.CheckpointChunk(step=0, offset=0, total_bytes=len(blob), payload=blob[:CHUNK])
    assert job.on_checkpoint_chunk(0, first) == []
    last = pb.CheckpointChunk(step=0, offset=CHUNK, total_bytes=len(blob), payload=blob[CHUNK:])
    (persist,) = job.on_checkpoint_chunk(0, last)
    assert (persist.step, persist.blob) == (0, blob)  # type: ignore[union-attr]


def test_step_reports_go_out_when_they_say_something_new_or_every_16_steps() -> None:
    job, clock = make_job(ByteBudget(1 << 30), metrics=CoordinatorMetrics())
    reported: dict[int, int] = {}  # step -> slowest rank
    for step in range(40):
        late = 1 if step < 20 else 2  # the laggard changes at step 20
        for rank in (0, 1, 2):
            if rank == late:
                clock.now += 0.05
            for offset in range(0, BUCKET_BYTES, CHUNK):
                actions = job.on_gradient(rank, *chunk(rank, step=step, offset=offset))
                for message in messages(actions, "step_report"):
                    reported[message.step_report.step] = message.step_report.slowest_rank
    # Step 0 names rank 1; nothing new until 16 steps later. From step 20 on, the windowed
    # means move towards rank 2, which is reported the step it becomes the slowest.
    assert reported[0] == 1 and reported[16] == 1
    assert not set(reported) & set(range(1, 16))
    switch = min(step for step, rank in reported.items() if rank == 2)
    assert 20 <= switch < 40
    assert set(reported) - {0, 16} <= {switch, switch + 16} | set(range(20, switch))


def test_a_completed_step_tells_the_lowest_rank_who_was_slowest() -> None:
    job, clock = make_job(ByteBudget(1 << 30), metrics=CoordinatorMetrics())
    actions: list[Action] = []
    for rank in (0, 2, 1):  # rank 1 is 50 ms behind the others on every chunk
        if rank == 1:
            clock.now += 0.05
        for offset in range(0, BUCKET_BYTES, CHUNK):
            actions += job.on_gradient(rank, *chunk(rank, offset=offset))
    reports = [
        (action.ranks, action.message.step_report)
        for action in actions
        if isinstance(action, Send)
        and not isinstance(action.message, bytes)
        and action.message.WhichOneof("kind") == "step_report"
    ]
    assert len(reports) == 1
    ranks, report = reports[0]
    assert tuple(ranks) == (0,)
    assert (report.step, report.slowest_rank) == (0, 1)
    assert abs(report.slowest_lag_s - 0.05) < 1e-9


def test_a_newcomer_whose_direct_heal_failed_gets_the_state_relayed() -> None:
    """A rejoining rank that says its direct read failed (`Join.heal_relayed`) makes the
    donor's request ask for the state itself; an ordinary newcomer's does not."""
    job, _ = make_job(ByteBudget(1 << 20), on_failure="elastic", min_workers=2)
    job.detach(2, orderly=False)
    (request,) = messages(job.join(2, join(2)), "state_request")
    assert request.state_request.for_rank == 2 and not request.state_request.relay
    offer = pb.CheckpointChunk(
        step=job.open_step, offset=0, total_bytes=5, payload=b"offer", heal=True
    )
    assert len(messages(job.on_checkpoint_chunk(0, offer), "welcome")) == 1  # rank 2 admitted
    job.detach(2, orderly=True)  # its read of the offer failed: it leaves and rejoins
    retry = join(2)
    retry.heal_relayed = True
    (request,) = messages(job.join(2, retry), "state_request")
    assert request.state_request.for_rank == 2 and request.state_request.relay
