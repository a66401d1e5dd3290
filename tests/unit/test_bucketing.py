"""Bucket assignment: reverse order, small first bucket, caps, one dtype per bucket."""

from __future__ import annotations

import pytest
import torch
from gradsync.path.bucketing import assign_buckets
from torch import nn

KIB = 1024


def test_reverse_order_and_small_first_bucket() -> None:
    sizes = [400 * KIB] * 6  # parameters 0..5
    plans = assign_buckets(
        sizes, ["f32"] * 6, bucket_cap_bytes=1000 * KIB, first_bucket_cap_bytes=300 * KIB
    )
    # The last-registered parameter alone fills the first bucket (cap 300 KiB).
    assert [p.parameter_indices for p in plans] == [(5,), (4, 3, 2), (1, 0)]
    assert [p.num_bytes for p in plans] == [400 * KIB, 1200 * KIB, 800 * KIB]


def test_every_parameter_in_exactly_one_bucket_and_caps_respected() -> None:
    sizes = [37 * KIB, 5 * KIB, 120 * KIB, 64 * KIB, 1 * KIB, 300 * KIB, 2 * KIB, 90 * KIB]
    cap, first = 128 * KIB, 16 * KIB
    plans = assign_buckets(sizes, ["f32"] * len(sizes), cap, first)
    flat = [i for plan in plans for i in plan.parameter_indices]
    assert sorted(flat) == list(range(len(sizes)))
    assert flat == sorted(flat, reverse=True)  # walked in reverse registration order
    for position, plan in enumerate(plans):
        limit = first if position == 0 else cap
        # A bucket only closes once it reaches its cap: removing its last
        # parameter must leave it below the cap.
        assert plan.num_bytes - sizes[plan.parameter_indices[-1]] < limit


def test_mixed_dtypes_never_share_a_bucket() -> None:
    dtypes = ["f32", "f64", "f32", "f64", "bf16"]
    sizes = [10 * KIB] * 5
    plans = assign_buckets(sizes, dtypes, bucket_cap_bytes=15 * KIB, first_bucket_cap_bytes=5 * KIB)
    for plan in plans:
        assert {dtypes[i] for i in plan.parameter_indices} == {plan.dtype}
    assert sorted(i for p in plans for i in p.parameter_indices) == list(range(5))
    # Each dtype gets its own small first bucket.
    first_seen: dict[str, int] = {}
    for plan in plans:
        first_seen.setdefault(str(plan.dtype), plan.num_bytes)
    assert first_seen == {"bf16": 10 * KIB, "f64": 10 * KIB, "f32": 10 * KIB}


def test_zero_size_parameters_get_no_bucket() -> None:
    plans = assign_buckets([8, 0, 8], ["f32"] * 3, 1024, 1024)
    assert [p.parameter_indices for p in plans] == [(2, 0)]


@pytest.mark.parametrize("caps", [(0, 1), (1, 0), (-5, 10)])
def test_non_positive_caps_are_rejected(caps: tuple[int, int]) -> None:
    with pytest.raises(ValueError, match="positive"):
        assign_buckets([8], ["f32"], *caps)


def test_torch_ddp_like_layout_for_a_real_model() -> None:
    model = nn.Sequential(nn.Linear(512, 512), nn.Linear(512, 512), nn.Linear(512, 10))
    params = list(model.parameters())
    plans = assign_buckets(
        [p.numel() * p.element_size() for p in params],
        [p.dtype for p in params],
        bucket_cap_bytes=1 << 20,
        first_bucket_cap_bytes=4096,
    )
    # Bucket 0 holds the output layer's gradients, which autograd produces first.
    assert plans[0].parameter_indices[0] == len(params) - 1
    assert all(plan.dtype == torch.float32 for plan in plans)
