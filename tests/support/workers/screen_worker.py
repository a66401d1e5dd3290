"""One rank of a screened DDP job: train a few steps, save what it ends with (.npz).

Trains `support.scenarios.MixedModel` (a float32 and a float64 bucket) with
`gradsync.DistributedDataParallel(screen=...)`, flat. With `--scale-from S`
this rank multiplies its loss by 100 from step S on, so every gradient it
uploads is x100. Saves the final parameters (`final/<name>`) and every warning
the client logged, per step (`warnings/step<N>`).
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import gradsync
from support import scenarios


def main() -> int:
    parser = scenarios.worker_parser(__doc__)
    parser.add_argument("--screen", default="report")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--scale-from", type=int, default=-1)
    args = parser.parse_args()
    warned = scenarios.Warnings()
    logging.getLogger("gradsync.client").addHandler(warned)
    module = scenarios.MixedModel(seed=0)
    model = gradsync.DistributedDataParallel(
        module,
        coordinator=args.coordinator,
        rank=args.rank,
        world_size=args.world_size,
        bucket_cap_mb=0.01,
        first_bucket_mb=0.002,
        timeout_s=60,
        join_timeout_s=60,
        hierarchical=False,
        screen=args.screen,
    )
    saved: dict[str, np.ndarray] = {}
    with model:
        optimizer = scenarios.make_optimizer(model)
        for step in range(args.steps):
            optimizer.zero_grad()
            x, y = scenarios.rank_batch(step, args.world_size, args.rank)
            loss = scenarios.loss_fn(model(x), y)
            if 0 <= args.scale_from <= step:
                loss = loss * 100
            loss.backward()
            optimizer.step()
            saved[f"warnings/step{step}"] = np.array("\n".join(warned.lines))
            warned.lines.clear()
    for name, p in module.named_parameters():
        saved[f"final/{name}"] = p.detach().numpy().copy()
    np.savez(args.out, **saved)
    return 0


if __name__ == "__main__":
    sys.exit(main())
