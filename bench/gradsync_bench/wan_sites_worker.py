"""One rank of the sites row of the slow-link scorecard (`gradsync_bench.wan_sites`).

Two sites of two ranks each train the char transformer of `gradsync_bench.wan_task`
with FSDP2 inside the site (gloo; both ranks of a site share one emulated host, so the
site's own traffic stays on that host). Methods:

  nosync        each site trains on its own, no traffic between sites: the reference.
  hsdp-gloo     one gloo world of the four ranks, stock FSDP2 with a 2-D mesh
                (replicate across the sites, shard inside them): every step's gradient
                all-reduce crosses the slow link.
  diloco-hH-... gradsync.DiLoCo(replica_group=site) with sync_every=H: one job per shard
                index through the coordinator (fp32, or an int8 wire with int8 answers).

The timed window starts after a file barrier of all four ranks and one untimed
forward/backward; the rank writes one JSON record (seconds, its host's eth0 bytes over the
window, the client's upload count, losses).
"""

from __future__ import annotations

import argparse
import datetime
import json
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from gradsync_bench import wan_task
from gradsync_bench.procs import exit_now, link_bytes
from gradsync_bench.wan_worker import barrier

#: Every method, by name: (kind, H, int8 wire and answer).
METHODS: dict[str, tuple[str, int, bool]] = {
    "nosync": ("nosync", 1, False),
    "hsdp-gloo": ("hsdp", 1, False),
    "diloco-h10-fp32": ("diloco", 10, False),
    "diloco-h10-int8x2": ("diloco", 10, True),
}
SITES, PER_SITE = 2, 2


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--method", choices=sorted(METHODS), required=True)
    parser.add_argument("--site", type=int, required=True)
    parser.add_argument("--site-rank", type=int, required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--coordinator", default="")
    parser.add_argument("--gloo", required=True, help="host:port of this method's rendezvous")
    parser.add_argument("--workdir", type=Path, required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    kind, sync_every, int8 = METHODS[args.method]
    rank = args.site * PER_SITE + args.site_rank  # the data's rank, of SITES * PER_SITE
    timeout = datetime.timedelta(seconds=900)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    if kind == "hsdp":
        dist.init_process_group(
            "gloo", init_method=f"tcp://{args.gloo}", rank=rank,
            world_size=SITES * PER_SITE, timeout=timeout,
        )  # fmt: skip
        mesh = init_device_mesh("cpu", (SITES, PER_SITE), mesh_dim_names=("replicate", "shard"))
    else:
        dist.init_process_group(
            "gloo", init_method=f"tcp://{args.gloo}", rank=args.site_rank,
            world_size=PER_SITE, timeout=timeout,
        )  # fmt: skip
        mesh = init_device_mesh("cpu", (PER_SITE,))
    corpus = wan_task.read_corpus()
    text, _ = wan_task.split(corpus, rank, SITES * PER_SITE)
    model = wan_task.build_model(args.context)
    parameter_bytes = wan_task.parameter_bytes(model)
    for layer in model.blocks.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    inner = torch.optim.AdamW(model.parameters(), lr=1e-3)
    diloco: Any = None
    if kind == "diloco":
        import gradsync

        diloco = gradsync.DiLoCo(
            model, inner, sync_every=sync_every, outer_lr=0.7, outer_momentum=0.9,
            wire_dtype=torch.int8 if int8 else None, answer_dtype=torch.int8 if int8 else None,
            coordinator=args.coordinator, job_id=f"sites-{args.method}", timeout_s=900,
            join_timeout_s=300, replica_group=dist.group.WORLD, replica=args.site,
            replicas=SITES,
        )  # fmt: skip
    batches = wan_task.Batches(text, args.batch, args.context, rank)
    inner.zero_grad()
    inputs, targets = batches.next()
    torch.autograd.backward(wan_task.loss_of(model, inputs, targets))
    inner.zero_grad()
    batches = wan_task.Batches(text, args.batch, args.context, rank)

    barrier(args.workdir, f"{args.method}-start", rank, SITES * PER_SITE)
    link_before = link_bytes("eth0")
    sent_before = _client_sent(diloco)
    losses: list[float] = []
    started = time.perf_counter()
    for _ in range(args.steps):
        inner.zero_grad()
        inputs, targets = batches.next()
        loss = wan_task.loss_of(model, inputs, targets)
        torch.autograd.backward(loss)
        inner.step()
        if diloco is not None:
            diloco.step()
        losses.append(float(loss.detach()))
    seconds = time.perf_counter() - started
    link_after = link_bytes("eth0")
    record = {
        "method": args.method,
        "site": args.site,
        "site_rank": args.site_rank,
        "steps": args.steps,
        "batch": args.batch,
        "seconds": seconds,
        "link_tx": link_after["tx"] - link_before["tx"],
        "link_rx": link_after["rx"] - link_before["rx"],
        "client_bytes_sent": _client_sent(diloco) - sent_before if diloco is not None else None,
        "losses": losses,
        "parameter_bytes": parameter_bytes,
    }
    (args.workdir / f"{args.method}-rank{rank}.json").write_text(json.dumps(record))
    if diloco is not None:
        diloco.close()
    dist.barrier()
    dist.destroy_process_group()


def _client_sent(diloco: Any) -> int:
    if diloco is None:
        return 0
    return sum(int(f.ddp.bytes_sent) for f in diloco.fragments)


if __name__ == "__main__":
    main()
    exit_now()
