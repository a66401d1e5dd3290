"""One rank of the healing benchmark (`gradsync_bench.heal`): train, die, or join and be healed.

Every rank trains the same MLP with Adam under an elastic coordinator, so the
state a joiner needs is the parameters plus Adam's two moments (about three
times the parameter bytes). Roles:
  member  trains until the step the stop file names; records each step's
          start and end (wall clock, so that the orchestrator can line the
          ranks up) and how many ranks contributed to it.
  victim  a member that SIGKILLs itself before the forward pass of --die-at.
  joiner  a fresh process of the victim's rank: it times its construction
          (Join, the donor's state arriving, loading it) and `register_optimizer`
          (the optimizer state restored), writes the ready file, then trains on.
Every rank writes {"role", "steps": [[step, start, end, contributors]],
"state_bytes", "digest", ...} to --out; the digest (SHA-256 over parameters and
optimizer state) shows the healed rank ended bitwise equal to the others.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import signal
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from gradsync_bench.procs import exit_now, stop_step

MIB = 1 << 20
#: Parameters of the MLP per layer; the model is `layers` square layers of this many floats.
_LAYERS = 4


def build_model(state_mb: float, seed: int) -> nn.Module:
    """An MLP whose parameters and Adam state together are about `state_mb` MiB."""
    floats = state_mb * MIB / 4 / 3  # params, exp_avg, exp_avg_sq
    width = max(16, int((floats / _LAYERS) ** 0.5))
    torch.manual_seed(seed)
    return nn.Sequential(*(nn.Linear(width, width, bias=True) for _ in range(_LAYERS)))


def state_tensors(module: nn.Module, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Every tensor of the rank's live state: parameters, buffers, optimizer state."""
    tensors = list(module.state_dict().values())
    for per_param in optimizer.state_dict()["state"].values():
        tensors += [v for v in per_param.values() if isinstance(v, torch.Tensor)]
    return tensors


def digest(tensors: list[torch.Tensor]) -> str:
    """SHA-256 of the tensors' bytes, in order."""
    hasher = hashlib.sha256()
    for tensor in tensors:
        hasher.update(tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return hasher.hexdigest()


def main() -> None:
    import gradsync

    parser = argparse.ArgumentParser()
    parser.add_argument("--coordinator", required=True)
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--state-mb", type=float, required=True)
    parser.add_argument("--role", choices=["member", "victim", "joiner"], required=True)
    parser.add_argument("--die-at", type=int, default=3)
    parser.add_argument("--stop-file", type=Path, required=True)
    parser.add_argument("--ready-file", type=Path, default=None)
    parser.add_argument("--max-steps", type=int, default=500)
    parser.add_argument("--step-delay-s", type=float, default=0.05)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(created).3f %(message)s")
    torch.set_num_threads(1)
    module = build_model(args.state_mb, seed=args.rank)
    width = module[0].in_features  # type: ignore[index]
    optimizer = torch.optim.Adam(module.parameters(), lr=1e-4)
    report: dict[str, Any] = {"role": args.role, "rank": args.rank, "pid": os.getpid()}
    # Imported before the clock starts: `gradsync.ddp` imports torch._dynamo (1.4 s
    # here), which is the process starting, not the healing.
    wrapper = gradsync.DistributedDataParallel
    join_started = time.time()
    model = wrapper(
        module,
        coordinator=args.coordinator,
        rank=args.rank,
        world_size=args.world_size,
        timeout_s=120.0,
        join_timeout_s=300.0,
        hierarchical=False,  # the heal path itself, not a local group's
    )
    model.register_optimizer(optimizer)
    ready = time.time()
    report.update(join_started=join_started, ready=ready, start_step=model.step)
    if args.role == "joiner" and args.ready_file is not None:
        args.ready_file.write_text(json.dumps({"step": model.step, "ready": ready}))
    steps: list[list[float]] = []
    generator = torch.Generator().manual_seed(1234)
    with model:
        while model.step < args.max_steps:
            stop = stop_step(args.stop_file)
            if stop is not None and model.step >= stop:
                break
            step = model.step
            if args.role == "victim" and step == args.die_at:
                os.kill(os.getpid(), signal.SIGKILL)
            started = time.time()
            optimizer.zero_grad()
            # The same batch on every rank at every step (seeded by the step): only the
            # state matters here, and the digests must agree at the end.
            generator.manual_seed(step)
            x = torch.randn(4, width, generator=generator)
            loss = model(x).square().mean()
            loss.backward()
            optimizer.step()
            steps.append([step, started, time.time(), model.last_contributors])
            time.sleep(args.step_delay_s)
        tensors = state_tensors(module, optimizer)
        report.update(
            steps=steps,
            end_step=model.step,
            state_bytes=sum(t.numel() * t.element_size() for t in tensors),
            digest=digest(tensors),
        )
    args.out.write_text(json.dumps(report))


if __name__ == "__main__":
    main()
    exit_now()
