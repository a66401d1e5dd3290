"""The upload pacer's schedule, without sockets: windows, rotation, stalls, what is sent.

The pacer may only change *when* a chunk is handed to its stream: every test
also checks that what reaches the streams is exactly the unpaced chunks (same
offsets, same bytes, each once), so the coordinator's checks and sums cannot
tell the difference.
"""

from __future__ import annotations

import os
import random
from collections.abc import Callable

import numpy as np
import pytest
from gradsync.path.bucket_uploads import BucketUpload, RangeUpload, range_messages, split_upload
from gradsync.path.buffers import BucketBuffer
from gradsync.path.pacing import (
    ENV_UPLOAD_WINDOW_MB,
    UPLOAD_WINDOW_BYTES,
    UploadPacer,
    chunk_bytes_of,
    rotation,
    split_range,
    window_bytes_from_env,
)
from gradsync_proto.auth import is_loopback
from gradsync_proto.codec import decode_gradient
from gradsync_proto.v1 import gradsync_pb2 as pb

pytestmark = pytest.mark.unit

F32 = pb.DTYPE_FLOAT32
CHUNK = 1024


class Source:
    """A Welcome with a chunk size, as the transport's inbox holds it."""

    def __init__(self, chunk_bytes: int = CHUNK) -> None:
        self.welcome = pb.Welcome(chunk_bytes=chunk_bytes)


class Timers:
    """`loop.call_later` by hand: callbacks fire when the test says."""

    def __init__(self) -> None:
        self.pending: list[tuple[float, Callable[[], None], list[bool]]] = []

    def schedule(self, delay_s: float, callback: Callable[[], None]) -> Handle:
        cancelled = [False]
        self.pending.append((delay_s, callback, cancelled))
        return Handle(cancelled)

    def fire_all(self) -> int:
        due, self.pending = self.pending, []
        fired = 0
        for _, callback, cancelled in due:
            if not cancelled[0]:
                callback()
                fired += 1
        return fired


class Handle:
    def __init__(self, cancelled: list[bool]) -> None:
        self._cancelled = cancelled

    def cancel(self) -> None:
        self._cancelled[0] = True


def upload(step: int, num_bytes: int, bucket_index: int = 0, **kwargs: object) -> BucketUpload:
    data = np.random.default_rng(num_bytes + step).integers(0, 256, num_bytes, dtype=np.uint8)
    return BucketUpload(step, bucket_index, BucketBuffer([data]), F32, **kwargs)  # type: ignore[arg-type]


def pacer_for(
    rank: int = 0, window: int = 2 * CHUNK, timers: Timers | None = None
) -> tuple[UploadPacer, list[tuple[int, RangeUpload]]]:
    sent: list[tuple[int, RangeUpload]] = []
    timers = timers or Timers()
    send = lambda i, part: sent.append((i, part))  # noqa: E731
    pacer = UploadPacer(rank, send, Source(), timers.schedule, "10.0.0.1:50051", window)
    return pacer, sent


def answer(pacer: UploadPacer, index: int, part: RangeUpload) -> None:
    """The stream's answer to every chunk of `part` (float32 averages)."""
    pacer.answered(index, part.upload.step, F32, part.hi - part.lo)


def wire(parts: list[tuple[int, RangeUpload]]) -> dict[int, bytes]:
    """{offset: payload} of every chunk the parts encode (each chunk once)."""
    chunks: dict[int, bytes] = {}
    for _, part in parts:
        for raw in range_messages(part, CHUNK, 0, lambda *_: None):
            decoded = decode_gradient(raw)
            assert decoded is not None
            header, payload = decoded
            assert header.offset not in chunks, f"chunk {header.offset} sent twice"
            chunks[header.offset] = bytes(payload)
    return chunks


# ----------------------------------------------------------------- the pure schedule
@pytest.mark.parametrize("shard_count", [1, 2, 3, 4, 8])
def test_at_every_slot_each_shard_hears_from_one_rank(shard_count: int) -> None:
    for slot in range(shard_count):
        targets = [rotation(rank, shard_count)[slot] for rank in range(shard_count)]
        assert sorted(targets) == list(range(shard_count)), (slot, targets)
    for rank in range(shard_count):
        assert sorted(rotation(rank, shard_count)) == list(range(shard_count))
        assert rotation(rank, shard_count)[0] == rank % shard_count


def test_pieces_keep_the_range_grid() -> None:
    item = upload(1, 10 * CHUNK + 300)
    for part in split_upload(item, 3):
        assert part is not None
        pieces = split_range(part, CHUNK)
        assert pieces[0].lo == part.lo and pieces[-1].hi == part.hi
        assert all(p.hi - p.lo <= CHUNK for p in pieces)
        assert all((p.lo - part.lo) % CHUNK == 0 for p in pieces)
        assert wire([(0, p) for p in pieces]) == wire([(0, part)])


def test_chunk_size_comes_from_the_welcome() -> None:
    assert chunk_bytes_of(pb.Welcome(chunk_bytes=4096)) == 4096
    assert chunk_bytes_of(None) == chunk_bytes_of(pb.Welcome()) > 0


def test_window_setting_from_the_environment() -> None:
    assert window_bytes_from_env({}) == UPLOAD_WINDOW_BYTES
    assert window_bytes_from_env({ENV_UPLOAD_WINDOW_MB: "0"}) == 0
    assert window_bytes_from_env({ENV_UPLOAD_WINDOW_MB: "1.5"}) == 3 << 19
    for bad in ("-1", "many", "nan"):
        with pytest.raises(ValueError, match=ENV_UPLOAD_WINDOW_MB):
            window_bytes_from_env({ENV_UPLOAD_WINDOW_MB: bad})


def test_a_coordinator_on_loopback_is_not_paced_unless_asked() -> None:
    for target in ("127.0.0.1:50051", "127.3.0.9:1", "[::1]:50051", "localhost:50051"):
        assert is_loopback(target)
        assert window_bytes_from_env({}, target) == 0
        assert window_bytes_from_env({ENV_UPLOAD_WINDOW_MB: "2"}, target) == 2 << 20
    for target in ("10.213.0.2:50051", "coordinator:50051", "[fd00::1]:1", "not an address"):
        assert not is_loopback(target)
        assert window_bytes_from_env({}, target) == UPLOAD_WINDOW_BYTES
    pacer = UploadPacer(0, lambda *_: None, Source(), Timers().schedule, "127.0.0.1:50051")
    assert pacer.window_bytes == 0 or ENV_UPLOAD_WINDOW_MB in os.environ


# ----------------------------------------------------------------- windows
def test_a_stream_holds_at_most_its_window_until_answers_come() -> None:
    pacer, sent = pacer_for(window=2 * CHUNK)
    pacer.dispatch(split_upload(upload(1, 8 * CHUNK), 1))
    assert [(p.lo, p.hi) for _, p in sent] == [(0, CHUNK), (CHUNK, 2 * CHUNK)]
    assert pacer.outstanding(0) == 2 * CHUNK and pacer.queued(0) == 6
    answer(pacer, 0, sent[0][1])
    assert len(sent) == 3 and pacer.outstanding(0) == 2 * CHUNK
    while pacer.queued(0):
        answer(pacer, 0, sent[len(sent) - 2][1])
    assert len(sent) == 8 and pacer.stalls == 0


def test_the_rotation_starts_at_the_ranks_own_shard() -> None:
    shard_count = 4
    for rank in range(shard_count):
        pacer, sent = pacer_for(rank=rank, window=CHUNK)
        pacer.dispatch(split_upload(upload(1, shard_count * 3 * CHUNK), shard_count))
        assert [index for index, _ in sent] == rotation(rank, shard_count)


def test_answers_of_another_step_or_stream_open_nothing() -> None:
    pacer, sent = pacer_for(window=CHUNK)
    pacer.dispatch(split_upload(upload(2, 4 * CHUNK), 2))
    assert len(sent) == 2
    pacer.answered(0, 1, F32, CHUNK)  # an older step's answer
    pacer.answered(7, 2, F32, CHUNK)  # a stream this rank never sent on
    assert len(sent) == 2


def test_a_newer_step_resets_the_windows() -> None:
    pacer, sent = pacer_for(window=CHUNK)
    pacer.dispatch(split_upload(upload(1, 3 * CHUNK), 1))
    assert len(sent) == 1
    pacer.dispatch(split_upload(upload(2, 2 * CHUNK), 1))
    # Step 1's queued chunks no longer count against the window, step 2's first does.
    assert [p.upload.step for _, p in sent] == [1, 1, 1, 2]
    assert pacer.outstanding(0) == CHUNK


def test_a_window_no_answer_opens_ends_the_pacing_of_its_step() -> None:
    """A straggler: the rank sends the rest of the step at once, not a window per stall."""
    timers = Timers()
    pacer, sent = pacer_for(window=CHUNK, timers=timers)
    pacer.dispatch(split_upload(upload(1, 6 * CHUNK), 2))
    assert len(sent) == 2 and len(timers.pending) == 2
    assert timers.fire_all() == 1  # the first stall released everything: the other is moot
    assert len(sent) == 6 and pacer.stalls == 1
    pacer.dispatch(split_upload(upload(1, 4 * CHUNK, bucket_index=1), 2))
    assert len(sent) == 10  # the same step's later buckets: unpaced too
    pacer.dispatch(split_upload(upload(2, 4 * CHUNK), 2))
    assert len(sent) == 12  # the next step is paced again
    assert timers.fire_all() == 1 and len(sent) == 14


def test_an_answer_cancels_the_stall_timer() -> None:
    timers = Timers()
    pacer, sent = pacer_for(window=CHUNK, timers=timers)
    pacer.dispatch(split_upload(upload(1, 2 * CHUNK), 1))
    answer(pacer, 0, sent[0][1])
    assert len(sent) == 2
    assert timers.fire_all() == 0 and pacer.stalls == 0


@pytest.mark.parametrize(
    "item",
    [
        upload(1, 6 * CHUNK, segment_offset=0),  # same host: nothing crosses a network
        upload(1, 0),  # an empty bucket
    ],
)
def test_unpaced_uploads_go_out_whole(item: BucketUpload) -> None:
    pacer, sent = pacer_for(window=CHUNK)
    parts = split_upload(item, 1)
    pacer.dispatch(parts)
    assert [part for _, part in sent] == parts


def test_window_zero_turns_pacing_off() -> None:
    pacer, sent = pacer_for(window=0)
    parts = split_upload(upload(1, 6 * CHUNK), 3)
    pacer.dispatch(parts)
    assert [part for _, part in sent] == [p for p in parts if p is not None]


# ----------------------------------------------------------------- what is sent
def test_bucket_events_fire_once_around_all_pieces() -> None:
    pacer, sent = pacer_for(window=CHUNK)
    item = upload(1, 5 * CHUNK + 8)
    pacer.dispatch(split_upload(item, 2))
    events: list[str] = []
    done = 0
    while done < len(sent) or pacer.queued(0) or pacer.queued(1):
        index, part = sent[done]
        for _ in range_messages(part, CHUNK, 0, lambda event, *_: events.append(event)):
            pass
        answer(pacer, index, part)
        done += 1
    assert events == ["upload_start", "upload_end"]


@pytest.mark.parametrize("seed", range(5))
def test_random_answer_orders_send_every_chunk_exactly_once(seed: int) -> None:
    """Answers in any order, several buckets: the streams get exactly the unpaced chunks."""
    rng = random.Random(seed)
    shard_count = rng.randint(1, 5)
    pacer, sent = pacer_for(rank=rng.randint(0, 7), window=rng.choice([CHUNK, 3 * CHUNK]))
    items = [upload(1, 4 * rng.randint(1, 3 * CHUNK), bucket_index=b) for b in range(3)]
    expected = [wire([(0, p) for p in split_upload(i, shard_count) if p]) for i in items]
    for item in items:
        pacer.dispatch(split_upload(item, shard_count))
    unanswered = list(sent)
    while unanswered:
        index, part = unanswered.pop(rng.randrange(len(unanswered)))
        before = len(sent)
        answer(pacer, index, part)
        unanswered += sent[before:]
        for shard in range(shard_count):
            assert pacer.outstanding(shard) <= 3 * CHUNK
    assert not any(pacer.queued(shard) for shard in range(shard_count)) and pacer.stalls == 0
    for item, chunks in zip(items, expected, strict=True):
        assert wire([(i, p) for i, p in sent if p.upload is item]) == chunks
