"""Collectives on user tensors, as pure logic: the maths, agreement checks and limits.

Inputs arrive chunk by chunk in random interleavings; results must be the
same bytes whatever the order (sums in ascending rank order), and equal a
reference computed with numpy in rank order.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
from gradsync_proto.codes import Code
from gradsync_proto.v1 import gradsync_pb2 as pb
from gradsync_server.control.collectives import Collectives, reduce_inputs
from gradsync_server.dataplane.actions import Action, Member, Send, Terminate
from gradsync_server.dataplane.budget import ByteBudget
from gradsync_server.errors import RejectedMessage


def sent(message: pb.CoordinatorMessage | bytes) -> pb.CoordinatorMessage:
    """A Send's message (a result chunk travels encoded once for all its ranks)."""
    return pb.CoordinatorMessage.FromString(message) if isinstance(message, bytes) else message


CHUNK = 4096
RANKS = (0, 1, 2)


def engine(budget: ByteBudget | None = None, max_bytes: int = 1 << 20) -> Collectives:
    return Collectives(3, CHUNK, max_bytes, (budget or ByteBudget(1 << 24)).for_owner("job"))


def pieces(
    rank: int, raw: bytes, op: int, dtype: int, sequence: int = 0, root: int = 0
) -> list[tuple[int, pb.CollectiveChunk]]:
    spans = [(o, raw[o : o + CHUNK]) for o in range(0, len(raw), CHUNK)] or [(0, b"")]
    return [
        (
            rank,
            pb.CollectiveChunk(
                sequence=sequence,
                op=op,  # type: ignore[arg-type]
                dtype=dtype,  # type: ignore[arg-type]
                total_bytes=len(raw),
                offset=offset,
                payload=payload,
                root=root,
            ),
        )
        for offset, payload in spans
    ]


def result_of(actions: list[Action]) -> tuple[bytes, tuple[int, ...], int]:
    """(result bytes, recipients, contributors) from the result chunks."""
    sends = [a for a in actions if isinstance(a, Send)]
    assert sends, "no result"
    chunks = [sent(s.message).collective for s in sends]
    total = chunks[0].total_bytes
    out = bytearray(total)
    for chunk in chunks:
        out[chunk.offset : chunk.offset + len(chunk.payload)] = chunk.payload
        assert chunk.total_bytes == total
    return bytes(out), sends[0].ranks, chunks[0].contributors


def run_all(
    collectives: Collectives, messages: list[tuple[int, pb.CollectiveChunk]], ranks=RANKS
) -> list[Action]:
    actions: list[Action] = []
    for rank, chunk in messages:
        actions += collectives.accept(rank, chunk, ranks)
    return actions


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize(
    "op", [pb.COLLECTIVE_OP_SUM, pb.COLLECTIVE_OP_AVG, pb.COLLECTIVE_OP_MIN, pb.COLLECTIVE_OP_MAX]
)
def test_reductions_are_bitwise_independent_of_arrival_order(op: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    inputs = [
        (rng.standard_normal(2500) * 10.0 ** rng.integers(-3, 4)).astype(np.float32) for _ in RANKS
    ]
    expected = inputs[0].copy()
    for other in inputs[1:]:
        if op in (pb.COLLECTIVE_OP_SUM, pb.COLLECTIVE_OP_AVG):
            expected += other
        elif op == pb.COLLECTIVE_OP_MIN:
            expected = np.minimum(expected, other)
        else:
            expected = np.maximum(expected, other)
    if op == pb.COLLECTIVE_OP_AVG:
        expected /= np.float32(3)
    messages = [m for r in RANKS for m in pieces(r, inputs[r].tobytes(), op, pb.DTYPE_FLOAT32)]
    random.Random(seed).shuffle(messages)
    result, ranks, contributors = result_of(run_all(engine(), messages))
    assert result == expected.tobytes()
    assert ranks == RANKS and contributors == 3


def test_integer_sum_accumulates_in_int64_and_wraps_back() -> None:
    inputs = [np.array([100, -100, 7], dtype=np.int8) for _ in RANKS]
    assert reduce_inputs(pb.COLLECTIVE_OP_SUM, pb.DTYPE_INT8, [a.tobytes() for a in inputs]) == (
        np.array([300 - 256, -300 + 256, 21], dtype=np.int8).tobytes()
    )
    big = [np.array([2**40 + r], dtype=np.int64).tobytes() for r in RANKS]
    summed = reduce_inputs(pb.COLLECTIVE_OP_SUM, pb.DTYPE_INT64, big)
    assert np.frombuffer(summed, dtype=np.int64)[0] == 3 * 2**40 + 3


def test_float16_average_accumulates_in_float32() -> None:
    inputs = [np.full(4, 60000, dtype=np.float16) for _ in RANKS]  # the fp16 sum overflows
    raw = reduce_inputs(pb.COLLECTIVE_OP_AVG, pb.DTYPE_FLOAT16, [a.tobytes() for a in inputs])
    assert np.frombuffer(raw, dtype=np.float16).tolist() == [60000.0] * 4


def test_broadcast_all_gather_and_barrier() -> None:
    collectives = engine()
    payload = np.arange(3000, dtype=np.float32).tobytes()
    messages = pieces(1, payload, pb.COLLECTIVE_OP_BROADCAST, pb.DTYPE_FLOAT32, root=1)
    for rank in (0, 2):
        messages += pieces(rank, b"", pb.COLLECTIVE_OP_BROADCAST, pb.DTYPE_FLOAT32, root=1)
    assert result_of(run_all(collectives, messages))[0] == payload
    gathered = [bytes([r]) * 10 for r in RANKS]
    messages = [
        m
        for r in (2, 0, 1)
        for m in pieces(r, gathered[r], pb.COLLECTIVE_OP_ALL_GATHER, pb.DTYPE_UINT8, sequence=1)
    ]
    assert result_of(run_all(collectives, messages))[0] == b"".join(gathered)
    messages = [
        m for r in RANKS for m in pieces(r, b"", pb.COLLECTIVE_OP_BARRIER, pb.DTYPE_UINT8, 2)
    ]
    assert run_all(collectives, messages[:2]) == []
    result, ranks, _ = result_of(run_all(collectives, messages[2:]))
    assert result == b"" and ranks == RANKS
    assert collectives.next_sequence == 3 and collectives.open_sequences() == []


@pytest.mark.parametrize(
    ("second", "needles"),
    [
        (
            {"op": pb.COLLECTIVE_OP_MAX},
            ["rank 1 sent collective 0", "all_reduce max", "rank 0 sent all_reduce sum"],
        ),
        (
            {"dtype": pb.DTYPE_FLOAT64},
            ["rank 1 sent collective 0", "float64", "rank 0 sent float32"],
        ),
        ({"total_bytes": 8}, ["rank 1 sent collective 0", "8 bytes", "rank 0 sent 16 bytes"]),
    ],
)
def test_disagreeing_ranks_are_named_with_both_values(
    second: dict[str, int], needles: list[str]
) -> None:
    collectives = engine()
    first = pb.CollectiveChunk(
        sequence=0,
        op=pb.COLLECTIVE_OP_SUM,
        dtype=pb.DTYPE_FLOAT32,
        total_bytes=16,
        payload=bytes(16),
    )
    collectives.accept(0, first, RANKS)
    other = pb.CollectiveChunk()
    other.CopyFrom(first)
    for name, value in second.items():
        setattr(other, name, value)
    other.payload = bytes(other.total_bytes)
    told, ended = collectives.accept(1, other, RANKS)
    # The sender's stream ends; rank 0, which waits, gets the same words as its result.
    assert isinstance(ended, Terminate) and ended.ranks == (1,)
    assert ended.code is Code.INVALID_ARGUMENT
    assert isinstance(told, Send) and told.ranks == (0,)
    assert isinstance(told.message, pb.CoordinatorMessage)
    failure = told.message.collective
    assert failure.sequence == 0 and failure.error == ended.details and not failure.payload
    for needle in needles:
        assert needle in ended.details, ended.details
    # Rank 2 arrives later: it is told too, once its whole input is in, and the
    # collective is over (nothing held).
    (late,) = collectives.accept(2, first, RANKS)
    assert isinstance(late, Send) and late.ranks == (2,)
    assert isinstance(late.message, pb.CoordinatorMessage)
    assert late.message.collective.error == ended.details
    assert collectives.open_sequences() == []


def test_limits_sequence_window_and_bad_chunks() -> None:
    budget = ByteBudget(1 << 20)
    collectives = engine(budget, max_bytes=8192)

    def refused(rank: int, chunk: pb.CollectiveChunk) -> RejectedMessage:
        with pytest.raises(RejectedMessage) as caught:
            collectives.accept(rank, chunk, RANKS)
        return caught.value

    big = pb.CollectiveChunk(op=pb.COLLECTIVE_OP_SUM, dtype=pb.DTYPE_FLOAT32, total_bytes=8196)
    assert refused(0, big).code is Code.RESOURCE_EXHAUSTED and "8192" in refused(0, big).message
    gather = pb.CollectiveChunk(
        op=pb.COLLECTIVE_OP_ALL_GATHER, dtype=pb.DTYPE_UINT8, total_bytes=4000
    )
    assert refused(0, gather).code is Code.RESOURCE_EXHAUSTED  # 3 x 4000 > 8192
    avg_int = pb.CollectiveChunk(op=pb.COLLECTIVE_OP_AVG, dtype=pb.DTYPE_INT32, total_bytes=4)
    assert "floating" in refused(0, avg_int).message
    odd = pb.CollectiveChunk(op=pb.COLLECTIVE_OP_SUM, dtype=pb.DTYPE_FLOAT32, total_bytes=6)
    assert "whole number" in refused(0, odd).message
    far = pb.CollectiveChunk(sequence=99, op=pb.COLLECTIVE_OP_BARRIER, dtype=pb.DTYPE_UINT8)
    assert refused(0, far).code is Code.FAILED_PRECONDITION
    ok = pb.CollectiveChunk(
        sequence=1, op=pb.COLLECTIVE_OP_SUM, dtype=pb.DTYPE_FLOAT32, total_bytes=8, payload=bytes(8)
    )
    collectives.accept(0, ok, RANKS)
    assert budget.used == 8
    assert "twice" in refused(0, ok).message
    short = pb.CollectiveChunk(
        sequence=1, op=pb.COLLECTIVE_OP_SUM, dtype=pb.DTYPE_FLOAT32, total_bytes=8, payload=bytes(4)
    )
    assert "expected 8" in refused(1, short).message
    collectives.release()
    assert budget.used == 0


def test_a_rank_out_of_inputs_is_dropped_and_the_broadcast_root_falls_back() -> None:
    budget = ByteBudget(1 << 20)
    collectives = engine(budget)
    payload = b"x" * 12
    # Root 0 has run out of inputs: ranks 1 and 2 take part; rank 1 sends its data.
    messages = pieces(1, payload, pb.COLLECTIVE_OP_BROADCAST, pb.DTYPE_UINT8, root=0)
    messages += pieces(2, b"", pb.COLLECTIVE_OP_BROADCAST, pb.DTYPE_UINT8, root=0)
    result, ranks, contributors = result_of(run_all(collectives, messages, ranks=(1, 2)))
    assert (result, ranks, contributors) == (payload, (1, 2), 2)
    # A sum that waits only for rank 2 completes when rank 2 runs out of inputs.
    values = [np.full(4, r + 1, dtype=np.float32).tobytes() for r in RANKS]
    messages = [
        m for r in (0, 1) for m in pieces(r, values[r], pb.COLLECTIVE_OP_AVG, pb.DTYPE_FLOAT32, 1)
    ]
    assert run_all(collectives, messages) == []
    result, ranks, contributors = result_of(collectives.drop_participant(2))
    assert np.frombuffer(result, dtype=np.float32).tolist() == [1.5] * 4
    assert ranks == (0, 1) and contributors == 2 and budget.used == 0
    with pytest.raises(RejectedMessage, match="does not take part"):
        collectives.accept(
            2, pieces(2, b"", pb.COLLECTIVE_OP_BARRIER, pb.DTYPE_UINT8, 2)[0][1], (0, 1)
        )


def test_a_lost_rank_keeps_its_whole_input_and_gives_back_a_partial_one() -> None:
    budget = ByteBudget(1 << 20)
    collectives = engine(budget)
    values = [np.full(2 * CHUNK // 4, r + 1, dtype=np.float32).tobytes() for r in RANKS]
    whole = pieces(0, values[0], pb.COLLECTIVE_OP_SUM, pb.DTYPE_FLOAT32, 0)
    half = pieces(0, values[0], pb.COLLECTIVE_OP_SUM, pb.DTYPE_FLOAT32, 1)[:1]
    assert run_all(collectives, whole + half) == []
    assert budget.used == 3 * CHUNK
    # Rank 0 is lost: the half-sent input of collective 1 is given back at once...
    assert collectives.drop_participant(0) == []
    assert budget.used == 2 * CHUNK
    # ...and collective 1 completes over ranks 1 and 2, while 0 still counts rank 0.
    for sequence, expected, recipients in ((0, 6.0, RANKS), (1, 5.0, (1, 2))):
        messages = [
            m
            for r in (1, 2)
            for m in pieces(r, values[r], pb.COLLECTIVE_OP_SUM, pb.DTYPE_FLOAT32, sequence)
        ]
        result, ranks, contributors = result_of(run_all(collectives, messages, ranks=(1, 2)))
        assert np.frombuffer(result, dtype=np.float32).tolist() == [expected] * (2 * CHUNK // 4)
        assert ranks == recipients and contributors == len(recipients)
    assert budget.used == 0


class Recorder:
    """Just enough of a StepObserver: the collectives it was told of."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, int, int]] = []
        self.lags: list[tuple[int, float]] = []

    def observe_collective(self, op: str, received_bytes: int, sent_bytes: int) -> None:
        self.seen.append((op, received_bytes, sent_bytes))

    def observe_bucket_arrival(self, rank: int, lag_s: float) -> None:
        self.lags.append((rank, lag_s))


def test_each_completed_collective_is_observed_with_its_op_and_bytes() -> None:
    recorder = Recorder()
    budget = ByteBudget(1 << 24).for_owner("job")
    collectives = Collectives(3, CHUNK, 1 << 20, budget, recorder)  # type: ignore[arg-type]
    # A bfloat16 sum (the backend's 16-bit wire): 2 bytes an element each way.
    values = [np.arange(3000, dtype=np.float32) * (r + 1) for r in RANKS]
    raw = [(a.view(np.uint32) >> 16).astype("<u2").tobytes() for a in values]  # bf16 bits
    messages = [
        m for r in RANKS for m in pieces(r, raw[r], pb.COLLECTIVE_OP_SUM, pb.DTYPE_BFLOAT16)
    ]
    run_all(collectives, messages)
    payload = np.arange(10, dtype=np.float32).tobytes()
    messages = [
        m
        for r in RANKS
        for m in pieces(
            r, payload if r == 2 else b"", pb.COLLECTIVE_OP_BROADCAST, pb.DTYPE_FLOAT32, 1, root=2
        )
    ]
    run_all(collectives, messages)
    parts = np.arange(6, dtype=np.float32).tobytes()
    messages = [
        m
        for r in RANKS
        for m in pieces(r, parts, pb.COLLECTIVE_OP_REDUCE_SCATTER, pb.DTYPE_FLOAT32, 2)
    ]
    for _, chunk in messages:
        chunk.reduce_op = pb.COLLECTIVE_OP_SUM
    run_all(collectives, messages)
    failing = pieces(0, payload, pb.COLLECTIVE_OP_SUM, pb.DTYPE_FLOAT32, 3)
    failing += pieces(1, payload, pb.COLLECTIVE_OP_SUM, pb.DTYPE_FLOAT64, 3)
    run_all(collectives, failing)  # a failed collective is not counted
    assert recorder.seen == [
        ("all_reduce_sum", 3 * 6000, 3 * 6000),
        ("broadcast", 40, 3 * 40),
        ("reduce_scatter_sum", 3 * 24, 3 * 8),
    ]


@pytest.mark.parametrize("process_group", [True, False])
def test_a_process_groups_collective_reports_each_ranks_lag_behind_the_first_input(
    process_group: bool,
) -> None:
    """Lag runs from a rank's first chunk, on the injected clock; a wrapper's job
    (members with a model signature) reports none, its buckets measure it."""
    now = [100.0]
    recorder = Recorder()
    budget = ByteBudget(1 << 24).for_owner("job")
    collectives = Collectives(3, CHUNK, 1 << 20, budget, recorder, lambda: now[0])  # type: ignore[arg-type]
    signature = (
        pb.ModelSignature()
        if process_group
        else pb.ModelSignature(buckets=[pb.BucketSpec(num_elements=4)])
    )
    collectives.start("job", {r: Member(r, f"test-{r}", signature, 0.0) for r in RANKS})
    raw = np.ones(2000, np.float32).tobytes()  # two chunks each
    inputs = {r: pieces(r, raw, pb.COLLECTIVE_OP_SUM, pb.DTYPE_FLOAT32) for r in RANKS}
    timeline = [(0, 0), (2, 0), (2, 1), (1, 0), (0, 1), (1, 1)]  # (rank, its chunk)
    waits = [0.05, 0.0, 0.15, 1.0, 0.5, 0.0]  # after each: rank 2 at +0.05 s, rank 1 at +0.2 s
    actions: list[Action] = []
    for (rank, index), wait in zip(timeline, waits, strict=True):
        actions += run_all(collectives, [inputs[rank][index]])
        now[0] += wait
    assert result_of(actions)[2] == 3
    assert recorder.seen == [("all_reduce_sum", 3 * len(raw), 3 * len(raw))]
    if process_group:
        assert dict(recorder.lags) == {0: 0.0, 1: pytest.approx(0.2), 2: pytest.approx(0.05)}
        assert len(recorder.lags) == 3
    else:
        assert recorder.lags == []
