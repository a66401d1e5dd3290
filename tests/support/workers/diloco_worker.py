"""One rank of a DiLoCo test job; writes its parameters after every round to an .npz file.

The model and each rank's batches come from `support.diloco_reference`, which also
simulates the same run in one process for the tests to compare against.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import gradsync
from support import scenarios
from support.diloco_reference import WIRES, Run, batch, inner_optimizer, make_model


def main() -> int:
    parser = scenarios.worker_parser(__doc__)
    Run.add_arguments(parser)
    parser.add_argument("--job-id", default=None)
    parser.add_argument("--start-delay-s", type=float, default=0.0)
    parser.add_argument("--die-at-step", type=int, default=-1, help="SIGKILL itself there")
    parser.add_argument("--step-delay-s", type=float, default=0.0, help="a slower inner step")
    args = parser.parse_args()
    time.sleep(args.start_delay_s)  # a rank started by hand, later than the others
    run = Run.from_arguments(args)
    rank = args.rank
    model = make_model(100 + rank, run.hidden)  # different on every rank: construction equalises
    optimizer = inner_optimizer(run, model)
    wire = WIRES[run.wire]
    saved: dict[str, np.ndarray] = {}
    with gradsync.DiLoCo(
        model,
        optimizer,
        sync_every=run.sync_every,
        outer_lr=run.outer_lr,
        outer_momentum=run.outer_momentum,
        wire_dtype=wire,
        answer_dtype=WIRES[run.answer],
        fragments=run.fragments,
        overlap_steps=run.overlap_steps,
        mixing=run.mixing,
        coordinator=args.coordinator,
        rank=rank,
        world_size=args.world_size,
        job_id=args.job_id,
        timeout_s=60,
    ) as diloco:
        for name, p in model.named_parameters():
            saved[f"round0/{name}"] = p.detach().numpy().copy()
        for step in range(run.rounds * run.sync_every):
            if step == args.die_at_step:
                os.kill(os.getpid(), signal.SIGKILL)  # lost while computing its inner steps
            time.sleep(args.step_delay_s)
            x, y = batch(run, rank, step)
            optimizer.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            optimizer.step()
            if diloco.step():
                for name, p in model.named_parameters():
                    saved[f"round{diloco.rounds}/{name}"] = p.detach().numpy().copy()
        for name, p in model.named_parameters():
            saved[f"final/{name}"] = p.detach().numpy().copy()
        saved["fragment_sizes"] = np.array([len(f.params) for f in diloco.fragments])
        saved["inner_steps"] = np.array(diloco.inner_steps)
        saved["last_round_bytes"] = np.array(diloco.last_round_bytes)
    np.savez(args.out, **saved)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
