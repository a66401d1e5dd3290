"""The worker's side of a sharded coordinator, without sockets.

Buckets are cut into one byte range per shard by elements of the wire dtype
and each range is chunked on its own grid; averages are checked against that
grid (never against byte counts alone); a failed shard stream waits for the
leader's verdict for a bounded grace; shard addresses resolve against the
leader's host.
"""

from __future__ import annotations

import time

import gradsync
import numpy as np
import pytest
from gradsync.control.inbox import Inbox
from gradsync.errors import (
    CoordinatorUnavailableError,
    GradSyncError,
    ShardUnavailableError,
    StepAbortedError,
    SyncTimeoutError,
    error_from_status,
)
from gradsync.path.bucket_uploads import (
    BucketUpload,
    RangeUpload,
    bucket_byte_ranges,
    expected_chunks,
    range_messages,
    split_upload,
)
from gradsync.path.buffers import BucketBuffer
from gradsync.path.shard_streams import ShardFault, shard_grace_s, shard_target, shard_targets
from gradsync.path.step_results import StepResults
from gradsync_proto.codec import ChunkHeader, decode_gradient
from gradsync_proto.codes import Code
from gradsync_proto.v1 import gradsync_pb2 as pb

pytestmark = pytest.mark.unit

F32, BF16 = pb.DTYPE_FLOAT32, pb.DTYPE_BFLOAT16


def bucket(num_bytes: int, split: int = 3) -> tuple[BucketBuffer, bytes]:
    """A bucket of `num_bytes` random bytes held by `split` segments."""
    data = np.random.default_rng(num_bytes).integers(0, 256, num_bytes, dtype=np.uint8)
    cuts = sorted({num_bytes * k // split for k in range(1, split)})
    return BucketBuffer(np.split(data.copy(), cuts)), data.tobytes()


def flat(buffer: BucketBuffer) -> bytes:
    return b"".join(bytes(segment) for segment in buffer.segments)


# ----------------------------------------------------------------- ranges and chunks
def test_one_shard_is_the_whole_bucket_on_the_unsharded_grid() -> None:
    assert bucket_byte_ranges(1003, F32, 1) == [(0, 1003)]  # not even whole elements: unchecked
    assert expected_chunks(1000, F32, 1, 300) == {0: 300, 300: 300, 600: 300, 900: 100}


def test_ranges_are_cut_by_elements_of_the_wire_dtype() -> None:
    # 10 float32 elements over 3 shards: 4, 3, 3 elements.
    assert bucket_byte_ranges(40, F32, 3) == [(0, 16), (16, 28), (28, 40)]
    # The same 10 elements on a 16-bit wire: every byte offset halves.
    assert bucket_byte_ranges(20, BF16, 3) == [(0, 8), (8, 14), (14, 20)]
    with pytest.raises(ValueError, match="whole number of float32"):
        bucket_byte_ranges(42, F32, 3)


def test_each_range_is_chunked_on_its_own_grid_with_absolute_offsets() -> None:
    # 100 float32 = 400 bytes over 2 shards: [0, 200) and [200, 400), chunks of 64.
    spans = expected_chunks(400, F32, 2, 64)
    assert spans == {
        0: 64, 64: 64, 128: 64, 192: 8,
        200: 64, 264: 64, 328: 64, 392: 8,
    }  # fmt: skip


def test_a_small_bucket_leaves_later_shards_empty_but_never_the_leader() -> None:
    buffer, _ = bucket(8)  # two float32 elements, four shards
    parts = split_upload(BucketUpload(3, 1, buffer, F32), 4)
    assert [(p.lo, p.hi) if p else None for p in parts] == [(0, 4), (4, 8), None, None]
    empty = split_upload(BucketUpload(3, 1, BucketBuffer([]), F32), 4)
    assert empty[0] is not None and empty[1:] == [None, None, None]


def messages_of(
    part: RangeUpload, chunk_bytes: int, events: list[tuple[str, int, int]]
) -> list[tuple[ChunkHeader, bytes]]:
    out = []
    for raw in range_messages(part, chunk_bytes, 7, lambda *event: events.append(event)):
        decoded = decode_gradient(raw)
        assert decoded is not None
        header, payload = decoded
        out.append((header, bytes(payload)))
    return out


def test_range_messages_carry_the_ranges_bytes_and_fire_the_buckets_events_once() -> None:
    buffer, data = bucket(4 * 50)
    parts = split_upload(BucketUpload(5, 2, buffer, F32), 3)
    events: list[tuple[str, int, int]] = []
    received: dict[int, bytes] = {}
    # Interleave the streams as the event loop might: shard 2, then 0, then 1.
    for index in (2, 0, 1):
        part = parts[index]
        assert part is not None
        for header, payload in messages_of(part, 24, events):
            assert (header.step, header.bucket_index, header.dtype) == (5, 2, F32)
            assert header.membership_epoch == 7
            assert part.lo <= header.offset < part.hi
            received[header.offset] = payload
        if index != 1:
            assert ("upload_end", 5, 2) not in events
    assert events == [("upload_start", 5, 2), ("upload_end", 5, 2)]
    assert {o: len(p) for o, p in received.items()} == expected_chunks(200, F32, 3, 24)
    assert b"".join(received[o] for o in sorted(received)) == data


def test_range_chunks_refuses_a_range_outside_the_bucket() -> None:
    buffer, data = bucket(10)
    assert [(o, b"".join(p)) for o, p in buffer.range_chunks(3, 9, 4)] == [
        (3, data[3:7]),
        (7, data[7:9]),
    ]
    with pytest.raises(ValueError, match=r"\[8, 12\) are outside the bucket's 10"):
        list(buffer.range_chunks(8, 12, 4))


# ----------------------------------------------------------------- the averages' grid
def results(num_bytes: int, shard_count: int, chunk_bytes: int) -> tuple[StepResults, BucketBuffer]:
    steps = StepResults(rank=1, on_averaged=None)
    steps.bucket_bytes = [num_bytes]
    steps.chunk_bytes, steps.shard_count = chunk_bytes, shard_count
    buffer = BucketBuffer([np.zeros(num_bytes, dtype=np.uint8)])
    steps.expect(4, 0, buffer, F32)
    return steps, buffer


def send(steps: StepResults, offset: int, length: int, contributors: int = 2) -> str | None:
    header = ChunkHeader(step=4, bucket_index=0, offset=offset, contributors=contributors)
    return steps.on_gradient(header, memoryview(bytes([offset % 251]) * length))


def test_a_duplicate_chunk_cannot_stand_in_for_a_missing_one() -> None:
    # Security finding: counting bytes completed the bucket with chunk 64 never written.
    steps, _ = results(128, 1, 64)
    assert send(steps, 0, 64) is None
    problem = send(steps, 0, 64)
    assert problem is not None
    assert "bucket 0 of step 4 at offset 0 arrived twice" in problem
    assert not steps.is_ready(4)


def test_a_chunk_off_the_grid_or_of_the_wrong_length_is_a_fault() -> None:
    steps, _ = results(400, 2, 64)
    off_grid = send(steps, 64 + 8, 64)
    assert off_grid is not None
    assert "step 4 at offset 72 is not on the bucket's chunk grid" in off_grid
    assert "expected a chunk at offset 64" in off_grid
    short = send(steps, 200, 60)
    assert short is not None
    assert "bucket 0 of step 4 at offset 200 has 60 bytes, expected 64" in short
    # Offset 192 is a short chunk on shard 0's grid (the range ends at 200).
    assert send(steps, 192, 8) is None
    assert not steps.is_ready(4)


def test_a_bucket_completes_when_every_expected_chunk_arrived_in_any_order() -> None:
    steps, buffer = results(400, 2, 64)
    spans = sorted(expected_chunks(400, F32, 2, 64).items(), reverse=True)
    for offset, length in spans:
        assert not steps.is_ready(4)
        assert send(steps, offset, length, contributors=3) is None
    assert steps.is_ready(4)
    assert steps.take(4) == 3
    assert flat(buffer)[200] == 200 % 251


def test_a_late_average_of_an_aborted_step_is_dropped_not_a_fault() -> None:
    # A shard that had not heard of the leader's abort yet averaged its range of
    # the step and sent it after this rank had taken the step (and its error).
    steps, buffer = results(128, 2, 64)
    steps.on_aborted(pb.StepAborted(step=4, code=10, message="peer sent NaN"))
    with pytest.raises(StepAbortedError):
        steps.take(4)
    assert send(steps, 64, 64) is None
    assert not any(flat(buffer)), "an aborted step's late average was written"
    # A step that was never aborted still refuses an average it did not upload.
    late = steps.on_gradient(ChunkHeader(step=5, bucket_index=0, offset=0), memoryview(b"x"))
    assert late is not None and "arrived before this rank uploaded it" in late


def test_the_inbox_raises_a_bad_chunk_as_a_protocol_fault_naming_its_source() -> None:
    inbox = Inbox("leader:1", rank=1)
    inbox.configure_buckets([128])
    welcome = pb.Welcome(chunk_bytes=64, shards=[pb.ShardAddress(index=0)])
    inbox.on_message(pb.CoordinatorMessage(welcome=welcome).SerializeToString())
    inbox.expect_bucket(4, 0, BucketBuffer([np.zeros(128, dtype=np.uint8)]), F32)
    for _ in range(2):
        header = ChunkHeader(step=4, bucket_index=0, offset=64, contributors=2)
        inbox.on_averaged_chunk(header, memoryview(bytes(64)), "shard 1 at h:2")
    with pytest.raises(GradSyncError, match=r"shard 1 at h:2 sent an invalid message.*twice"):
        inbox.wait_step(4, timeout_s=1)


# ----------------------------------------------------------------- a failed shard stream
def sharded_inbox(heartbeat_interval_s: float, margin_s: float) -> Inbox:
    inbox = Inbox("leader:1", rank=2, shard_grace_margin_s=margin_s)
    inbox.configure_buckets([8])
    welcome = pb.Welcome(
        chunk_bytes=64,
        heartbeat_interval_s=heartbeat_interval_s,
        shards=[pb.ShardAddress(index=0), pb.ShardAddress(index=1, address=":2")],
    )
    inbox.on_message(pb.CoordinatorMessage(welcome=welcome).SerializeToString())
    inbox.expect_bucket(3, 0, BucketBuffer([np.zeros(8, dtype=np.uint8)]), F32)
    return inbox


def lost_shard() -> ShardUnavailableError:
    return ShardUnavailableError(
        "the data stream to shard 1 at leader:2 failed: UNAVAILABLE: socket closed",
        rank=2,
        code=Code.UNAVAILABLE,
        shard_index=1,
        shard_address="leader:2",
    )


def test_a_failed_shard_stream_is_raised_after_the_grace_if_the_leader_says_nothing() -> None:
    inbox = sharded_inbox(heartbeat_interval_s=0.05, margin_s=0.3)  # grace 0.45 s
    inbox.shard_failed(lost_shard())
    started = time.monotonic()
    with pytest.raises(ShardUnavailableError, match="shard 1 at leader:2") as raised:
        inbox.wait_step(3, timeout_s=10)
    assert 0.4 <= time.monotonic() - started < 5
    assert (raised.value.shard_index, raised.value.shard_address) == (1, "leader:2")
    with pytest.raises(ShardUnavailableError):  # recorded: every later wait raises it too
        inbox.wait_step(4, timeout_s=10)


def test_the_leaders_verdict_within_the_grace_wins_and_comes_at_once() -> None:
    inbox = sharded_inbox(heartbeat_interval_s=1.0, margin_s=5.0)  # grace 8 s
    inbox.shard_failed(lost_shard())
    end = pb.StreamEnd(
        code=Code.UNAVAILABLE,
        reason=pb.END_REASON_SHARD_LOST,
        message="shard 1 at 10.0.0.2:2 was lost (silent); job 'j' stops at step 3",
    )
    inbox.on_message(pb.CoordinatorMessage(stream_end=end).SerializeToString())
    inbox.stream_ended(inbox.stream_failure(Code.UNAVAILABLE, "going away"))
    started = time.monotonic()
    with pytest.raises(ShardUnavailableError, match=r"shard 1 at 10\.0\.0\.2:2 was lost"):
        inbox.wait_step(3, timeout_s=10)
    assert time.monotonic() - started < 1


def test_a_timeout_while_a_shard_failure_is_pending_names_it() -> None:
    inbox = sharded_inbox(heartbeat_interval_s=1.0, margin_s=5.0)
    inbox.shard_failed(lost_shard())
    with pytest.raises(SyncTimeoutError, match=r"leader has not said why yet.*shard 1 at leader:2"):
        inbox.wait_step(3, timeout_s=0.1)


def test_the_grace_is_three_heartbeats_plus_the_margin_from_the_first_failure() -> None:
    assert shard_grace_s(2.0, 5.0) == 11.0
    assert shard_grace_s(None, 5.0) == pytest.approx(6.5)  # the default interval, 0.5 s
    fault = ShardFault()
    assert fault.record(lost_shard(), now=100.0, grace_s=11.0)
    assert not fault.record(lost_shard(), now=105.0, grace_s=11.0)  # the first one counts
    assert fault.due(110.9) is None and fault.due(111.0) is fault.error
    assert fault.bound(now=110.0, remaining_s=30.0) == 1.0


def test_shard_lost_maps_to_shard_unavailable_which_reconnects() -> None:
    error = error_from_status(
        Code.UNAVAILABLE, "shard 2 at b:3 was lost", reason=pb.END_REASON_SHARD_LOST, rank=0
    )
    assert type(error) is ShardUnavailableError
    assert isinstance(error, CoordinatorUnavailableError)
    assert "shard 2 at b:3" in str(error)
    assert gradsync.ShardUnavailableError is ShardUnavailableError
    assert "ShardUnavailableError" in gradsync.__all__


# ----------------------------------------------------------------- shard addresses
@pytest.mark.parametrize(
    ("announced", "leader", "target"),
    [
        (":50052", "10.0.0.1:50051", "10.0.0.1:50052"),
        (":50052", "leader.example:50051", "leader.example:50052"),
        (":50052", "[::1]:50051", "[::1]:50052"),
        ("10.0.0.9:7000", "10.0.0.1:50051", "10.0.0.9:7000"),
        ("[fe80::2]:7000", "10.0.0.1:50051", "[fe80::2]:7000"),
    ],
)
def test_a_port_only_shard_address_is_on_the_leaders_host(
    announced: str, leader: str, target: str
) -> None:
    assert shard_target(announced, leader) == target


def test_an_unusable_shard_list_is_refused_naming_what_is_wrong() -> None:
    def shards(*entries: tuple[int, str]) -> list[pb.ShardAddress]:
        return [pb.ShardAddress(index=i, address=a) for i, a in entries]

    assert shard_targets(shards((0, ""), (1, ":2"), (2, "b:3")), "a:1") == {1: "a:2", 2: "b:3"}
    with pytest.raises(ValueError, match=r"indexes \[0, 2\], expected 0..1"):
        shard_targets(shards((0, ""), (2, ":2")), "a:1")
    with pytest.raises(ValueError, match="shard 1 has address ':x'"):
        shard_targets(shards((0, ""), (1, ":x")), "a:1")
