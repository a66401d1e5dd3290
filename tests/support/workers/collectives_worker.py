"""One rank of a collectives test job: collectives, SyncBatchNorm and join() on real processes.

It wraps a small model with a SyncBatchNorm in `gradsync.DistributedDataParallel`,
then (scenario "all") runs every collective on rank-dependent tensors, trains
`--steps` steps on batches of rank-dependent size, and finally trains inside
`model.join()` for 1 + rank steps (uneven inputs). Everything it observed is
saved to --out (.npz) for the test to check across ranks. On a GradSyncError
it saves {"error": message} and exits with 3. Logs go to stderr at INFO.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import gradsync
import numpy as np
import torch
from gradsync import collectives
from support import scenarios
from torch import nn


def batch(rank: int, step: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(size, 4, generator=generator), torch.randn(size, 2, generator=generator)


def main() -> int:
    parser = scenarios.worker_parser(__doc__)
    parser.add_argument("--scenario", choices=["all", "join-only"], default="all")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--join-timeout-s", type=float, default=60.0)
    parser.add_argument("--timeout-s", type=float, default=30.0)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(message)s")
    rank, world = args.rank, args.world_size
    torch.manual_seed(rank)
    net = gradsync.convert_sync_batchnorm(
        nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 2))
    )
    out: dict[str, np.ndarray] = {}
    try:
        model = gradsync.DistributedDataParallel(
            net,
            coordinator=args.coordinator,
            rank=rank,
            world_size=world,
            timeout_s=args.timeout_s,
            join_timeout_s=args.join_timeout_s,
            reconnect_timeout_s=0,
        )
        with model:
            if args.scenario == "all":
                mine = torch.tensor([rank + 1.0, -2.0 * rank, 0.5])
                out["sum"] = collectives.all_reduce(mine.clone(), "sum", group=model).numpy()
                out["avg"] = collectives.all_reduce(mine.clone(), "avg", group=model).numpy()
                ints = torch.tensor([rank, 10 - rank], dtype=torch.int64)
                out["min"] = collectives.all_reduce(ints.clone(), "min", group=model).numpy()
                out["max"] = collectives.all_reduce(ints.clone(), "max", group=model).numpy()
                big = torch.full((300_000,), float(rank))  # > 1 MiB: several chunks
                out["big"] = collectives.broadcast(big, world - 1, group=model)[:4].numpy()
                gathered = collectives.all_gather(mine, group=model)
                out["gather"] = torch.stack(gathered).numpy()
                collectives.barrier(group=model)
                optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
                for step in range(args.steps):
                    x, y = batch(rank, step, 3 + rank)
                    loss = nn.functional.mse_loss(model(x), y)
                    optimizer.zero_grad()
                    loss.backward()
                    optimizer.step()
                bn = net[1]
                out["running_mean"] = bn.running_mean.numpy().copy()
                out["running_var"] = bn.running_var.numpy().copy()
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
            with model.join():
                for step in range(1 + rank):
                    x, y = batch(rank, 100 + step, 4)
                    loss = nn.functional.mse_loss(model(x), y)
                    optimizer.zero_grad()
                    loss.backward()
                    optimizer.step()
            out["step_after_join"] = np.array(model.step)
            for name, tensor in net.state_dict().items():
                out[f"state.{name}"] = tensor.numpy().copy()
    except gradsync.GradSyncError as exc:
        logging.getLogger("worker").error("rank %d failed: %s", rank, exc)
        np.savez(args.out, error=np.array(str(exc)))
        return 3
    np.savez(args.out, **out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
