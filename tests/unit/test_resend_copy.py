"""A step uploaded again after a coordinator restart sends the gradients, never their averages.

`Reducer.resend` gives a new coordinator the step in flight from the very
buffers it uploaded, without a copy of them: a gradient path writes the
averages only inside `wait_step` (`GradientPath`). The inbox (the path over
TCP) is held to that here with real averaged-chunk messages; through a local
group the members copy the averages out inside `wait_step` as well
(`LocalGroup._copy_out`).
"""

from __future__ import annotations

import numpy as np
import torch
from gradsync.instruments import Instruments
from gradsync.path.bucketing import assign_buckets
from gradsync.path.buffers import BucketBuffer
from gradsync.path.inbox import Inbox
from gradsync.path.reducer import Reducer
from gradsync_proto.v1 import gradsync_pb2 as pb

F32 = pb.DTYPE_FLOAT32


def averaged(step: int, bucket: int, offset: int, payload: bytes) -> bytes:
    chunk = pb.GradientChunk(
        step=step, bucket_index=bucket, offset=offset, payload=payload, contributors=2
    )
    return pb.CoordinatorMessage(gradient=chunk).SerializeToString()


def test_an_average_that_arrived_is_written_only_when_the_step_is_waited_for() -> None:
    inbox = Inbox("coordinator:1", rank=0)
    inbox.configure_buckets([64, 64])
    welcome = pb.Welcome(chunk_bytes=32, shards=[pb.ShardAddress(index=0)])
    inbox.on_message(pb.CoordinatorMessage(welcome=welcome).SerializeToString())
    uploads = [np.arange(64, dtype=np.uint8), np.arange(64, 128, dtype=np.uint8)]
    buffers = [BucketBuffer([u.copy()]) for u in uploads]
    for index, buffer in enumerate(buffers):
        inbox.expect_bucket(7, index, buffer, F32)
    # Bucket 0 complete, bucket 1 half: a coordinator lost now leaves both as uploaded.
    for offset in (0, 32):
        inbox.on_message(averaged(7, 0, offset, bytes([200]) * 32))
    inbox.on_message(averaged(7, 1, 0, bytes([201]) * 32))
    for buffer, upload in zip(buffers, uploads, strict=True):
        assert np.array_equal(buffer.segments[0], upload), "an average landed before wait_step"
    inbox.on_message(averaged(7, 1, 32, bytes([201]) * 32))
    assert inbox.wait_step(7, timeout_s=1) == 2
    assert set(buffers[0].segments[0]) == {200} and set(buffers[1].segments[0]) == {201}


class RecordingPath:
    """A gradient path that records every upload (the coordinator died before answering)."""

    def __init__(self) -> None:
        self.uploads: list[tuple[int, bytes]] = []

    def submit_bucket(
        self, step: int, bucket_index: int, buffer: BucketBuffer, dtype: int, **_: object
    ) -> None:
        self.uploads.append((bucket_index, b"".join(s.tobytes() for s in buffer.segments)))


def test_the_resent_step_uploads_the_same_bytes_as_the_first_time() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    named = list(model.named_parameters())
    sizes = [p.numel() * p.element_size() for _, p in named]
    buckets = assign_buckets(sizes, [p.dtype for _, p in named], 200, 100)
    assert len(buckets) > 1
    path = RecordingPath()
    instruments = Instruments(0, None, None, [b.num_bytes for b in buckets] + [4 * len(named)])
    reducer = Reducer(named, buckets, 0, 2, instruments, lambda: path)  # type: ignore[arg-type]
    reducer.keep_for_resend = True  # as under the default reconnect_timeout_s
    model(torch.randn(4, 8)).sum().backward()
    for index in range(len(named)):
        reducer.gradient_ready(index, 0, overlap=True)
    reducer.launch_rest(0)
    half = len(path.uploads)
    reducer.resend(0)
    first, again = dict(path.uploads[:half]), dict(path.uploads[half:])
    assert sorted(first) == sorted(again) and len(first) >= 2 and len(path.uploads) == 2 * half
    for bucket_index, sent in first.items():
        assert again[bucket_index] == sent, f"bucket {bucket_index} went out again changed"
