"""A step uploaded again after a coordinator restart sends the gradients, never their averages.

`Reducer.resend` gives a new coordinator the step in flight. Over TCP an average
lands in a bucket the moment that bucket completes, over the very bytes it
uploaded, so the bucket records what the transport sent (a view of each
payload inside its encoded message, `BucketBuffer.record_sent`) and the resend
writes it back. Through a local group the averages are copied out only once
the whole step is averaged, so the uploads are still intact and nothing is
recorded. Neither costs a pass over the gradients on the training thread.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gradsync.instruments import Instruments
from gradsync.path.bucket_uploads import BucketUpload, range_messages, split_upload
from gradsync.path.bucketing import assign_buckets
from gradsync.path.buffers import BucketBuffer
from gradsync.path.reducer import Reducer

#: What a landed "average" looks like in this test: bytes no gradient here has.
LANDED = 0xAB
#: Small chunks, so that a bucket goes out as several messages, cut across parameters.
CHUNK_BYTES = 48


class LandingPath:
    """A gradient path that encodes each upload as the transport does (recording what
    it sends when asked); with `averages_land_early`, the average of every chunk
    sent lands over the upload at once (as a bucket completing over TCP)."""

    def __init__(self, averages_land_early: bool) -> None:
        self.averages_land_early = averages_land_early
        self.uploads: list[tuple[int, bytes]] = []

    def submit_bucket(
        self, step: int, bucket_index: int, buffer: BucketBuffer, dtype: int, **_: object
    ) -> None:
        self.uploads.append((bucket_index, b"".join(s.tobytes() for s in buffer.segments)))
        (part,) = split_upload(BucketUpload(step, bucket_index, buffer, dtype), 1)
        assert part is not None
        messages = list(range_messages(part, CHUNK_BYTES, 0, lambda *_: None))
        assert len(messages) == -(-buffer.size // CHUNK_BYTES)
        if self.averages_land_early:
            for segment in buffer.segments:
                segment[:] = LANDED


def one_step_then_resend(averages_land_early: bool) -> tuple[Reducer, LandingPath]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    named = list(model.named_parameters())
    sizes = [p.numel() * p.element_size() for _, p in named]
    buckets = assign_buckets(sizes, [p.dtype for _, p in named], 200, 100)
    assert len(buckets) > 1  # several buckets: each one recorded (or not) on its own
    path = LandingPath(averages_land_early)
    instruments = Instruments(0, None, None, [b.num_bytes for b in buckets] + [4 * len(named)])
    reducer = Reducer(named, buckets, 0, 2, instruments, lambda: path)
    reducer.keep_for_resend = True  # as under the default reconnect_timeout_s
    model(torch.randn(4, 8)).sum().backward()
    for index in range(len(named)):
        reducer.gradient_ready(index, 0, overlap=True)
    reducer.launch_rest(0)
    reducer.resend(0)
    return reducer, path


@pytest.mark.parametrize("averages_land_early", [True, False], ids=["over-tcp", "local-group"])
def test_the_resent_step_uploads_the_same_bytes_as_the_first_time(
    averages_land_early: bool,
) -> None:
    _, path = one_step_then_resend(averages_land_early)
    half = len(path.uploads) // 2
    first, again = dict(path.uploads[:half]), dict(path.uploads[half:])
    assert sorted(first) == sorted(again) and len(first) >= 2 and len(path.uploads) == 2 * half
    for bucket_index, sent in first.items():
        assert set(sent) != {LANDED}, bucket_index  # real gradients went out first
        assert again[bucket_index] == sent, f"bucket {bucket_index} went out again changed"


def test_only_a_path_whose_averages_land_early_records_what_it_sent() -> None:
    recorded, _ = one_step_then_resend(averages_land_early=True)
    intact, _ = one_step_then_resend(averages_land_early=False)
    launched = [b for b in recorded._launched if b is not None and b.upload is not None]
    assert launched and all(b.upload.buffer.sent for b in launched)  # type: ignore[union-attr]
    others = [b for b in intact._launched if b is not None and b.upload is not None]
    assert others and all(b.upload.buffer.sent is None for b in others)  # type: ignore[union-attr]


def test_recorded_payloads_are_views_of_the_messages_not_copies() -> None:
    data = np.arange(100, dtype=np.uint8)
    buffer = BucketBuffer(np.split(data.copy(), [30, 31, 70]), record_sent=True)
    (part,) = split_upload(BucketUpload(0, 0, buffer, 1), 1)
    assert part is not None
    messages = list(range_messages(part, 32, 0, lambda *_: None))
    assert buffer.sent is not None and len(buffer.sent) == len(messages) == 4
    for (offset, payload), message in zip(buffer.sent, messages, strict=True):
        assert payload.obj is message  # held, not copied
        assert bytes(payload) == data[offset : offset + 32].tobytes()
    for segment in buffer.segments:
        segment[:] = LANDED
    buffer.restore_sent()
    assert b"".join(s.tobytes() for s in buffer.segments) == data.tobytes()
    assert buffer.sent == []  # the next upload is recorded afresh


def test_a_buffer_that_records_nothing_cannot_be_restored() -> None:
    buffer = BucketBuffer([np.zeros(8, dtype=np.uint8)])
    buffer.record(0, [memoryview(bytes(8))], bytes(16))
    assert buffer.sent is None
    with pytest.raises(RuntimeError, match="not recorded"):
        buffer.restore_sent()
