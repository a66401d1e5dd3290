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

from collections.abc import Sequence

import torch
from gradsync import defaults
from torch import nn

from support.diloco_reference import (
    WIRES,
    CoordinatorSGD,
    Run,
    answer_round_trip,
    batch,
    inner_optimizer,
    int8_wire,
    make_model,
)


class _Pieces(nn.Module):
    """Parameters of the given shapes, in order: a job's bucket layout for `int8_wire`."""

    def __init__(self, pieces: Sequence[torch.Tensor]) -> None:
        super().__init__()
        self.pieces = nn.ParameterList(nn.Parameter(p.detach().clone()) for p in pieces)


def per_job(
    tensors: list[torch.Tensor], shards: int, rounding: str, chunk_bytes: int, shard_count: int
) -> list[torch.Tensor]:
    """`tensors` as the coordinator receives them over `shards` jobs (1: replicated site):
    "wire" rounds them as the int8 wire does, an answer dtype ("int8", "bf16") as the
    compact answer does."""
    jobs: list[list[torch.Tensor]] = [[] for _ in range(shards)]
    for t in tensors:
        for j, piece in enumerate(torch.chunk(t, shards, dim=0)):
            jobs[j].append(piece)
    done: list[list[torch.Tensor]] = []
    for pieces in jobs:
        kept = [p for p in pieces if p.numel()]
        module = _Pieces(kept)
        if rounding == "wire":
            rounded = int8_wire(kept, module, chunk_bytes, shard_count)
        else:
            rounded = answer_round_trip(kept, module, rounding, chunk_bytes, shard_count)
        it = iter(rounded)
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
    """The global parameters the sites hold after each round (round 0 = the initial ones).

    Args:
        sizes: each site's number of ranks.
        shards: the jobs one site's parameters are cut over (FSDP2 inside: its rank
            count; DDP or plain: 1).
        chunk_bytes, shard_count: the coordinator's grid (the int8 wire's scales).
    """
    wire = WIRES[run.wire]
    sites = [make_model(0, run.hidden) for _ in sizes]
    for site in sites:
        site.load_state_dict(initial.state_dict())
    optimizers = [inner_optimizer(run, site) for site in sites]
    global_params = [p.detach().clone().requires_grad_(True) for p in initial.parameters()]
    quantized = wire is torch.int8 or run.answer != "fp32"
    outer: torch.optim.SGD | CoordinatorSGD = (
        CoordinatorSGD(global_params, run)
        if quantized
        else torch.optim.SGD(
            global_params,
            lr=run.outer_lr,
            momentum=run.outer_momentum,
            nesterov=run.outer_momentum > 0,
        )
    )
    public = [p.detach().clone() for p in global_params]
    residuals = [[torch.zeros_like(p) for p in global_params] for _ in sizes]
    history = [[p.detach().clone() for p in public]]
    for number in range(1, run.rounds + 1):
        live = []
        for s in range(len(sizes)):
            gone = lost is not None and s == lost[0] and number >= lost[1]
            if gone and back is not None and number > back:
                gone = False
                if number == back + 1:  # restarted: a fresh process from round `back`
                    sites[s].load_state_dict(_state_of(sites[s], history[back]))
                    optimizers[s] = inner_optimizer(run, sites[s])
                    residuals[s] = [torch.zeros_like(p) for p in global_params]
            if not gone:
                live.append(s)
        for inner in range(run.sync_every):
            step = (number - 1) * run.sync_every + inner
            for s in live:
                _inner_step(sites[s], optimizers[s], run, s, sizes[s], step)
        pseudo = []
        for s in live:
            deltas = [g - p.detach() for g, p in zip(public, sites[s].parameters(), strict=True)]
            if wire is not None:
                deltas = [d + r for d, r in zip(deltas, residuals[s], strict=True)]
            if wire is torch.int8:
                sent = per_job(deltas, shards, "wire", chunk_bytes, shard_count)
            else:
                sent = [d if wire is None else d.to(wire).float() for d in deltas]
            if wire is not None:
                residuals[s] = [d - x for d, x in zip(deltas, sent, strict=True)]
            pseudo.append(sent)
        averages = [
            torch.stack([p[i] for p in pseudo]).sum(0) / len(pseudo)
            for i in range(len(global_params))
        ]
        if isinstance(outer, CoordinatorSGD):
            outer.step(averages)
        else:
            outer.zero_grad()
            for g, average in zip(global_params, averages, strict=True):
                g.grad = average
            outer.step()
        if run.answer == "fp32":
            public = [p.detach().clone() for p in global_params]
        else:
            changes = [g.detach() - h for g, h in zip(global_params, public, strict=True)]
            added = per_job(changes, shards, run.answer, chunk_bytes, shard_count)
            public = [h + a for h, a in zip(public, added, strict=True)]
        with torch.no_grad():
            for s in live:
                for p, g in zip(sites[s].parameters(), public, strict=True):
                    p.copy_(g)
        history.append([p.clone() for p in public])
    return history


def _state_of(model: nn.Module, params: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: p.clone() for (name, _), p in zip(model.named_parameters(), params, strict=True)}


def _inner_step(
    model: nn.Module, optimizer: torch.optim.Optimizer, run: Run, site: int, size: int, step: int
) -> None:
    """One inner step of a site: the mean of its ranks' gradients, then the optimizer."""
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
    wire; they differ by the local progress since each fragment's last merge).

    `split`: how many parameters each fragment holds, in order. Fragment i's round
    starts after the inner steps t with t mod H = i*H/F (every site's ranks at
    once), one outer step of its own optimizer on the sites' mean pseudo-gradient,
    merged `overlap_steps` later (p = mixing * global + (1 - mixing) * p), or at once.
    """
    mixing = run.mixing if run.mixing is not None else (1.0 if run.overlap_steps == 0 else 0.5)
    sites = [make_model(0, run.hidden) for _ in sizes]
    for site in sites:
        site.load_state_dict(initial.state_dict())
    optimizers = [inner_optimizer(run, site) for site in sites]
    local = [list(site.parameters()) for site in sites]
    bounds = [sum(split[:i]) for i in range(len(split) + 1)]
    fragments = []
    for i in range(len(split)):
        params = [
            p.detach().clone().requires_grad_(True) for p in local[0][bounds[i] : bounds[i + 1]]
        ]
        outer = torch.optim.SGD(
            params, lr=run.outer_lr, momentum=run.outer_momentum, nesterov=run.outer_momentum > 0
        )
        fragments.append((params, outer))
    apply_at: dict[int, int] = {}

    def merge(index: int, share: float) -> None:
        params, _ = fragments[index]
        with torch.no_grad():
            for replica in local:
                for p, g in zip(replica[bounds[index] : bounds[index + 1]], params, strict=True):
                    if share == 1.0:
                        p.copy_(g)
                    else:
                        p.mul_(1.0 - share).add_(g, alpha=share)
        apply_at.pop(index, None)

    def outer_step(index: int) -> None:
        params, outer = fragments[index]
        outer.zero_grad()
        for position, g in enumerate(params):
            deltas = [g.detach() - replica[bounds[index] + position].detach() for replica in local]
            g.grad = torch.stack(deltas).sum(0) / len(sizes)
        outer.step()

    count, every = len(split), run.sync_every
    for t in range(1, run.rounds * every + 1):
        for s, (site, optimizer) in enumerate(zip(sites, optimizers, strict=True)):
            _inner_step(site, optimizer, run, s, sizes[s], t - 1)
        for index in range(count):
            if apply_at.get(index) == t:
                merge(index, mixing)
            if t % every != index * every // count:
                continue
            outer_step(index)
            if run.overlap_steps == 0:
                merge(index, 1.0)
            else:
                apply_at[index] = t + run.overlap_steps
    return [[p.detach().clone() for p in replica] for replica in local]
