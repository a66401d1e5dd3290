"""One rank of the FSDP2 step-time benchmark: `fully_shard` of a small transformer.

The model is the one the backend's client tests train (two `TransformerEncoderLayer`s,
d = 32, 4 heads, feed-forward 64, no dropout, then a `Linear(32, 1)`), each encoder
layer and the whole model `fully_shard`-ed on a 1-D DeviceMesh of every rank, trained
with Adam on a per-rank batch of `--batch` sequences of 5 tokens. A step is FSDP2's
all-gathers (forward and backward) and reduce-scatters of every shard group, so its
time is what the process group's collectives cost.

`--backend` picks the default group's backend: "gloo", or "gradsync" (the c10d
backend of `gradsync.distributed`, on the coordinator at $GRADSYNC_COORDINATOR).
Every rank runs `--warmup` steps, meets the others at a barrier, then times `--steps`
steps and writes {"backend", "rank", "steps", "seconds", "cpu_s"} to `--out`-<rank>.json
(cpu_s: its process's CPU time over the timed steps, all threads). Launched by
`gradsync_bench.fsdp` with RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT set.
"""

from __future__ import annotations

import argparse
import json
import os
import time
import warnings
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from gradsync_bench.procs import exit_now

BACKENDS = ("gloo", "gradsync")
SEQ = 5
D_MODEL = 32


def transformer() -> nn.Sequential:
    """Two encoder layers, d = 32, no dropout: every rank builds the same one."""
    torch.manual_seed(0)
    layers = [
        nn.TransformerEncoderLayer(
            D_MODEL, nhead=4, dim_feedforward=64, dropout=0.0, batch_first=True
        )
        for _ in range(2)
    ]
    return nn.Sequential(*layers, nn.Linear(D_MODEL, 1))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--backend", choices=BACKENDS, required=True)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")  # FSDP2's and torch's notices are not the benchmark's
    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if args.backend == "gradsync":
        import gradsync.distributed  # noqa: F401  (registers the backend)
    dist.init_process_group(args.backend, timeout=timedelta(seconds=120))

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    model = transformer()
    for layer in (model[0], model[1]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    generator = torch.Generator().manual_seed(1000 + rank)
    x = torch.randn(args.batch, SEQ, D_MODEL, generator=generator)
    y = torch.randn(args.batch, SEQ, 1, generator=generator)

    def step() -> None:
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()  # type: ignore[no-untyped-call]  # untyped in torch's stubs
        optimizer.step()

    for _ in range(args.warmup):
        step()
    dist.barrier()  # every rank starts its clock together
    started, cpu_started = time.perf_counter(), time.process_time()
    for _ in range(args.steps):
        step()
    seconds = time.perf_counter() - started
    cpu_s = time.process_time() - cpu_started
    dist.barrier()  # the ranks leave together (gloo aborts a rank whose peer left)
    dist.destroy_process_group()
    record = {
        "backend": args.backend,
        "rank": rank,
        "steps": args.steps,
        "seconds": seconds,
        "cpu_s": cpu_s,
    }
    args.out.with_name(f"{args.out.name}-{rank}.json").write_text(json.dumps(record))


if __name__ == "__main__":
    main()
    exit_now()
