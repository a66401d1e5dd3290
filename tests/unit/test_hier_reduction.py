"""Hierarchical aggregation at the coordinator: local groups, units, covers (pure, no sockets).

A local leader uploads its host's partial sum with `covered_ranks`; the
coordinator must weigh it by the ranks it covers, sum units in ascending
leader order whatever the arrival order, refuse followers and bad covers
naming the values, count arrivals for every covered rank, send averages to
unit leaders only, and keep the elastic rules (a lost follower changes no
unit; a lost leader takes its unit and its followers with it).
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from gradsync_proto.codec import ChunkHeader, decode_gradient
from gradsync_proto.codes import Code
from gradsync_proto.v1 import gradsync_pb2 as pb
from gradsync_server.control.job import Job, JobState
from gradsync_server.control.settings import JobSettings
from gradsync_server.dataplane.actions import Action, Send, Terminate
from gradsync_server.dataplane.aggregation import BucketReduction
from gradsync_server.dataplane.budget import ByteBudget
from gradsync_server.dataplane.host_groups import (
    LocalGroups,
    form_groups,
    host_id_problem,
    local_world_size_problems,
)
from gradsync_server.dataplane.plane import JobPlane

CHUNK = 256
ELEMENTS = 160  # 640 bytes of float32: chunks of 256, 256, 128
BUCKET_BYTES = ELEMENTS * 4
F32 = pb.DTYPE_FLOAT32
#: Ranks 0 and 1 share host "a", rank 2 is alone on "b", rank 3 sends no host id.
HOSTS = {0: "a", 1: "a", 2: "b", 3: ""}


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def signature() -> pb.ModelSignature:
    return pb.ModelSignature(
        parameters=[pb.TensorSpec(name="w", shape=[ELEMENTS], dtype=F32)],
        buckets=[pb.BucketSpec(parameter_indices=[0], dtype=F32, num_elements=ELEMENTS)],
    )


def join(rank: int, host_id: str, world_size: int, local_world_size: int = 0) -> pb.Join:
    return pb.Join(
        job_id="job",
        rank=rank,
        world_size=world_size,
        signature=signature(),
        incarnation=f"i{rank}",
        host_id=host_id,
        local_world_size=local_world_size,
    )


def started_job(hosts: dict[int, str] = HOSTS, **options: object) -> tuple[Job, list[Action]]:
    """A job whose ranks joined with `hosts`; its start actions; the state broadcast done."""
    job = Job(
        "job",
        JobSettings(len(hosts), CHUNK, 2 * CHUNK, **options),
        ByteBudget(1 << 24),
        clock=FakeClock(),
    )  # type: ignore[arg-type]
    actions: list[Action] = []
    for rank, host_id in hosts.items():
        actions = job.join(rank, join(rank, host_id, len(hosts)))
    assert job.state is JobState.RUNNING
    for offset in range(0, BUCKET_BYTES, CHUNK):
        job.on_state_chunk(
            0, pb.StateChunk(offset=offset, payload=bytes(CHUNK)[: BUCKET_BYTES - offset])
        )
    return job, actions


def values(rank: int, step: int = 0) -> np.ndarray:
    return np.random.default_rng(10 * rank + step).standard_normal(ELEMENTS).astype(np.float32)


def header(step: int, offset: int, covered: tuple[int, ...] = (), epoch: int = 0) -> ChunkHeader:
    return ChunkHeader(
        step=step, membership_epoch=epoch, offset=offset, dtype=F32, covered_ranks=covered
    )


def upload(
    job: Job, rank: int, data: np.ndarray, covered: tuple[int, ...] = (), step: int = 0
) -> list[Action]:
    raw = data.astype("<f4").tobytes()
    actions: list[Action] = []
    for offset in range(0, len(raw), CHUNK):
        piece = memoryview(raw[offset : offset + CHUNK])
        actions += job.on_gradient(rank, header(step, offset, covered), piece)
    return actions


def averages(actions: list[Action]) -> tuple[bytes, set[tuple[int, ...]], set[int]]:
    """The averaged bucket, the rank sets it went to, and its `contributors`."""
    result = bytearray(BUCKET_BYTES)
    targets, contributors = set(), set()
    for action in actions:
        if isinstance(action, Send) and isinstance(action.message, bytes):
            decoded = decode_gradient(action.message)
            assert decoded is not None
            chunk, payload = decoded
            result[chunk.offset : chunk.offset + len(payload)] = payload
            targets.add(action.ranks)
            contributors.add(chunk.contributors)
    return bytes(result), targets, contributors


def aborts(actions: list[Action]) -> list[pb.StepAborted]:
    return [
        a.message.step_aborted
        for a in actions
        if isinstance(a, Send)
        and not isinstance(a.message, bytes)
        and a.message.WhichOneof("kind") == "step_aborted"
    ]


# ----------------------------------------------------------------- grouping
def test_groups_form_from_host_ids_and_lone_or_empty_ranks_are_flat() -> None:
    assert form_groups({0: "a", 1: "b", 2: "a", 3: "", 4: "", 5: "c", 6: "b"}) == [(0, 2), (1, 6)]
    _job, actions = started_job()
    welcomes = {a.ranks[0]: a.message.welcome for a in actions if isinstance(a, Send)}  # type: ignore[union-attr]
    assert [list(welcomes[r].local_ranks) for r in range(4)] == [[0, 1], [0, 1], [], []]
    assert len(welcomes[0].local_secret) == 32
    assert welcomes[0].local_secret == welcomes[1].local_secret
    assert welcomes[2].local_secret == welcomes[3].local_secret == b""
    other, _ = started_job()  # a fresh secret per group and job
    assert other.membership.local_group_of(0)[1] != welcomes[0].local_secret


def test_host_ids_must_be_short_and_printable() -> None:
    assert host_id_problem(3, "node-1/abc") is None
    for bad in ("x" * 257, "tab\there"):
        problem = host_id_problem(3, bad)
        assert problem is not None and "rank 3" in problem and "256" in problem


def test_a_local_world_size_mismatch_refuses_the_job_naming_rank_host_and_ranks() -> None:
    problems = local_world_size_problems(
        {0: "a", 1: "a", 2: "b", 3: ""}, {0: 2, 1: 3, 2: 2, 3: 8}, [(0, 1)]
    )
    assert problems == [
        "rank 1 on host_id 'a' has LOCAL_WORLD_SIZE 3, but the coordinator found 2 rank(s) with "
        "that host_id: [0, 1]",
        "rank 2 on host_id 'b' has LOCAL_WORLD_SIZE 2, but the coordinator found 1 rank(s) with "
        "that host_id: [2]",
    ]
    job = Job("job", JobSettings(2, CHUNK, 2 * CHUNK), ByteBudget(1 << 24), clock=FakeClock())
    job.join(0, join(0, "h", 2, local_world_size=2))
    actions = job.join(1, join(1, "h", 2, local_world_size=4))
    ends = [a for a in actions if isinstance(a, Terminate)]
    assert job.state is JobState.REFUSED and ends and ends[-1].ranks == (0, 1)
    assert ends[-1].code is Code.FAILED_PRECONDITION
    assert "rank 1 on host_id 'h' has LOCAL_WORLD_SIZE 4" in ends[-1].details
    assert "[0, 1]" in ends[-1].details


# ------------------------------------------------------------ the reduction
def test_units_sum_in_leader_order_bitwise_whatever_the_arrival_order() -> None:
    """Units 0 (covers 2 ranks), 2 (flat), 3 (covers 3): ((p0 + p2) + p3) / 6, every order."""
    partial = {0: values(0) * 1e3, 2: values(2), 3: values(3) * 1e-3}
    weights = {0: 2, 2: 1, 3: 3}
    expected = ((partial[0] + partial[2]) + partial[3]) / np.float32(6)
    for order in itertools.permutations(partial):
        reduction = BucketReduction([3, 0, 2], F32, BUCKET_BYTES, CHUNK)
        result = None
        for rank in order:
            result = reduction.add(rank, 0, partial[rank].tobytes()[:CHUNK], weight=weights[rank])
        assert result is not None and reduction.last_contributors == 6
        assert bytes(result) == expected.tobytes()[:CHUNK], order


def test_an_explicit_divisor_overrides_the_summed_weights() -> None:
    reduction = BucketReduction([0, 2], F32, 8, 8, divisor=5)
    reduction.add(2, 0, np.float32([5, 10]).tobytes())
    result = reduction.add(0, 0, np.float32([5, 5]).tobytes(), weight=3)
    assert result is not None and np.frombuffer(result, np.float32).tolist() == [2.0, 3.0]
    assert reduction.last_contributors == 4


def test_a_partial_sum_and_a_flat_rank_average_over_every_rank_and_only_leaders_hear() -> None:
    job, _ = started_job({0: "a", 1: "a", 2: ""})
    partial = values(0) + values(1)
    actions = upload(job, 2, values(2))
    actions += upload(job, 0, partial, covered=(0, 1))
    result, targets, contributors = averages(actions)
    expected = (partial + values(2)) / np.float32(3)
    assert result == expected.astype("<f4").tobytes()
    assert targets == {(0, 2)} and contributors == {3}
    assert job.open_step == 1


def test_a_follower_upload_is_refused_naming_rank_step_bucket_and_leader() -> None:
    job, _ = started_job()
    refused = aborts(job.on_gradient(1, header(0, 0), memoryview(values(1).tobytes()[:CHUNK])))
    mine = next(a for a in refused if a.reason == pb.ABORT_REASON_MESSAGE_REJECTED)
    assert mine.code == Code.INVALID_ARGUMENT and mine.culprit_rank == 1
    assert "rank 1 sent bucket 0 of step 0" in mine.message
    assert "local leader, rank 0" in mine.message and "[0, 1]" in mine.message


@pytest.mark.parametrize(
    ("rank", "covered", "why"),
    [
        (0, (1, 0), "must start with the sender"),
        (0, (0, 0), "ascending without repeats"),
        (0, (0, 2), "ranks [2] are outside its local group [0, 1]"),
        (2, (2, 3), "it aggregates flat (local group [2])"),
        (3, (2,), "it aggregates flat (local group [3])"),
    ],
)
def test_bad_covers_are_refused_naming_both_lists(
    rank: int, covered: tuple[int, ...], why: str
) -> None:
    job, _ = started_job()
    payload = memoryview(values(rank).tobytes()[:CHUNK])
    refused = aborts(job.on_gradient(rank, header(0, 0, covered), payload))
    mine = next(a for a in refused if a.culprit_rank == rank and a.code == Code.INVALID_ARGUMENT)
    assert f"rank {rank} sent bucket 0 of step 0 covering ranks {list(covered)}" in mine.message
    assert why in mine.message


def test_followers_are_not_late_when_their_leader_delivered() -> None:
    job, _ = started_job()
    upload(job, 0, values(0) + values(1), covered=(0, 1))
    assert job.late_ranks() == {2: [0], 3: [0]}


def test_a_nonfinite_partial_sum_names_the_leader_and_its_covers() -> None:
    job, _ = started_job(nonfinite="abort")
    poisoned = values(0)
    poisoned[3] = np.nan
    refused = aborts(upload(job, 0, poisoned, covered=(0, 1)))
    assert refused[0].reason == pb.ABORT_REASON_NONFINITE
    assert "rank 0 (local leader, summing ranks [0, 1])" in refused[0].message


# ------------------------------------------------------------------ elastic
def test_a_lost_follower_changes_no_unit_and_covers_of_the_open_step_still_count() -> None:
    job, _ = started_job({0: "a", 1: "a", 2: ""}, on_failure="elastic", min_workers=1)
    upload(job, 2, values(2))
    job.detach(1, orderly=False)
    assert job.membership_epoch == 1 and 1 not in job.members
    partial = values(0) + values(1)  # posted before it was lost: it counts
    result, targets, contributors = averages(upload(job, 0, partial, covered=(0, 1)))
    assert result == ((partial + values(2)) / np.float32(3)).astype("<f4").tobytes()
    assert targets == {(0, 2)} and contributors == {3}
    # The next step: rank 1 was not a member when it began.
    payload = memoryview(values(0, 1).tobytes()[:CHUNK])
    refused = aborts(job.on_gradient(0, header(1, 0, (0, 1), epoch=1), payload))
    assert "ranks [1] were not members when step 1 began" in refused[0].message


def test_a_lost_leader_takes_its_unit_and_its_followers_with_it() -> None:
    job, _ = started_job({0: "", 1: "a", 2: "a", 3: "a"}, on_failure="elastic", min_workers=1)
    upload(job, 0, values(0))
    actions = job.detach(1, orderly=False)
    ends = [a for a in actions if isinstance(a, Terminate)]
    assert ends and ends[0].ranks == (2, 3) and ends[0].reason == pb.END_REASON_PEER_LOST
    assert "local leader of ranks [1, 2, 3]" in ends[0].details
    assert job.members.keys() == {0} and job.membership_epoch == 1
    result, targets, contributors = averages(actions)  # rank 0 alone completes the step
    assert result == values(0).astype("<f4").tobytes()
    assert targets == {(0,)} and contributors == {1}


def test_a_rejoining_rank_is_flat_and_a_leaderless_group_ends() -> None:
    groups = LocalGroups([(0, 1, 2), (4, 5)])
    groups.make_flat(2)
    assert groups.groups() == [(0, 1), (4, 5)] and groups.units(range(6)) == (0, 2, 3, 4)
    groups.make_flat(4)
    assert groups.groups() == [(0, 1)] and groups.leader_of(5) == 5
    groups.drop_group(0)
    assert groups.groups() == [] and groups.followers_of(0) == ()


# ------------------------------------------------------------------- shards
def test_a_shard_forms_the_leaders_units_and_applies_the_same_rules() -> None:
    view = pb.ShardJobView(
        job_id="job",
        world_size=3,
        members=[pb.ShardMember(rank=r, incarnation=f"i{r}") for r in range(3)],
        buckets=[pb.BucketSpec(dtype=F32, num_elements=ELEMENTS)],
        chunk_bytes=CHUNK,
        shard_count=2,
        local_groups=[pb.LocalGroup(ranks=[0, 1])],
    )
    shard = JobPlane.for_shard(view, 1, "shard 1", ByteBudget(1 << 24), FakeClock())
    lo, hi = shard.step.byte_range(0, F32)
    partial = (values(0) + values(1)).astype("<f4").tobytes()
    flat = values(2).astype("<f4").tobytes()
    refused = shard.on_gradient(1, header(0, lo), memoryview(flat[lo : lo + CHUNK]))
    assert refused.rejected is not None and "local leader, rank 0" in refused.rejected.message
    shard = JobPlane.for_shard(view, 1, "shard 1", ByteBudget(1 << 24), FakeClock())
    sends = []
    for offset in range(lo, hi, CHUNK):
        end = min(offset + CHUNK, hi)
        sends += shard.on_gradient(2, header(0, offset), memoryview(flat[offset:end])).sends
        sends += shard.on_gradient(
            0, header(0, offset, (0, 1)), memoryview(partial[offset:end])
        ).sends
    expected = ((values(0) + values(1)) + values(2)) / np.float32(3)
    result, targets, contributors = averages(sends)  # type: ignore[arg-type]
    assert result[lo:hi] == expected.astype("<f4").tobytes()[lo:hi]
    assert targets == {(0, 2)} and contributors == {3}
