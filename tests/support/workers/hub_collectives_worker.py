"""One rank of a hub-collectives test job: the per-rank ops through `Collectives`.

It wraps a tiny model in `gradsync.DistributedDataParallel` and runs, on
rank-dependent tensors, reduce_scatter (sum; bfloat16 avg; int64 product), the
product all_reduce, gather to rank 1, scatter from the last rank and an
all_to_all with unequal splits, then saves what it received to --out (.npz) for
the test to check against numpy. With --mismatch, the last rank gathers to
another root than the others (after the others sent theirs): every rank saves
the error it got and exits 3.
"""

from __future__ import annotations

import logging
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import gradsync
import numpy as np
import torch
from support import scenarios
from torch import nn

#: Rows rank s sends rank r in the all_to_all (as many rows as ranks, here up to 3).
ROWS = [[1, 0, 3], [2, 5, 0], [0, 2, 4]]


def values(rank: int, count: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return (torch.arange(count, dtype=torch.float64) % 7 + 1 + rank).to(dtype)


def main() -> int:
    parser = scenarios.worker_parser(__doc__)
    parser.add_argument("--mismatch", action="store_true")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(message)s")
    rank, world = args.rank, args.world_size
    out: dict[str, np.ndarray] = {}
    try:
        model = gradsync.DistributedDataParallel(
            nn.Linear(2, 2),
            coordinator=args.coordinator,
            rank=rank,
            world_size=world,
            timeout_s=30.0,
            reconnect_timeout_s=0,
        )
        with model:
            group = model.collectives
            if args.mismatch:
                group.barrier()
                if rank == world - 1:
                    time.sleep(1.0)  # the others' inputs are in first: they wait in it
                group.gather(values(rank, 4), dst=0 if rank < world - 1 else 1)
                return 0
            part = torch.empty(5)
            group.reduce_scatter(part, values(rank, 5 * world), "sum")
            out["reduce_scatter_sum"] = part.numpy()
            half = torch.empty(3, dtype=torch.bfloat16)
            group.reduce_scatter(half, values(rank, 3 * world, torch.bfloat16) / 3, "avg")
            out["reduce_scatter_avg_bf16"] = half.float().numpy()
            ints = torch.empty(2, dtype=torch.int64)
            group.reduce_scatter(ints, values(rank, 2 * world, torch.int64), "product")
            out["reduce_scatter_product"] = ints.numpy()
            out["all_reduce_product"] = group.all_reduce(values(rank, 4), "product").numpy()
            gathered = group.gather(values(rank, 3), dst=1)
            out["gather_is_none"] = np.array(gathered is None)
            if gathered is not None:
                out["gather"] = torch.stack(gathered).numpy()
            source = world - 1
            parts = [values(10 * r, 4) for r in range(world)] if rank == source else None
            out["scatter"] = group.scatter(torch.empty(4), parts, source).numpy()
            send = [ROWS[rank][r] for r in range(world)]
            receive = [ROWS[s][rank] for s in range(world)]
            data = torch.cat([torch.full((n, 2), 100.0 * rank + r) for r, n in enumerate(send)])
            output = torch.empty(sum(receive), 2)
            group.all_to_all(output, data, receive, send)
            out["all_to_all"] = output.numpy()
    except gradsync.GradSyncError as exc:
        logging.getLogger("worker").error("rank %d failed: %s", rank, exc)
        np.savez(args.out, error=np.array(str(exc)))
        return 3
    np.savez(args.out, **out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
