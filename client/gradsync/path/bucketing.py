"""Assignment of parameters to gradient buckets (pure logic).

Why reverse order: autograd produces gradients roughly from the last layer to
the first, so walking parameters in reverse registration order puts the
earliest-ready gradients in bucket 0 and lets its upload start while backward
is still running through earlier layers.

Why a small first bucket: the first bucket can only be sent once all of its
gradients exist; capping it (1 MiB by default) makes the first upload start
almost as soon as backward begins, like PyTorch DDP does.

Each bucket holds a single dtype (reductions are per dtype), so one open
bucket is kept per dtype; a bucket closes as soon as it reaches its cap (the
parameter that crosses the cap stays in it).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class BucketPlan:
    """One bucket: the parameters it holds (indices, layout order) and its dtype."""

    parameter_indices: tuple[int, ...]
    dtype: Hashable
    num_bytes: int


def assign_buckets(
    sizes_bytes: Sequence[int],
    dtypes: Sequence[Hashable],
    bucket_cap_bytes: int,
    first_bucket_cap_bytes: int,
) -> list[BucketPlan]:
    """Group parameters into buckets, walking them in reverse registration order.

    Args:
        sizes_bytes: size of each parameter's gradient, in registration order.
            Parameters of size 0 get no bucket (there is nothing to average).
        dtypes: each parameter's dtype (any hashable key).
        bucket_cap_bytes: cap of every bucket after the first of its dtype.
        first_bucket_cap_bytes: cap of the first bucket of each dtype.

    Returns:
        Buckets in the order they are expected to become ready: closed buckets
        in closing order, then the still-open ones by their first parameter.

    Raises:
        ValueError: for mismatched lengths or non-positive caps.
    """
    if len(sizes_bytes) != len(dtypes):
        raise ValueError(f"{len(sizes_bytes)} sizes but {len(dtypes)} dtypes")
    if bucket_cap_bytes <= 0 or first_bucket_cap_bytes <= 0:
        raise ValueError(
            f"bucket caps must be positive, got {bucket_cap_bytes} and {first_bucket_cap_bytes}"
        )
    closed: list[BucketPlan] = []
    open_buckets: dict[Hashable, list[int]] = {}
    open_bytes: dict[Hashable, int] = {}
    seen_first: set[Hashable] = set()
    for index in reversed(range(len(sizes_bytes))):
        size = sizes_bytes[index]
        if size == 0:
            continue
        dtype = dtypes[index]
        open_buckets.setdefault(dtype, []).append(index)
        open_bytes[dtype] = open_bytes.get(dtype, 0) + size
        cap = bucket_cap_bytes if dtype in seen_first else first_bucket_cap_bytes
        if open_bytes[dtype] >= cap:
            closed.append(BucketPlan(tuple(open_buckets.pop(dtype)), dtype, open_bytes.pop(dtype)))
            seen_first.add(dtype)
    # Open buckets hold the first-registered parameters: they become ready last.
    for dtype, indices in open_buckets.items():
        closed.append(BucketPlan(tuple(indices), dtype, open_bytes[dtype]))
    return closed
