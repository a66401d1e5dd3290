"""A sharded leader's jobs: they wait for every shard, tell shards what they decide, end on loss.

Pure: a `Job` whose `shard_map` is a plain function. What the shards are told
is the job's control events (`Job.take_events`), which it has already applied
to its own data plane.
"""

from __future__ import annotations

from gradsync_proto.codes import Code
from gradsync_proto.v1 import gradsync_pb2 as pb
from gradsync_server.control.job import Job, JobState
from gradsync_server.control.settings import JobSettings
from gradsync_server.dataplane.actions import Send, Terminate
from gradsync_server.dataplane.budget import ByteBudget
from gradsync_server.errors import RejectedMessage

CHUNK = 4096
BUCKET_BYTES = (64 * 32 + 32) * 4


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def join(rank: int, world_size: int) -> pb.Join:
    signature = pb.ModelSignature(
        parameters=[
            pb.TensorSpec(name="fc.weight", shape=[64, 32], dtype=pb.DTYPE_FLOAT32),
            pb.TensorSpec(name="fc.bias", shape=[32], dtype=pb.DTYPE_FLOAT32),
        ],
        buckets=[
            pb.BucketSpec(
                parameter_indices=[1, 0], dtype=pb.DTYPE_FLOAT32, num_elements=64 * 32 + 32
            )
        ],
    )
    return pb.Join(
        job_id="job", rank=rank, world_size=world_size, signature=signature, incarnation=f"i{rank}"
    )


def broadcast_state(job: Job) -> None:
    for offset in range(0, BUCKET_BYTES, CHUNK):
        payload = bytes(min(CHUNK, BUCKET_BYTES - offset))
        job.on_state_chunk(0, pb.StateChunk(offset=offset, payload=payload))


SHARDS = [
    pb.ShardAddress(index=0, address=""),
    pb.ShardAddress(index=1, address="b:50051"),
]


class ShardMap:
    """What the registry would answer: None while a shard is missing."""

    def __init__(self) -> None:
        self.shards: list[pb.ShardAddress] | None = None

    def __call__(self) -> list[pb.ShardAddress] | None:
        return self.shards


def sharded_job(shard_map: ShardMap, world_size: int = 2, **options: object) -> Job:
    return Job(
        "job",
        JobSettings(world_size, CHUNK, 2 * CHUNK, shard_count=2, **options),
        ByteBudget(1 << 24),
        clock=FakeClock(),
        shard_map=shard_map,
    )


def kinds(actions: list[object]) -> list[str]:
    return [
        a.message.WhichOneof("kind")
        for a in actions
        if isinstance(a, Send) and not isinstance(a.message, bytes)
    ]


def events(job: Job) -> list[str]:
    """The kinds of the control events `job` decided since the last call."""
    return [str(event.WhichOneof("kind")) for event in job.take_events()]


def aborted_steps(job: Job) -> list[int]:
    return [e.abort.step for e in job.take_events() if e.WhichOneof("kind") == "abort"]


def end_code(job: Job) -> tuple[Code, str]:
    end = job.end_event().job_end
    return Code(end.code), end.message


def running_job(**options: object) -> Job:
    shard_map = ShardMap()
    shard_map.shards = SHARDS
    job = sharded_job(shard_map, **options)
    for rank in range(2):
        job.join(rank, join(rank, 2))
    broadcast_state(job)
    return job


def test_an_assembled_job_waits_for_its_shards_before_the_welcome() -> None:
    shard_map = ShardMap()
    job = sharded_job(shard_map)
    job.join(0, join(0, 2))
    actions = job.join(1, join(1, 2))
    assert kinds(actions) == ["assembly"] and job.state is JobState.ASSEMBLING
    assert events(job) == []  # the shards hear of a job once it starts
    assert kinds(job.start_if_ready()) == ["assembly"]  # still waiting
    shard_map.shards = SHARDS
    started = job.start_if_ready()
    # One Welcome per rank: each carries that rank's own session secret.
    assert kinds(started) == ["welcome", "welcome"] and job.state is JobState.RUNNING
    welcome = started[0].message.welcome  # type: ignore[union-attr]
    assert list(welcome.shards) == SHARDS
    assert events(job) == ["job"]
    assert job.start_if_ready() == []  # already running


def test_an_incomplete_job_does_not_start_when_the_shards_arrive() -> None:
    shard_map = ShardMap()
    job = sharded_job(shard_map)
    job.join(0, join(0, 2))
    shard_map.shards = SHARDS
    assert job.start_if_ready() == [] and job.state is JobState.ASSEMBLING
    assert kinds(job.join(1, join(1, 2))) == ["welcome", "welcome"]


def test_an_unsharded_job_starts_with_an_empty_shard_list() -> None:
    job = Job("job", JobSettings(1, CHUNK, 2 * CHUNK), ByteBudget(1 << 24), clock=FakeClock())
    actions = job.join(0, join(0, 1))
    assert list(actions[0].message.welcome.shards) == []  # type: ignore[union-attr]
    assert job.take_events() == []  # nobody to tell


def test_the_view_carries_members_epoch_layout_and_start_step() -> None:
    job = running_job()
    [started] = job.take_events()
    view = started.job
    assert view.job_id == "job" and view.world_size == 2 and view.membership_epoch == 0
    assert [(m.rank, m.incarnation) for m in view.members] == [(0, "i0"), (1, "i1")]
    assert [(b.dtype, b.num_elements) for b in view.buckets] == [(pb.DTYPE_FLOAT32, 64 * 32 + 32)]
    assert (view.start_step, view.chunk_bytes, view.shard_count) == (0, CHUNK, 2)
    assert list(view.out_of_inputs) == []
    sessions = [job.members[rank].session for rank in (0, 1)]
    assert [m.session for m in view.members] == sessions and sessions[0] != sessions[1]
    # The leader's own plane holds the same membership.
    assert job.plane.membership.ranks() == (0, 1) and job.plane.membership.epoch == 0
    assert job.take_events() == []  # nothing else happened


def test_a_view_follows_every_change_of_members_epoch_and_out_of_inputs() -> None:
    job = running_job(on_failure="elastic")
    job.take_events()
    job.on_out_of_inputs(1, pb.OutOfInputs(step=0))
    [joined] = job.take_events()
    assert list(joined.job.out_of_inputs) == [1] and job.in_flight.out_of_inputs == {1}
    job.detach(1, orderly=False)
    [shrunk] = job.take_events()
    assert shrunk.job.membership_epoch == 1
    assert [(m.rank, m.incarnation) for m in shrunk.job.members] == [(0, "i0")]
    assert job.plane.membership.ranks() == (0,) and job.in_flight.out_of_inputs == set()


def test_a_breaking_job_tells_its_shards_only_the_abort() -> None:
    job = running_job()
    job.take_events()
    job.detach(1, orderly=False)  # abort policy: the job breaks
    assert job.state is JobState.BROKEN and aborted_steps(job) == [0]


def test_every_aborted_step_is_an_event_once() -> None:
    job = running_job()
    job.take_events()
    actions = job.reject(1, RejectedMessage(Code.INVALID_ARGUMENT, "bad", step=0))
    assert kinds(actions) == ["step_aborted", "step_aborted"]
    assert aborted_steps(job) == [0] and job.open_step == 1
    assert job.take_events() == []


def test_a_lost_shard_ends_every_stream_naming_shard_job_step_and_checkpoint() -> None:
    job = running_job()
    job.persistence.saved(0)
    actions = job.end_for_shard_loss(1, "b:50051", "silent for 6.0s")
    assert job.state is JobState.BROKEN
    [terminate] = actions
    assert isinstance(terminate, Terminate)
    assert terminate.ranks == (0, 1) and terminate.code is Code.UNAVAILABLE
    assert terminate.reason == pb.END_REASON_SHARD_LOST
    assert terminate.details == (
        "shard 1 at b:50051 was lost (silent for 6.0s); job 'job' stops at step 0; once "
        "every shard is registered again it goes on from the ranks' own state if they agree "
        "on it, else from its last checkpoint (step 0)"
    )
    assert job.outcome() == ("broken", terminate.details)
    assert end_code(job)[0] is Code.ABORTED


def test_a_lost_shard_ends_a_job_without_checkpoint_saying_it_starts_over() -> None:
    job = running_job()
    [terminate] = job.end_for_shard_loss(1, "b:50051", "its control stream ended")
    assert isinstance(terminate, Terminate)
    assert "has no checkpoint" in terminate.details and "step 0" in terminate.details
    assert "else from the beginning" in terminate.details


def test_a_lost_shard_ends_an_assembling_job_too() -> None:
    job = sharded_job(ShardMap())
    job.join(0, join(0, 2))
    [terminate] = job.end_for_shard_loss(1, "b:50051", "gone")
    assert isinstance(terminate, Terminate) and terminate.ranks == (0,)
    assert "starts once every shard is registered again" in terminate.details


def test_a_finished_job_ends_its_shard_streams_ok() -> None:
    job = running_job()
    job.detach(0, orderly=True)
    job.detach(1, orderly=True)
    assert end_code(job) == (Code.OK, "finished after 0 steps")


def test_a_shard_rejection_of_the_open_step_aborts_it() -> None:
    job = running_job()
    rejection = RejectedMessage(Code.INVALID_ARGUMENT, "bad range at shard 1", step=0)
    job.take_events()
    actions = job.reject_from_shard(1, rejection)
    assert actions is not None and aborted_steps(job) == [0] and job.open_step == 1


def test_a_shard_rejection_of_a_step_the_leader_finished_still_aborts_it() -> None:
    job = running_job()
    job.in_flight.step = 5  # the leader's range of step 4 completed; shard 1's cannot
    rejection = RejectedMessage(Code.INVALID_ARGUMENT, "bad range at shard 1", step=4)
    job.take_events()
    actions = job.reject_from_shard(1, rejection)
    assert actions is not None and aborted_steps(job) == [4]
    culprit, others = (a.message.step_aborted for a in actions)  # type: ignore[union-attr]
    assert (culprit.reason, culprit.message) == (
        pb.ABORT_REASON_MESSAGE_REJECTED,
        "bad range at shard 1",
    )
    assert others.reason == pb.ABORT_REASON_PEER_MESSAGE_REJECTED
    assert [a.ranks for a in actions] == [(1,), (0,)]  # type: ignore[union-attr]
    assert job.open_step == 5  # the leader keeps its step
    assert job.reject_from_shard(1, rejection) is None  # aborted once


def test_a_shard_rejection_with_nothing_to_abort_is_ignored() -> None:
    job = running_job()
    old = RejectedMessage(Code.INVALID_ARGUMENT, "old", step=7)
    assert job.reject_from_shard(1, old) is None  # not the open step nor the one before
    stranger = RejectedMessage(Code.INVALID_ARGUMENT, "who?", step=0)
    assert job.reject_from_shard(5, stranger) is None
