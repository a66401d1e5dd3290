"""One rank of one site of a DiLoCo-across-sites test; writes its model after every round.

A site is its own torch.distributed world (gloo over --site-port, as torchrun would
start it), trains the model of `support.diloco_reference` with FSDP2 (`fully_shard`),
torch DDP or a plain module inside, and is replica --site of --sites through
`gradsync.DiLoCo(replica_group=...)`. Rank k of site s trains on the batches of
"rank" 10 * s + k of `support.diloco_reference.batch`. Every rank saves the whole
model (gathered, under FSDP2) after each round, so the tests compare sites and ranks.

A restarted site (`--resume`) starts at the round its jobs let it in at (the job's
open step) and trains only the rounds left; `--joining PATH` is touched right before
it joins. `--before-round R:PATH` waits for a file before the inner step that starts
round R; `--die-at-step N` SIGKILLs the rank there.
"""

from __future__ import annotations

import argparse
import datetime
import os
import signal
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import gradsync
from support.diloco_reference import WIRES, Run, batch, inner_optimizer, make_model

#: The seed of every site's initial model is 100 + site: site 0's wins (the seed round).
SEED = 100


def site_batch_rank(site: int, site_rank: int) -> int:
    return 10 * site + site_rank


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    Run.add_arguments(parser)
    parser.add_argument("--coordinator", required=True)
    parser.add_argument("--site", type=int, required=True)
    parser.add_argument("--sites", type=int, required=True)
    parser.add_argument("--site-rank", type=int, required=True)
    parser.add_argument("--site-size", type=int, required=True)
    parser.add_argument("--site-port", type=int, required=True)
    parser.add_argument("--inside", choices=["fsdp", "ddp", "plain"], required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--job-id", default="sites")
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--joining", type=Path, default=None)
    parser.add_argument("--before-round", action="append", default=[], help="R:PATH")
    parser.add_argument("--die-at-step", type=int, default=-1)
    parser.add_argument("--timeout-s", type=float, default=60.0)
    args = parser.parse_args()
    run = Run.from_arguments(args)
    before = {int(r): p for r, _, p in (v.partition(":") for v in args.before_round)}
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{args.site_port}",
        rank=args.site_rank,
        world_size=args.site_size,
        timeout=datetime.timedelta(seconds=args.timeout_s),
    )
    group = dist.group.WORLD
    model: torch.nn.Module = make_model(SEED + args.site, run.hidden)
    names = [name for name, _ in model.named_parameters()]
    if args.inside == "fsdp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (args.site_size,))
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    elif args.inside == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(model, process_group=group)
    optimizer = inner_optimizer(run, model)
    if args.joining is not None:
        args.joining.touch()
    saved: dict[str, np.ndarray] = {}

    def save(key: str) -> None:
        for name, p in zip(names, model.parameters(), strict=True):
            full = p.full_tensor() if hasattr(p, "full_tensor") else p  # (a collective)
            saved[f"{key}/{name}"] = full.detach().numpy().copy()

    with gradsync.DiLoCo(
        model,
        optimizer,
        sync_every=run.sync_every,
        outer_lr=run.outer_lr,
        outer_momentum=run.outer_momentum,
        wire_dtype=WIRES[run.wire],
        answer_dtype=WIRES[run.answer],
        fragments=run.fragments,
        overlap_steps=run.overlap_steps,
        mixing=run.mixing,
        coordinator=args.coordinator,
        job_id=args.job_id,
        timeout_s=args.timeout_s,
        replica_group=group,
        replica=args.site,
        replicas=args.sites,
    ) as diloco:
        first = 0
        if args.resume:  # the job's open step: the rounds before it are done
            first = diloco.fragments[0].ddp.step - 1
        saved["first_round"] = np.array(first)
        saved["jobs"] = np.array(
            [f.ddp.config.job_id for f in diloco.fragments if hasattr(f, "ddp")], dtype=str
        )
        save(f"round{first}")
        for step in range(first * run.sync_every, run.rounds * run.sync_every):
            if step == args.die_at_step:
                os.kill(os.getpid(), signal.SIGKILL)
            x, y = batch(run, site_batch_rank(args.site, args.site_rank), step)
            optimizer.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            optimizer.step()
            if (step + 1) % run.sync_every == 0:
                _hold(before.get((step + 1) // run.sync_every))
            if diloco.step():
                save(f"round{(step + 1) // run.sync_every}" if run.fragments == 1 else "last")
        save("final")
        saved["inner_steps"] = np.array(diloco.inner_steps)
        saved["fragment_sizes"] = np.array([len(f.params) for f in diloco.fragments])
        saved["last_round_bytes"] = np.array(diloco.last_round_bytes)
        saved["last_round_received"] = np.array(
            sum(f.last_round_received for f in diloco.fragments)
        )
    np.savez(args.out, **saved)
    dist.destroy_process_group()
    return 0


def _hold(path: str | None) -> None:
    """Wait (bounded) until that file exists."""
    if path is None:
        return
    deadline = time.monotonic() + 60.0
    while not Path(path).exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear within 60 s")
        time.sleep(0.02)


if __name__ == "__main__":
    raise SystemExit(main())
