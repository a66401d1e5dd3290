"""One rank of an end-to-end test job; writes what it ends with to an .npz file.

Scenarios:
  parity   train K steps; save the parameters right after construction and at the end.
  no_sync  accumulate M micro-batches (M - 1 under no_sync); save the gradients.
  unused   rank 0 uses the `extra` layer, other ranks do not; save the gradients.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import gradsync
from support import scenarios


def main() -> int:
    parser = scenarios.worker_parser(__doc__)
    parser.add_argument("--scenario", choices=["parity", "no_sync", "unused"], required=True)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--micro-batches", type=int, default=3)
    parser.add_argument("--bucket-cap-mb", type=float, default=0.01)
    parser.add_argument("--first-bucket-mb", type=float, default=0.002)
    parser.add_argument("--job-id", default=None)
    args = parser.parse_args()
    rank, world = args.rank, args.world_size

    # Every rank starts from different weights; construction must equalise them.
    module = scenarios.MixedModel(seed=rank)
    model = gradsync.DistributedDataParallel(
        module,
        coordinator=args.coordinator,
        rank=rank,
        world_size=world,
        job_id=args.job_id,
        bucket_cap_mb=args.bucket_cap_mb,
        first_bucket_mb=args.first_bucket_mb,
        timeout_s=60,
        join_timeout_s=60,
    )
    saved: dict[str, np.ndarray] = {
        f"initial/{name}": p.detach().numpy().copy() for name, p in module.named_parameters()
    }
    saved["initial/calls"] = module.calls.numpy().copy()
    saved["num_buckets"] = np.array(len(model.bucket_plans))
    with model:
        if args.scenario == "parity":
            optimizer = scenarios.make_optimizer(model)
            for step in range(args.steps):
                optimizer.zero_grad()
                x, y = scenarios.rank_batch(step, world, rank)
                scenarios.loss_fn(model(x), y).backward()
                optimizer.step()
            for name, p in module.named_parameters():
                saved[f"final/{name}"] = p.detach().numpy().copy()
        elif args.scenario == "no_sync":
            for micro in range(args.micro_batches - 1):
                with model.no_sync():
                    x, y = scenarios.rank_batch(0, world, rank, micro)
                    scenarios.loss_fn(model(x), y).backward()
            x, y = scenarios.rank_batch(0, world, rank, args.micro_batches - 1)
            scenarios.loss_fn(model(x), y).backward()
            for name, p in module.named_parameters():
                if p.grad is not None:
                    saved[f"grad/{name}"] = p.grad.numpy().copy()
            saved["step"] = np.array(model.step)
        else:  # unused
            x, y = scenarios.rank_batch(0, world, rank)
            scenarios.loss_fn(model(x, use_extra=rank == 0), y).backward()
            for name, p in module.named_parameters():
                saved[f"grad/{name}"] = (
                    p.grad.numpy().copy() if p.grad is not None else np.array([])
                )
            saved["contributors"] = np.array(model.last_contributors)
    np.savez(args.out, **saved)
    return 0


if __name__ == "__main__":
    sys.exit(main())
