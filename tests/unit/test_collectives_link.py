"""The link's side of collectives and join(): results checked chunk by chunk, inputs cut
into chunks, JoinProgress queued; no network.

`Inbox` is fed serialized CoordinatorMessages directly, as the transport's I/O
thread does; what the coordinator claims (sizes, op, dtype, contributors,
offsets) must be what this rank asked for, or the waiter gets a
`CollectiveError` naming the sequence number instead of a tensor.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
from gradsync.control.inbox import Inbox
from gradsync.control.transport import Transport
from gradsync.control.worker_messages import CollectiveUpload, blob_messages
from gradsync.errors import CollectiveError, GradSyncError, SyncTimeoutError
from gradsync_proto.v1 import gradsync_pb2 as pb

pytestmark = pytest.mark.unit

SUM, GATHER, BARRIER = pb.COLLECTIVE_OP_SUM, pb.COLLECTIVE_OP_ALL_GATHER, pb.COLLECTIVE_OP_BARRIER
BROADCAST = pb.COLLECTIVE_OP_BROADCAST
F32 = pb.DTYPE_FLOAT32


def assembled(world_size: int = 3, chunk_bytes: int = 4) -> Inbox:
    inbox = Inbox("127.0.0.1:1", rank=1)
    welcome = pb.Welcome(world_size=world_size, chunk_bytes=chunk_bytes)
    inbox.on_message(pb.CoordinatorMessage(welcome=welcome).SerializeToString())
    return inbox


def result(
    inbox: Inbox,
    sequence: int,
    offset: int,
    payload: bytes,
    total: int,
    *,
    op: int = SUM,
    dtype: int = F32,
    contributors: int = 3,
) -> None:
    chunk = pb.CollectiveChunk(
        sequence=sequence,
        op=op,  # type: ignore[arg-type]
        dtype=dtype,  # type: ignore[arg-type]
        total_bytes=total,
        offset=offset,
        payload=payload,
        contributors=contributors,
    )
    inbox.on_message(pb.CoordinatorMessage(collective=chunk).SerializeToString())


def test_a_chunked_result_is_reassembled_with_its_contributors() -> None:
    inbox = assembled()
    inbox.expect_collective(0, SUM, F32, 10, None)
    for offset, piece in ((8, b"ij"), (0, b"abcd"), (4, b"efgh")):  # any order
        result(inbox, 0, offset, piece, 10)
    data, contributors = inbox.wait_collective(0, timeout_s=1)
    assert bytes(data) == b"abcdefghij" and contributors == 3


def test_an_empty_result_is_one_empty_chunk() -> None:
    inbox = assembled()
    inbox.expect_collective(4, BARRIER, pb.DTYPE_UINT8, 0, None)
    result(inbox, 4, 0, b"", 0, op=BARRIER, dtype=pb.DTYPE_UINT8)
    assert inbox.wait_collective(4, timeout_s=1) == (bytearray(), 3)


def test_all_gather_results_hold_one_input_per_contributor() -> None:
    inbox = assembled()
    inbox.expect_collective(0, GATHER, F32, 4, None)
    result(inbox, 0, 0, b"abcd", 8, op=GATHER, contributors=2)
    result(inbox, 0, 4, b"efgh", 8, op=GATHER, contributors=2)
    assert inbox.wait_collective(0, timeout_s=1) == (bytearray(b"abcdefgh"), 2)


@pytest.mark.parametrize(
    ("op", "input_bytes", "result_bytes", "total", "contributors", "message"),
    [
        (SUM, 8, None, 2**60, 3, "claims 1152921504606846976 bytes, expected 8"),
        (GATHER, 4, None, 16, 3, r"expected 12 \(4 bytes from each of 3 contributors\)"),
        (SUM, 8, None, 8, 4, "claims 4 contributors, expected 1 to 3"),
        (BROADCAST, 0, 8, 12, 3, "claims 12 bytes, expected 8"),
        (BARRIER, 0, None, 4, 3, "a barrier has no data"),
    ],
)
def test_size_claims_are_checked_before_anything_is_allocated(
    op: int,
    input_bytes: int,
    result_bytes: int | None,
    total: int,
    contributors: int,
    message: str,
) -> None:
    inbox = assembled()
    inbox.expect_collective(7, op, F32, input_bytes, result_bytes)
    result(inbox, 7, 0, b"abcd", total, op=op, contributors=contributors)
    with pytest.raises(CollectiveError, match=message) as raised:
        inbox.wait_collective(7, timeout_s=1)
    assert raised.value.sequence == 7 and raised.value.rank == 1
    assert "collective 7" in str(raised.value) and "rank 1" in str(raised.value)


@pytest.mark.parametrize(
    ("chunks", "message"),
    [
        ([(0, b"abcd"), (0, b"abcd")], "offset 0 arrived twice"),
        ([(2, b"abcd")], "out of range or misaligned"),
        ([(8, b"ab")], "out of range or misaligned"),
        ([(4, b"efg")], "3 bytes at offset 4, expected 4"),
    ],
)
def test_duplicate_misplaced_or_misshapen_chunks_are_errors(
    chunks: list[tuple[int, bytes]], message: str
) -> None:
    inbox = assembled()
    inbox.expect_collective(2, SUM, F32, 8, None)
    for offset, payload in chunks:
        result(inbox, 2, offset, payload, 8)
    result(inbox, 2, 4, b"efgh", 8)
    with pytest.raises(CollectiveError, match=message):
        inbox.wait_collective(2, timeout_s=1)


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("op", pb.COLLECTIVE_OP_MAX, "says op max, this rank asked for sum"),
        ("dtype", pb.DTYPE_FLOAT64, "dtype float64, this rank sent float32"),
        ("total", 12, "claims 12 bytes in all, not 8"),
        ("contributors", 2, "claims 2 contributors, earlier chunks claimed 3"),
    ],
)
def test_chunks_must_agree_with_the_request_and_with_each_other(
    field: str, value: int, message: str
) -> None:
    inbox = assembled()
    inbox.expect_collective(0, SUM, F32, 8, None)
    result(inbox, 0, 0, b"abcd", 8)
    second = {"op": SUM, "dtype": F32, "total": 8, "contributors": 3, field: value}
    result(
        inbox,
        0,
        4,
        b"efgh",
        second["total"],
        op=second["op"],
        dtype=second["dtype"],
        contributors=second["contributors"],
    )
    with pytest.raises(CollectiveError, match=message):
        inbox.wait_collective(0, timeout_s=1)


def test_a_missing_chunk_times_out_naming_what_is_missing() -> None:
    inbox = assembled()
    inbox.expect_collective(3, SUM, F32, 12, None)
    result(inbox, 3, 0, b"abcd", 12)
    result(inbox, 3, 8, b"ijkl", 12)
    with pytest.raises(SyncTimeoutError, match=r"collective 3 .*missing offsets \[4\]"):
        inbox.wait_collective(3, timeout_s=0.2)


def test_a_result_nobody_asked_for_breaks_the_stream() -> None:
    inbox = assembled()
    inbox.expect_collective(0, SUM, F32, 4, None)
    result(inbox, 9, 0, b"abcd", 4)
    with pytest.raises(GradSyncError, match="collective 9, which this rank has not issued"):
        inbox.wait_collective(0, timeout_s=1)


def test_collectives_before_the_job_assembled_are_refused() -> None:
    inbox = Inbox("127.0.0.1:1", rank=0)
    with pytest.raises(CollectiveError, match="assembled job"):
        inbox.expect_collective(0, SUM, F32, 4, None)


def test_inputs_are_cut_into_chunks_and_an_empty_input_is_one_empty_chunk() -> None:
    payload = np.frombuffer(b"0123456789", dtype=np.uint8)
    upload = CollectiveUpload(5, SUM, F32, 0, payload)
    chunks = [pb.WorkerMessage.FromString(raw).collective for raw in blob_messages(upload, 4)]
    assert [(c.offset, c.payload, c.total_bytes, c.sequence) for c in chunks] == [
        (0, b"0123", 10, 5),
        (4, b"4567", 10, 5),
        (8, b"89", 10, 5),
    ]
    empty = CollectiveUpload(6, BROADCAST, F32, 2, np.empty(0, np.uint8))
    (only,) = [pb.WorkerMessage.FromString(raw).collective for raw in blob_messages(empty, 4)]
    assert (only.offset, only.payload, only.total_bytes, only.root, only.op) == (
        0,
        b"",
        0,
        2,
        BROADCAST,
    )


def test_the_transport_numbers_collectives_and_can_be_renumbered() -> None:
    transport = Transport("127.0.0.1:1", rank=1)
    try:
        welcome = pb.Welcome(world_size=2, chunk_bytes=4)
        transport._inbox.on_message(pb.CoordinatorMessage(welcome=welcome).SerializeToString())

        def answer(sequence: int) -> None:
            result(transport._inbox, sequence, 0, b"", 0, op=BARRIER, contributors=2)

        for expected in (0, 1):
            threading.Timer(0.05, answer, args=(expected,)).start()
            transport.run_collective(BARRIER, F32, np.empty(0, np.uint8), 0, timeout_s=2)
        transport.set_collective_sequence(10)
        assert transport.collective_sequence == 10
        threading.Timer(0.05, answer, args=(10,)).start()
        assert transport.run_collective(BARRIER, F32, np.empty(0, np.uint8), 0, 2) == (
            bytearray(),
            2,
        )
        with pytest.raises(ValueError, match="1-D uint8"):
            transport.run_collective(SUM, F32, np.zeros(2, np.float32), 0, 1)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="unknown collective op"):
            transport.run_collective(99, F32, np.empty(0, np.uint8), 0, 1)
    finally:
        transport.close(timeout_s=2)


def test_join_progress_is_kept_in_order_until_taken() -> None:
    inbox = assembled()
    for step, done in ((4, False), (5, True)):
        progress = pb.JoinProgress(joined_ranks=[1], next_step=step, all_joined=done)
        inbox.on_message(pb.CoordinatorMessage(join_progress=progress).SerializeToString())
    assert inbox.wait_join_progress(1).next_step == 4
    last = inbox.wait_join_progress(1)
    assert last.next_step == 5 and last.all_joined
    with pytest.raises(SyncTimeoutError, match="join"):
        inbox.wait_join_progress(0.1)
