"""NaN/Inf contributions and float32 overflow in the sum: classification, policy, parity.

The aggregation must stay bitwise what it was for real gradients (and for
every arrival order), repair only the elements whose float32 sum overflowed
from finite inputs, and let the `--nonfinite` policy name the rank, step and
bucket of a NaN/Inf contribution, at the leader and at a shard.
"""

from __future__ import annotations

import logging
import random

import numpy as np
import pytest
from gradsync.errors import NonFiniteGradientError, StepAbortedError
from gradsync.path.step_results import abort_error
from gradsync.status import format_status
from gradsync_proto import chunking
from gradsync_proto.codec import ChunkHeader
from gradsync_proto.codes import Code
from gradsync_proto.v1 import gradsync_pb2 as pb
from gradsync_server.control.job import Job, JobState
from gradsync_server.control.settings import JobSettings
from gradsync_server.control.status import job_status
from gradsync_server.dataplane.actions import Send
from gradsync_server.dataplane.aggregation import (
    BucketReduction,
    Magnitude,
    classify,
    count_nonfinite,
    examine,
)
from gradsync_server.dataplane.budget import ByteBudget
from gradsync_server.dataplane.nonfinite import NonFiniteContribution, NonFiniteLog
from gradsync_server.dataplane.plane import JobPlane
from gradsync_server.metrics import CoordinatorMetrics

F32, F64, F16, BF16 = pb.DTYPE_FLOAT32, pb.DTYPE_FLOAT64, pb.DTYPE_FLOAT16, pb.DTYPE_BFLOAT16
CHUNK = 4096
BIG = np.float32(3e38)  # two of them overflow a float32 sum; their mean does not


def bf16(values: np.ndarray) -> bytes:
    return (values.astype("<f4").view(np.uint32) >> 16).astype("<u2").tobytes()


# ------------------------------------------------------------------ classification
@pytest.mark.parametrize(
    ("values", "dtype", "expected"),
    [
        (np.array([1.0, -2.0, 1e19], "<f4"), F32, Magnitude.TAME),
        (np.array([1.0, 3e38], "<f4"), F32, Magnitude.LARGE),
        (np.array([1.0, np.nan], "<f4"), F32, Magnitude.NONFINITE),
        (np.array([-np.inf, 3e38], "<f4"), F32, Magnitude.NONFINITE),
        (np.array([1e150, -1.0], "<f8"), F64, Magnitude.TAME),
        (np.array([1.7e308, 0.0], "<f8"), F64, Magnitude.LARGE),
        (np.array([np.inf], "<f8"), F64, Magnitude.NONFINITE),
        (np.array([65504.0, -65504.0], "<f2"), F16, Magnitude.TAME),
        (np.array([1.0, np.nan], "<f2"), F16, Magnitude.NONFINITE),
        (np.array([-np.inf], "<f2"), F16, Magnitude.NONFINITE),
        (np.array([], "<f4"), F32, Magnitude.TAME),
    ],
)
def test_classify(values: np.ndarray, dtype: int, expected: Magnitude) -> None:
    assert classify(values.tobytes(), dtype) is expected


def test_classify_bfloat16_by_its_exponent() -> None:
    assert classify(bf16(np.array([1.0, 1e18], np.float32)), BF16) is Magnitude.TAME
    assert classify(bf16(np.array([1.0, 3e38], np.float32)), BF16) is Magnitude.LARGE
    assert classify(bf16(np.array([1.0, np.nan], np.float32)), BF16) is Magnitude.NONFINITE
    assert classify(bf16(np.array([np.inf], np.float32)), BF16) is Magnitude.NONFINITE


def test_count_nonfinite_and_examine_a_misaligned_payload() -> None:
    values = np.array([1.0, np.nan, np.inf, -np.inf, 2.0], "<f4")
    assert count_nonfinite(values.tobytes(), F32) == 3
    assert count_nonfinite(np.array([np.nan, 1.0], "<f2").tobytes(), F16) == 1
    raw = b"x" + values.tobytes()
    payload, magnitude = examine(memoryview(raw)[1:], F32)
    assert magnitude is Magnitude.NONFINITE
    assert bytes(payload) == values.tobytes()  # copied: aligned, and writable for the sum
    assert isinstance(payload, memoryview) and not payload.readonly
    aligned = memoryview(np.ones(4, "<f4").tobytes())
    assert examine(aligned, F32)[0] is aligned  # no copy needed


# ------------------------------------------------------------ overflow in the sum
def reduce(arrays: list[bytes], dtype: int, order: list[tuple[int, int]], **kw: int) -> bytes:
    total = len(arrays[0])
    reduction = BucketReduction(range(len(arrays)), dtype, total, CHUNK, **kw)  # type: ignore[arg-type]
    reply = kw.get("reply_dtype", dtype)
    widening = 2 if reply != dtype else 1
    result = bytearray(total * widening)
    for rank, offset in order:
        length = chunking.expected_chunk_length(total, CHUNK, offset)
        averaged = reduction.add(rank, offset, arrays[rank][offset : offset + length])
        if averaged is not None:
            result[offset * widening : offset * widening + len(averaged)] = averaged
    assert reduction.complete and reduction.buffered_bytes == 0
    return bytes(result)


def in_order(arrays: list[bytes]) -> list[tuple[int, int]]:
    return [
        (r, o) for r in range(len(arrays)) for o, _ in chunking.chunk_spans(len(arrays[0]), CHUNK)
    ]


def test_two_ranks_sending_3e38_average_to_3e38_not_inf() -> None:
    grads = [np.full(3000, BIG, np.float32), np.full(3000, BIG, np.float32)]
    grads[1][7] = -BIG  # an element whose sum never overflows stays exact
    out = np.frombuffer(
        reduce([g.tobytes() for g in grads], F32, in_order([b"x" * 12000] * 2)), "<f4"
    )
    assert np.all(np.isfinite(out))
    assert out[0] == BIG and out[7] == 0.0


def test_float64_buckets_and_bfloat16_wires_are_guarded_too() -> None:
    big64 = np.full(600, 1.7e308, np.float64)
    out = np.frombuffer(reduce([big64.tobytes()] * 3, F64, in_order([big64.tobytes()] * 3)), "<f8")
    assert np.all(np.isfinite(out)) and np.allclose(out, 1.7e308, rtol=1e-15, atol=0)
    wire = [bf16(np.full(1000, BIG, np.float32))] * 2
    out32 = np.frombuffer(reduce(wire, BF16, in_order(wire), reply_dtype=F32), "<f4")
    assert np.all(np.isfinite(out32)) and np.allclose(out32, 3e38, rtol=1e-2)


def test_nan_inputs_stay_nan_where_they_are_and_nowhere_else() -> None:
    grads = [
        np.full(2000, BIG, np.float32),
        np.full(2000, BIG, np.float32),
        np.ones(2000, np.float32),
    ]
    grads[1][5] = np.nan
    grads[2][9] = np.inf
    raw = [g.tobytes() for g in grads]
    out = np.frombuffer(reduce(raw, F32, in_order(raw)), "<f4")
    assert np.isnan(out[5]) and out[9] == np.inf
    finite = np.delete(out, [5, 9])
    assert np.all(np.isfinite(finite))


@pytest.mark.parametrize("world_size", [2, 3, 5])
def test_interleavings_stay_bitwise_with_overflow_and_nan_mixed_in(world_size: int) -> None:
    rng = np.random.default_rng(world_size)
    elements = 3 * CHUNK // 4 + 77
    grads = [
        (rng.standard_normal(elements) * 10.0 ** rng.integers(-4, 4, elements)).astype(np.float32)
        for _ in range(world_size)
    ]
    plain = [g.tobytes() for g in grads]
    # The old algorithm on tame inputs: float32 sum in rank order, divided in float32.
    expected = grads[0].copy()
    for g in grads[1:]:
        expected += g
    expected /= world_size
    # Chunk 1 of every rank gets huge values (overflow), chunk 2 of one rank a NaN.
    wild = [g.copy() for g in grads]
    for g in wild:
        g[CHUNK // 4 : CHUNK // 4 + 10] = BIG
    wild[world_size - 1][2 * CHUNK // 4 + 3] = np.nan
    wild_raw = [g.tobytes() for g in wild]
    pieces = in_order(plain)
    rnd = random.Random(world_size)
    plain_results, wild_results = set(), set()
    for _ in range(12):
        rnd.shuffle(pieces)
        plain_results.add(reduce(plain, F32, list(pieces)))
        wild_results.add(reduce(wild_raw, F32, list(pieces)))
    assert plain_results == {expected.tobytes()}, "tame inputs must keep today's bytes"
    assert len(wild_results) == 1, "the repaired average depends on arrival order"
    wild_out = np.frombuffer(wild_results.pop(), "<f4")
    assert np.all(wild_out[CHUNK // 4 : CHUNK // 4 + 10] == BIG)
    assert np.isnan(wild_out[2 * CHUNK // 4 + 3])
    # Every element neither overflowed nor NaN is bitwise the plain float32 result.
    untouched = np.ones(elements, bool)
    untouched[CHUNK // 4 : CHUNK // 4 + 10] = False
    untouched[2 * CHUNK // 4 + 3] = False
    assert np.array_equal(wild_out[untouched], expected[untouched])


# -------------------------------------------------------------- the policy, in a job
def running_job(policy: str, world_size: int = 3) -> tuple[Job, CoordinatorMetrics]:
    metrics = CoordinatorMetrics()
    spec = pb.BucketSpec(parameter_indices=[0], dtype=F32, num_elements=2048)
    signature = pb.ModelSignature(
        parameters=[pb.TensorSpec(name=n, shape=[2048], dtype=F32) for n in ("a", "b")],
        buckets=[spec, pb.BucketSpec(parameter_indices=[1], dtype=F32, num_elements=2048)],
    )
    job = Job(
        "job",
        JobSettings(world_size, CHUNK, 2 * CHUNK, nonfinite=policy),
        ByteBudget(1 << 24),
        clock=lambda: 0.0,
        metrics=metrics,
    )
    for rank in range(world_size):
        job.join(
            rank,
            pb.Join(
                job_id="job",
                rank=rank,
                world_size=world_size,
                signature=signature,
                incarnation=f"i{rank}",
            ),
        )
    assert job.state is JobState.RUNNING
    for offset in range(0, 2048 * 4, CHUNK):
        job.on_state_chunk(0, pb.StateChunk(offset=offset, payload=bytes(CHUNK)))
    return job, metrics


def upload(job: Job, rank: int, values: np.ndarray, step: int = 0, bucket: int = 1) -> list[Send]:
    sends = []
    raw = values.astype("<f4").tobytes()
    for offset in range(0, len(raw), CHUNK):
        header = ChunkHeader(step=step, bucket_index=bucket, offset=offset, dtype=F32)
        sends += [
            a
            for a in job.on_gradient(rank, header, memoryview(raw[offset : offset + CHUNK]))
            if isinstance(a, Send)
        ]
    return sends


def aborts(sends: list[Send]) -> list[tuple[tuple[int, ...], pb.StepAborted]]:
    return [
        (s.ranks, s.message.step_aborted)
        for s in sends
        if not isinstance(s.message, bytes) and s.message.WhichOneof("kind") == "step_aborted"
    ]


def poisoned(nan_at: int = 1000) -> np.ndarray:
    values = np.ones(2048, np.float32)
    values[nan_at] = np.nan
    return values


def test_report_counts_names_and_goes_on(caplog: pytest.LogCaptureFixture) -> None:
    job, metrics = running_job("report")
    caplog.set_level(logging.WARNING, "gradsync.server")
    upload(job, 0, np.ones(2048))
    upload(job, 1, poisoned())
    sends = upload(job, 2, np.ones(2048))
    assert not aborts(sends)
    assert sum(1 for s in sends if isinstance(s.message, bytes)) == 2  # both chunks averaged
    status = job_status(job)
    assert status.nonfinite_contributions == 1
    assert "rank 1" in status.last_nonfinite and "bucket 1 of step 0" in status.last_nonfinite
    assert "1 of 1024 elements" in status.last_nonfinite
    assert "rank 1 sent non-finite gradients" in caplog.text
    sample = metrics.registry.get_sample_value(
        "gradsync_nonfinite_contributions_total", {"rank": "1"}
    )
    assert sample == 1.0
    reply = pb.StatusReply(jobs=[status])
    assert "non-finite gradients (NaN/Inf): 1 contributions" in format_status(reply)


def test_abort_refuses_the_step_for_every_rank_naming_the_culprit() -> None:
    job, _ = running_job("abort")
    upload(job, 0, np.ones(2048))
    sends = upload(job, 2, poisoned())
    [(ranks, aborted)] = aborts(sends)
    assert ranks == (0, 1, 2)
    assert aborted.reason == pb.ABORT_REASON_NONFINITE
    assert aborted.culprit_rank == 2 and aborted.bucket_index == 1 and aborted.step == 0
    assert aborted.code == Code.ABORTED
    assert "--nonfinite abort" in aborted.message
    assert job.open_step == 1  # the next step is open; late chunks of step 0 are dropped
    assert job_status(job).nonfinite_contributions == 1  # counted (and logged) as well
    assert upload(job, 1, np.ones(2048)) == []
    error = abort_error(aborted, rank=0)
    assert isinstance(error, NonFiniteGradientError) and isinstance(error, StepAbortedError)
    assert error.culprit_rank == 2 and error.step == 0 and error.bucket_index == 1
    assert "rank 2" in str(error)
    # Training goes on: step 1 completes for everyone.
    for rank in range(3):
        upload(job, rank, np.ones(2048), step=1, bucket=0)
        last = upload(job, rank, np.ones(2048), step=1, bucket=1)
    assert not aborts(last) and job.steps_completed == 1


def test_allow_checks_nothing() -> None:
    job, metrics = running_job("allow")
    for rank in range(3):
        sends = upload(job, rank, poisoned() if rank == 1 else np.ones(2048))
    assert not aborts(sends)
    assert job_status(job).nonfinite_contributions == 0
    assert (
        metrics.registry.get_sample_value("gradsync_nonfinite_contributions_total", {"rank": "1"})
        is None
    )


def test_a_nan_storm_is_counted_in_full_and_logged_at_a_bounded_rate(
    caplog: pytest.LogCaptureFixture,
) -> None:
    now = [0.0]
    log = NonFiniteLog(lambda: now[0], logging.getLogger("gradsync.test"), lines=3, window_s=10)
    caplog.set_level(logging.WARNING, "gradsync.test")
    for step in range(50):
        for chunk in range(4):  # several chunks of one bucket count once
            log.record(NonFiniteContribution("job", 1, step, 0, chunk * CHUNK, 1, 1024))
    assert log.count == 50
    assert len(caplog.records) == 3
    now[0] = 11.0
    log.record(NonFiniteContribution("job", 1, 50, 0, 0, 1, 1024))
    assert len(caplog.records) == 4
    assert "47 more non-finite contributions were not logged; 51 in all" in caplog.text
    assert "step 50" in log.last


# ------------------------------------------------------------------------- a shard
def shard_view(policy_ranks: int = 2) -> pb.ShardJobView:
    return pb.ShardJobView(
        job_id="job",
        world_size=policy_ranks,
        members=[pb.ShardMember(rank=r, incarnation=f"i{r}") for r in range(policy_ranks)],
        buckets=[pb.BucketSpec(dtype=F32, num_elements=2048)],
        chunk_bytes=CHUNK,
        shard_count=2,
    )


def shard_upload(job: JobPlane, rank: int, values: np.ndarray) -> list:  # type: ignore[type-arg]
    raw = values.astype("<f4").tobytes()
    lo, hi = job.step.byte_range(0, F32)
    outcomes = []
    for offset, length in chunking.range_chunk_spans(lo, hi, CHUNK):
        header = ChunkHeader(step=0, bucket_index=0, offset=offset, dtype=F32)
        outcomes.append(job.on_gradient(rank, header, memoryview(raw[offset : offset + length])))
    return outcomes


def test_a_shard_reports_or_refuses_per_the_leaders_policy() -> None:
    bad = np.full(2048, np.nan, np.float32)  # NaN in every chunk of the shard's range
    report = JobPlane.for_shard(
        shard_view(), 1, "shard 1 at b:1", ByteBudget(1 << 24), lambda: 0.0, nonfinite="report"
    )
    shard_upload(report, 0, np.ones(2048))
    outcomes = shard_upload(report, 1, bad)
    reports = [n for o in outcomes for n in o.nonfinite]
    assert len(reports) == 1  # once per rank, step and bucket
    assert (reports[0].rank, reports[0].step, reports[0].bucket_index) == (1, 0, 0)
    assert "shard 1 at b:1" in reports[0].message
    assert all(o.rejected is None for o in outcomes) and any(o.sends for o in outcomes)

    refuse = JobPlane.for_shard(
        shard_view(), 1, "shard 1 at b:1", ByteBudget(1 << 24), lambda: 0.0, nonfinite="abort"
    )
    shard_upload(refuse, 0, np.ones(2048))
    outcomes = shard_upload(refuse, 1, bad)
    rejected = [o.rejected for o in outcomes if o.rejected is not None]
    assert len(rejected) == 1
    assert rejected[0].reason == pb.ABORT_REASON_NONFINITE and rejected[0].rank == 1
    assert not any(o.sends for o in outcomes)  # no average with a NaN in it went out
