"""A shard's replica of a job: ranges, the leader's views and aborts, and bitwise parity with S=1.

The parity test is the strongest one: S shards, each with its own `OpenStep`
over its byte range and chunks arriving in a random order, must return the
very bytes one unsharded coordinator returns, for random bucket sizes
(including buckets smaller than the shard count), rank counts and 16-bit wire
dtypes.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
from gradsync_proto import chunking
from gradsync_proto.codec import ChunkHeader, decode_gradient
from gradsync_proto.codes import Code
from gradsync_proto.v1 import gradsync_pb2 as pb
from gradsync_server.config import CoordinatorConfig, Role
from gradsync_server.dataplane.actions import Send
from gradsync_server.dataplane.budget import ByteBudget
from gradsync_server.dataplane.open_step import OpenStep
from gradsync_server.dataplane.plane import JobPlane, MembershipView, PlaneMember, check_view

CHUNK = 64
F32 = pb.DTYPE_FLOAT32


def clock() -> float:
    return 0.0


def view(
    sizes: list[int],
    ranks: list[int],
    *,
    epoch: int = 0,
    shard_count: int = 2,
    out: tuple[int, ...] = (),
    start_step: int = 0,
    job_id: str = "job",
) -> pb.ShardJobView:
    return pb.ShardJobView(
        job_id=job_id,
        world_size=len(ranks),
        membership_epoch=epoch,
        members=[pb.ShardMember(rank=r, incarnation=f"inc-{r}") for r in ranks],
        out_of_inputs=list(out),
        start_step=start_step,
        buckets=[pb.BucketSpec(dtype=F32, num_elements=n) for n in sizes],
        chunk_bytes=CHUNK,
        shard_count=shard_count,
    )


def shard_job(v: pb.ShardJobView, index: int = 1) -> JobPlane:
    return JobPlane.for_shard(v, index, f"shard {index} at b:1", ByteBudget(1 << 30), clock)


def header(step: int, bucket: int, offset: int, dtype: int = F32, epoch: int = 0) -> ChunkHeader:
    return ChunkHeader(
        step=step, membership_epoch=epoch, bucket_index=bucket, offset=offset, dtype=dtype
    )


def wire_bytes(values: np.ndarray, wire: int) -> bytes:
    if wire == pb.DTYPE_FLOAT16:
        return values.astype("<f2").tobytes()
    if wire == pb.DTYPE_BFLOAT16:
        return (values.astype("<f4").view(np.uint32) >> 16).astype("<u2").tobytes()
    return values.astype("<f4").tobytes()


def upload(job: JobPlane, rank: int, step: int, bucket: int, raw: bytes, **kw: int) -> list[Send]:
    """Send `rank`'s range of `bucket` to `job`'s shard; return the averaged sends."""
    wire = kw.get("dtype", F32)
    lo, hi = job.step.byte_range(bucket, wire)
    sends: list[Send] = []
    for offset, length in chunking.range_chunk_spans(lo, hi, CHUNK):
        outcome = job.on_gradient(
            rank, header(step, bucket, offset, **kw), memoryview(raw[offset : offset + length])
        )
        assert outcome.rejected is None, outcome.rejected
        sends += outcome.sends
    return sends


def payload_of(send: Send) -> tuple[ChunkHeader, bytes]:
    assert isinstance(send.message, bytes)
    decoded = decode_gradient(send.message)
    assert decoded is not None
    return decoded[0], bytes(decoded[1])


# ------------------------------------------------------------------ parity
@pytest.mark.parametrize("seed", range(25))
def test_sharded_averages_are_bitwise_those_of_one_coordinator(seed: int) -> None:
    rng = random.Random(seed)
    shard_count = rng.randint(2, 5)
    ranks = sorted(rng.sample(range(6), rng.randint(1, 4)))
    sizes = [rng.choice([1, 2, 3, rng.randint(4, 40), rng.randint(40, 400)]) for _ in range(3)]
    wires = [rng.choice([F32, pb.DTYPE_FLOAT16, pb.DTYPE_BFLOAT16]) for _ in sizes]
    signature = pb.ModelSignature(buckets=[pb.BucketSpec(dtype=F32, num_elements=n) for n in sizes])
    nprng = np.random.default_rng(seed)
    for step in range(2):
        values = {
            (r, b): wire_bytes(nprng.standard_normal(n).astype(np.float32), wires[b])
            for r in ranks
            for b, n in enumerate(sizes)
        }
        results = []
        for count in (1, shard_count):
            steps = []
            for index in range(count):
                membership = MembershipView(
                    "job", 0, {r: PlaneMember(r, f"inc-{r}") for r in ranks}
                )
                open_step = OpenStep(
                    membership, CHUNK, ByteBudget(1 << 30), clock, None, index, count
                )
                open_step.configure(signature, step)
                steps.append(open_step)
            arrivals = []
            for index, open_step in enumerate(steps):
                for (rank, bucket), raw in values.items():
                    lo, hi = open_step.byte_range(bucket, wires[bucket])
                    for offset, length in chunking.range_chunk_spans(lo, hi, CHUNK):
                        arrivals.append(
                            (index, rank, bucket, offset, raw[offset : offset + length])
                        )
            rng.shuffle(arrivals)
            out = [bytearray(len(values[(ranks[0], b)])) for b in range(len(sizes))]
            filled = [0] * len(sizes)
            for index, rank, bucket, offset, piece in arrivals:
                chunk = header(step, bucket, offset, wires[bucket])
                for action in steps[index].accept(rank, chunk, memoryview(piece)):
                    if isinstance(action, Send) and isinstance(action.message, bytes):
                        got, averaged = payload_of(action)
                        out[got.bucket_index][got.offset : got.offset + len(averaged)] = averaged
                        filled[got.bucket_index] += len(averaged)
            assert filled == [len(o) for o in out]
            for open_step in steps:
                holds = any(
                    open_step.byte_range(b, w)[0] < open_step.byte_range(b, w)[1]
                    for b, w in enumerate(wires)
                )
                # A shard that holds nothing of any bucket gets no chunk, and needs no step.
                assert open_step.step == (step + 1 if holds else step)
            results.append([bytes(o) for o in out])
        assert results[0] == results[1]


# ------------------------------------------------------------ range checks
def test_a_chunk_outside_the_shard_range_names_the_shard_and_both_ranges() -> None:
    job = shard_job(view([100], [0, 1]))  # shard 1 of 2 holds elements 50..100: bytes 200..400
    assert job.step.byte_range(0, F32) == (200, 400)
    outcome = job.on_gradient(0, header(0, 0, 0), memoryview(bytes(CHUNK)))
    assert outcome.rejected is not None
    rejected = outcome.rejected
    assert (rejected.rank, rejected.step, rejected.bucket_index) == (0, 0, 0)
    assert rejected.code == Code.INVALID_ARGUMENT
    assert "offset 0" in rejected.message and "[200, 400)" in rejected.message
    assert "shard 1 at b:1" in rejected.message


def test_a_chunk_on_the_unsharded_grid_or_of_the_wrong_length_is_refused() -> None:
    job = shard_job(view([100], [0, 1]))
    off_grid = job.on_gradient(0, header(0, 0, 256), memoryview(bytes(CHUNK)))
    assert off_grid.rejected is not None and "200 + multiples of 64" in off_grid.rejected.message
    job = shard_job(view([100], [0, 1]))
    short = job.on_gradient(0, header(0, 0, 392), memoryview(bytes(4)))
    assert short.rejected is not None
    assert "sent 4 bytes" in short.rejected.message and "expected 8" in short.rejected.message


def test_a_16_bit_wire_halves_the_range() -> None:
    job = shard_job(view([100], [0]))
    assert job.step.byte_range(0, pb.DTYPE_BFLOAT16) == (100, 200)
    raw = bytes(200)
    sends = upload(job, 0, 0, 0, raw, dtype=pb.DTYPE_BFLOAT16)
    assert [payload_of(s)[0].offset for s in sends] == [100, 164]
    assert job.step.step == 1


def test_buckets_empty_at_a_shard_are_never_waited_for() -> None:
    # 3 shards: a 2-element bucket has nothing at shard 2.
    job = shard_job(view([2, 30], [0], shard_count=3), index=2)
    assert job.step.byte_range(0, F32) == (8, 8)
    refused = job.on_gradient(0, header(0, 0, 8), memoryview(bytes(4)))
    assert refused.rejected is not None and "holds no byte" in refused.rejected.message
    job = shard_job(view([2, 30], [0], shard_count=3), index=2)
    upload(job, 0, 0, 1, bytes(120))
    assert job.step.step == 1, "the step completes with only the non-empty bucket"
    upload(job, 0, 1, 1, bytes(120))
    assert job.step.step == 2


def test_one_shard_keeps_the_unsharded_messages() -> None:
    membership = MembershipView("job", 0, {0: PlaneMember(0, "a")})
    open_step = OpenStep(membership, CHUNK, ByteBudget(1 << 20), clock, None)
    open_step.configure(pb.ModelSignature(buckets=[pb.BucketSpec(dtype=F32, num_elements=100)]), 0)
    with pytest.raises(Exception, match="offsets must be multiples of 64 below 400"):
        open_step.accept(0, header(0, 0, 8), memoryview(bytes(CHUNK)))


def test_an_invalid_shard_index_is_refused() -> None:
    with pytest.raises(ValueError, match=r"shard index 2 is not in 0\.\.1"):
        OpenStep(MembershipView("job"), CHUNK, ByteBudget(1 << 20), clock, None, 2, 2)
    assert check_view(view([4], [0], shard_count=2), 2) is not None
    assert check_view(view([4], [0], shard_count=2), 1) is None


# ------------------------------------------------------------ the leader's view
def test_an_elastic_shrink_completes_chunks_over_the_live_ranks() -> None:
    job = shard_job(view([32], [0, 1, 2]))  # range: bytes 64..128, one chunk
    raw = np.arange(32, dtype=np.float32).tobytes()
    assert upload(job, 0, 0, 0, raw) == []
    assert upload(job, 2, 0, 0, raw) == []
    outcome = job.apply(view([32], [0, 2], epoch=1))
    assert len(outcome.sends) == 1
    sent = outcome.sends[0]
    assert sent.ranks == (0, 2)
    got, averaged = payload_of(sent)
    assert got.membership_epoch == 1 and got.contributors == 2
    assert averaged == raw[64:128]
    assert job.step.step == 1


def test_a_removal_without_a_new_epoch_waits_for_the_leaders_abort() -> None:
    job = shard_job(view([32], [0, 1]))
    upload(job, 0, 0, 0, bytes(128))
    assert job.apply(view([32], [0])).sends == []
    assert job.step.step == 0
    job.abort(0)
    assert job.step.step == 1


def test_a_rejoining_rank_is_expected_from_then_on() -> None:
    job = shard_job(view([32], [1]))
    job.apply(view([32], [0, 1], epoch=1))
    assert upload(job, 1, 0, 0, bytes(128), epoch=1) == []
    assert len(upload(job, 0, 0, 0, bytes(128), epoch=1)) == 1


def test_a_rejoin_after_higher_ranks_were_summed_is_reported() -> None:
    job = shard_job(view([32], [1, 2]))
    upload(job, 1, 0, 0, bytes(128))
    outcome = job.apply(view([32], [0, 1, 2], epoch=1))
    assert outcome.rejected is not None
    assert outcome.rejected.code == Code.ABORTED and "rank order" in outcome.rejected.message


def test_out_of_inputs_completes_and_divides_by_the_membership() -> None:
    job = shard_job(view([32], [0, 1]))
    raw = np.full(32, 4.0, dtype=np.float32).tobytes()
    upload(job, 0, 0, 0, raw)
    outcome = job.apply(view([32], [0, 1], out=(1,)))
    _, averaged = payload_of(outcome.sends[0])
    assert np.frombuffer(averaged, np.float32).tolist() == [2.0] * 16
    assert outcome.sends[0].ranks == (0,)
    job.apply(view([32], [0, 1]))  # every rank joined: all take part again
    assert job.step.out_of_inputs == set()


def test_a_shard_sends_no_step_report() -> None:
    job = shard_job(view([32], [0]))
    sends = upload(job, 0, 0, 0, bytes(128))
    assert len(sends) == 1 and isinstance(sends[0].message, bytes)


def test_aborts_drop_the_open_step_and_remember_later_ones() -> None:
    job = shard_job(view([32], [0, 1]))
    upload(job, 0, 0, 0, bytes(128))
    job.abort(0)
    assert job.step.step == 1
    assert job.on_gradient(1, header(0, 0, 64), memoryview(bytes(64))).rejected is None
    job.abort(2)  # ahead of the shard: skipped once step 1 completes
    upload(job, 0, 1, 0, bytes(128))
    upload(job, 1, 1, 0, bytes(128))
    assert job.step.step == 3
    job.abort(1)  # already past: nothing
    assert job.step.step == 3


def test_one_rejection_per_step_is_reported() -> None:
    job = shard_job(view([32], [0, 1]))
    first = job.on_gradient(0, header(5, 0, 64), memoryview(bytes(64)))
    assert first.rejected is not None and "future step 5" in first.rejected.message
    assert job.on_gradient(1, header(5, 0, 64), memoryview(bytes(64))).rejected is None


def test_hello_needs_the_announced_incarnation() -> None:
    job = shard_job(view([32], [0, 1]))
    assert job.hello_problem(0, "inc-0", b"") is None
    wrong = job.hello_problem(0, "other", b"")
    assert wrong is not None and "'other'" in wrong and "'inc-0'" in wrong
    stranger = job.hello_problem(3, "inc-3", b"")
    assert stranger is not None and "not a member" in stranger


def test_chunks_ahead_of_the_view_wait_for_the_leader() -> None:
    job = shard_job(view([32], [0, 1]))
    assert job.awaits_leader(header(1, 0, 64))
    assert job.awaits_leader(header(0, 0, 64, epoch=1))
    assert not job.awaits_leader(header(0, 0, 64))


# ------------------------------------------------------------ configuration
def test_the_advertised_address_follows_the_bound_interface() -> None:
    assert (
        CoordinatorConfig(role=Role.SHARD, leader="a:1", host="10.0.0.5").advertised(7)
        == "10.0.0.5:7"
    )
    # Bound to every interface: the address this host reaches its leader from.
    assert (
        CoordinatorConfig(role=Role.SHARD, leader="127.0.0.1:1", host="0.0.0.0").advertised(7)
        == "127.0.0.1:7"
    )
    assert CoordinatorConfig(role=Role.SHARD, leader="a:1", host="::1").advertised(7) == "[::1]:7"
    assert CoordinatorConfig(role=Role.SHARD, leader="a:1", advertise="b:9").advertised(7) == "b:9"
    with pytest.raises(ValueError, match="leader"):
        CoordinatorConfig(role=Role.SHARD, leader="")
