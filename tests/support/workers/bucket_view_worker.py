"""One rank of the gradient_as_bucket_view parity test: torch DDP or gradsync, same loops.

Every case trains with `gradient_as_bucket_view=True` under the chosen
wrapper and records, after every step's synchronized backward, each
parameter's `.grad` (or that it is None) and how many distinct storages the
defined gradients live in (1 per dtype when they are views into one bucket),
then the final state dict. The test compares the two modes' files.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from support import zoo

STEPS = 4


class Branches(nn.Module):
    """A trunk, a head, a branch some ranks use in some steps, and one no rank ever uses."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.trunk = nn.Linear(10, 16)
        self.head = nn.Linear(16, 4)
        self.sometimes = nn.Linear(16, 4)
        self.never = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.trunk(x))
        y: torch.Tensor = self.head(h)
        if bool(x[0, 0] > 0):  # depends on the rank's data
            y = y + self.sometimes(h)
        return y


@dataclass
class Case:
    """A loop: model, optimizer, zero_grad style, micro-batches, comm hook, stray grads."""

    build: Callable[[int], nn.Module]
    adam: bool = False
    #: step -> zero_grad(set_to_none=...) before that step.
    set_to_none: Callable[[int], bool] = lambda step: True
    micro_batches: int = 1
    fp16_hook: bool = False
    #: Before step 1, give `never.weight` a rank-dependent .grad (user code does it):
    #: with bucket views DDP averages it though no rank used the parameter.
    stray_grad: bool = False
    options: dict[str, Any] = field(default_factory=dict)


def _mlp(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(10, 16), nn.Tanh(), nn.Linear(16, 4))


UNUSED = {"find_unused_parameters": True}
CASES: dict[str, Case] = {
    "set_to_none": Case(_mlp),
    "zero_in_place": Case(_mlp, set_to_none=lambda step: False),
    "unused_adam": Case(
        Branches, adam=True, set_to_none=lambda step: step % 2 == 0, options=UNUSED
    ),
    "stray_grad": Case(Branches, set_to_none=lambda step: False, stray_grad=True, options=UNUSED),
    "no_sync": Case(_mlp, micro_batches=3, set_to_none=lambda step: step % 2 == 0),
    "fp16_hook": Case(_mlp, fp16_hook=True),
}


def wrap(name: str, case: Case, model: nn.Module, args: argparse.Namespace) -> Any:
    if args.mode == "ddp":
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        wrapped = nn.parallel.DistributedDataParallel(
            model, gradient_as_bucket_view=True, **case.options
        )
        if case.fp16_hook:
            wrapped.register_comm_hook(None, default_hooks.fp16_compress_hook)
        return wrapped
    import gradsync

    ours = gradsync.DistributedDataParallel(
        model,
        gradient_as_bucket_view=True,
        coordinator=args.coordinator,
        rank=args.rank,
        world_size=args.world_size,
        job_id=f"bucket-view-{name}",
        timeout_s=60,
        join_timeout_s=60,
        # The fp16 hook as the wrapper registers it (a local group, which ranks on one
        # host form by default, would refuse a hook registered after joining).
        wire_dtype=torch.float16 if case.fp16_hook else None,
        **case.options,
    )
    return ours


def record(saved: dict[str, np.ndarray], prefix: str, model: nn.Module) -> None:
    storages = set()
    for key, param in model.named_parameters():
        grad = param.grad
        saved[f"{prefix}/grad_is_none/{key}"] = np.array(grad is None)
        if grad is not None:
            saved[f"{prefix}/grad/{key}"] = grad.detach().float().numpy().copy()
            storages.add(grad.untyped_storage().data_ptr())
    saved[f"{prefix}/storages"] = np.array(len(storages))


def train(name: str, case: Case, args: argparse.Namespace, saved: dict[str, np.ndarray]) -> None:
    model = case.build(args.rank)
    wrapped = wrap(name, case, model, args)
    optimizer = (
        torch.optim.Adam(model.parameters(), lr=1e-2)
        if case.adam
        else torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    )
    for step in range(STEPS):
        optimizer.zero_grad(set_to_none=case.set_to_none(step))
        if case.stray_grad and step == 1:
            never = model.get_parameter("never.weight")
            never.grad = torch.full_like(never, float(args.rank + 1))
        for micro in range(case.micro_batches):
            last = micro == case.micro_batches - 1
            x, y = zoo._regression_batch(10, 4)(args.rank, step, micro)
            with contextlib.nullcontext() if last else wrapped.no_sync():
                nn.functional.mse_loss(wrapped(x), y).backward()  # type: ignore[no-untyped-call]
        record(saved, f"{name}/step{step}", model)
        optimizer.step()
    for key, tensor in model.state_dict().items():
        saved[f"{name}/final/{key}"] = tensor.detach().float().numpy().copy()
    close = getattr(wrapped, "close", None)
    if close is not None:
        close()


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=["ddp", "gradsync"], required=True)
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--coordinator", help="gradsync: host:port; ddp: a tcp:// init method")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    # As zoo_worker: torch's deprecation notices about its own internals are not ours.
    warnings.filterwarnings("ignore", category=DeprecationWarning, module=r"torch(\.|$)")
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch(\.|$)")
    torch.set_num_threads(1)
    if args.mode == "ddp":
        dist.init_process_group(
            "gloo", init_method=args.coordinator, rank=args.rank, world_size=args.world_size
        )
    saved: dict[str, np.ndarray] = {}
    for name, case in CASES.items():
        train(name, case, args, saved)
    np.savez(args.out, **saved)  # type: ignore[arg-type]  # numpy's stub types **kwds oddly
    if args.mode == "ddp":
        dist.barrier()
        dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
