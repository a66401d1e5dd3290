"""A one-process simulation of DiLoCo across sites (`gradsync.DiLoCo(replica_group=...)`).

Written from the rule, not from gradsync: each site is one replica that trains
the full model. Its inner step's gradient is the mean of its ranks' gradients,
rank k of site s computing the mean-squared-error gradient on the batch of
"rank" 10 * s + k (`support.diloco_reference.batch`), which is what FSDP2's
reduce-scatter and DDP's all-reduce both average. After every H inner steps the
sites' pseudo-gradients (global - local) are averaged over the live sites and
the outer optimizer (SGD with Nesterov momentum) moves the global parameters,
which every site continues from.

A sharded site (FSDP2 over n ranks) runs one coordinator job per shard index:
rank j's piece of each parameter is its `torch.chunk(p, n, dim=0)[j]`. With an
int8 wire each job quantizes its own pieces on its own bucket layout and chunk
grid (`support.diloco_reference.int8_wire`), and a compact answer rounds each
job's change of its public copy the same way; the float wires are per element,
so the job split does not change them.

`lost` = (site, round): the site is gone from that round on (its inner steps in it
are lost); `back` = c: it comes back restarted (a fresh inner optimizer) from
round c's global parameters and takes part in rounds c + 1 on, its batches those
of the steps from c * H on.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
from gradsync import defaults
from torch import nn

from support.diloco_reference import (
    Run,
    answer_round_trip,
    batch,
    simulate,
    simulate_streaming,
)


class _Pieces(nn.Module):
    """Parameters of the given shapes, in order: a job's bucket layout for `int8_wire`."""

    def __init__(self, pieces: Sequence[torch.Tensor]) -> None:
        super().__init__()
        self.pieces = nn.ParameterList(nn.Parameter(p.detach().clone()) for p in pieces)


def per_job(
    tensors: list[torch.Tensor], shards: int, dtype: str, chunk_bytes: int, shard_count: int
) -> list[torch.Tensor]:
    """`tensors` as the coordinator receives them in `dtype` ("int8", "bf16", ...) over
    `shards` jobs (1: replicated site), each job's pieces rounded on their own bucket
    layout (`support.diloco_reference.answer_round_trip`)."""
    jobs: list[list[torch.Tensor]] = [[] for _ in range(shards)]
    for t in tensors:
        for j, piece in enumerate(torch.chunk(t, shards, dim=0)):
            jobs[j].append(piece)
    done: list[list[torch.Tensor]] = []
    for pieces in jobs:
        kept = [p for p in pieces if p.numel()]
        module = _Pieces(kept)
        it = iter(answer_round_trip(kept, module, dtype, chunk_bytes, shard_count))
        done.append([next(it) if p.numel() else p for p in pieces])
    return [torch.cat([done[j][i] for j in range(shards)]) for i in range(len(tensors))]


def simulate_sites(
    run: Run,
    sizes: Sequence[int],
    initial: nn.Module,
    *,
    shards: int = 1,
    lost: tuple[int, int] | None = None,
    back: int | None = None,
    chunk_bytes: int = defaults.CHUNK_BYTES,
    shard_count: int = 1,
) -> list[list[torch.Tensor]]:
    """The global parameters the sites hold after each round (round 0 = the initial ones):
    `support.diloco_reference.simulate` with a site for a replica.

    Args:
        sizes: each site's number of ranks.
        shards: the jobs one site's parameters are cut over (FSDP2 inside: its rank
            count; DDP or plain: 1).
        chunk_bytes, shard_count: the coordinator's grid (the int8 wire's scales).
    """

    def rounding(tensors: list[torch.Tensor], _: nn.Module, dtype: str) -> list[torch.Tensor]:
        return per_job(tensors, shards, dtype, chunk_bytes, shard_count)

    return simulate(
        run,
        len(sizes),
        initial,
        lost=lost,
        back=back,
        inner_step=functools.partial(site_step, run, sizes),
        rounding=rounding,
    )


def site_step(
    run: Run,
    sizes: Sequence[int],
    site: int,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    step: int,
) -> None:
    """One inner step of a site: the mean of its ranks' gradients, then the optimizer."""
    size = sizes[site]
    grads = [torch.zeros_like(p) for p in model.parameters()]
    for k in range(size):
        x, y = batch(run, 10 * site + k, step)
        model.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        for total, p in zip(grads, model.parameters(), strict=True):
            assert p.grad is not None
            total += p.grad
    for p, total in zip(model.parameters(), grads, strict=True):
        p.grad = total / size
    optimizer.step()


def simulate_sites_streaming(
    run: Run, sizes: Sequence[int], initial: nn.Module, split: list[int]
) -> list[list[torch.Tensor]]:
    """Every site's parameters at the end of a Streaming DiLoCo run across sites (float32
    wire; they differ by the local progress since each fragment's last merge):
    `support.diloco_reference.simulate_streaming` with a site for a replica.

    `split`: how many parameters each fragment holds, in order. Fragment i's round
    starts after the inner steps t with t mod H = i*H/F (every site's ranks at
    once), one outer step of its own optimizer on the sites' mean pseudo-gradient,
    merged `overlap_steps` later (p = mixing * global + (1 - mixing) * p), or at once.
    """
    return simulate_streaming(
        run, len(sizes), initial, split, inner_step=functools.partial(site_step, run, sizes)
    )
