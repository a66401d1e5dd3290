"""The sparse 2-bit wire written from its rule, in torch, for the one-process simulation.

Independent of gradsync's own code (`gradsync_proto.sparse_wire`): per chunk
of n elements of the coordinator's grid, k = min(n, ceil(density * n)); the
k largest |x|, ties to the lowest index (a stable sort of -|x|); the step
d = max|x_selected| / 3 in float32; code c = clamp(round((x / d + 3) / 2), 0, 3)
(round half to even), level q = 2c - 3; the chunk stands for q * d on the
selection and 0 elsewhere; a chunk whose step is 0 stands for zeros, one
holding NaN or Inf for NaN everywhere.
"""

from __future__ import annotations

import math

import torch
from gradsync import defaults
from gradsync.path.reducer import plan_buckets
from gradsync_proto import chunking
from gradsync_proto.defaults import MIB
from torch import nn


def sparse_chunk(x: torch.Tensor, density: float) -> torch.Tensor:
    """What one chunk (float32, 1-D) stands for on the sparse wire."""
    n = x.numel()
    if n == 0:
        return x.clone()
    if not bool(torch.isfinite(x).all()):
        return torch.full_like(x, math.nan)
    k = min(n, math.ceil(density * n))
    chosen = torch.argsort(-x.abs(), stable=True)[:k]
    selected = x[chosen]
    step = selected.abs().max() / 3
    out = torch.zeros_like(x)
    if step == 0:
        return out
    codes = torch.round((selected / step + 3) / 2).clamp(0, 3)
    out[chosen] = (2 * codes - 3) * step
    return out


def sparse_round_trip(
    flat: torch.Tensor, chunk_bytes: int, shard_count: int, density: float
) -> torch.Tensor:
    """What the coordinator sums for one float32 bucket on the sparse wire (the int8 grid)."""
    out = torch.zeros_like(flat)
    for shard in range(shard_count):
        lo, hi = chunking.shard_byte_range(flat.numel(), 1, shard_count, shard)
        for offset, length in chunking.range_chunk_spans(lo, hi, chunk_bytes):
            out[offset : offset + length] = sparse_chunk(flat[offset : offset + length], density)
    return out


def sparse_wire(
    deltas: list[torch.Tensor], model: nn.Module, chunk_bytes: int, shard_count: int, density: float
) -> list[torch.Tensor]:
    """Each parameter's pseudo-gradient as sent sparse, on the rank's bucket layout."""
    named = list(model.named_parameters())
    buckets, _ = plan_buckets(
        named, int(defaults.BUCKET_CAP_MB * MIB), int(defaults.FIRST_BUCKET_MB * MIB)
    )
    out = list(deltas)
    for plan in buckets:
        indices = list(plan.parameter_indices)
        flat = torch.cat([deltas[i].reshape(-1) for i in indices])
        sent = sparse_round_trip(flat, chunk_bytes, shard_count, density)
        for i, piece in zip(indices, sent.split([deltas[i].numel() for i in indices]), strict=True):
            out[i] = piece.reshape(deltas[i].shape)
    return out
