"""A step uploaded again after a coordinator restart sends the gradients, never their averages.

`Reducer.resend` gives a new coordinator the step in flight. Over TCP an average
lands in a bucket the moment that bucket completes, over the very bytes it
uploaded, so the reducer keeps a copy of each upload and restores it. Through a
local group the averages are copied out only once the whole step is averaged,
so the uploads are still intact and no copy is taken (one pass over every
gradient byte less per step).
"""

from __future__ import annotations

import pytest
import torch
from gradsync.instruments import Instruments
from gradsync.path.bucketing import assign_buckets
from gradsync.path.buffers import BucketBuffer
from gradsync.path.reducer import Reducer

#: What a landed "average" looks like in this test: bytes no gradient here has.
LANDED = 0xAB


class LandingPath:
    """A gradient path that records each upload; with `averages_land_early`, the
    average lands over the upload at once (as a bucket completing over TCP)."""

    def __init__(self, averages_land_early: bool) -> None:
        self.averages_land_early = averages_land_early
        self.uploads: list[tuple[int, bytes]] = []

    def submit_bucket(
        self, step: int, bucket_index: int, buffer: BucketBuffer, dtype: int, **_: object
    ) -> None:
        self.uploads.append((bucket_index, b"".join(s.tobytes() for s in buffer.segments)))
        if self.averages_land_early:
            for segment in buffer.segments:
                segment[:] = LANDED


def one_step_then_resend(averages_land_early: bool) -> tuple[Reducer, LandingPath]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    named = list(model.named_parameters())
    sizes = [p.numel() * p.element_size() for _, p in named]
    buckets = assign_buckets(sizes, [p.dtype for _, p in named], 200, 100)
    assert len(buckets) > 1  # several buckets: each one kept (or not) on its own
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


def test_only_a_path_whose_averages_land_early_costs_a_copy() -> None:
    kept, _ = one_step_then_resend(averages_land_early=True)
    intact, _ = one_step_then_resend(averages_land_early=False)
    assert all(copies for copies in kept._copies)
    assert not any(copies for copies in intact._copies)
