"""Models, data and single-process references shared by the worker scripts and the tests.

The worker processes (tests/support/workers/*.py) and the tests that check
them import the same definitions, so "the same model on the same data" is
true by construction.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

import torch
from torch import nn

IN_FEATURES = 24
OUT_FEATURES = 5
BATCH_PER_RANK = 8
LR = 0.05
MOMENTUM = 0.9


def worker_parser(description: str | None) -> argparse.ArgumentParser:
    """The flags every worker script takes, as `support.processes.launch_ranks` passes them."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--coordinator", required=True)
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--out", type=Path, required=True)
    return parser


class Warnings(logging.Handler):
    """Every warning logged where it is attached (a worker keeps the client's, to report
    what it was told)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


class MixedModel(nn.Module):
    """Small model with float32 and float64 parameters and a buffer.

    The float64 `scale` forces a second dtype bucket; `extra` is used only
    when asked, to exercise parameters without gradients.
    """

    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.hidden = nn.Linear(IN_FEATURES, 64)
        self.middle = nn.Linear(64, 64)
        self.out = nn.Linear(64, OUT_FEATURES)
        self.scale = nn.Parameter(torch.ones(OUT_FEATURES, dtype=torch.float64))
        self.extra = nn.Linear(64, OUT_FEATURES)
        self.register_buffer("calls", torch.tensor(seed, dtype=torch.int64))

    def forward(self, x: torch.Tensor, use_extra: bool = False) -> torch.Tensor:
        h = torch.relu(self.middle(torch.relu(self.hidden(x))))
        y = self.out(h) * self.scale.to(torch.float32)
        if use_extra:
            y = y + self.extra(h)
        return y


def global_batch(step: int, world_size: int, micro: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole batch of `step` (micro-batch `micro`): every rank's slice together."""
    generator = torch.Generator().manual_seed(10_000 + 97 * step + micro)
    size = BATCH_PER_RANK * world_size
    x = torch.randn(size, IN_FEATURES, generator=generator)
    y = torch.randn(size, OUT_FEATURES, generator=generator)
    return x, y


def rank_batch(
    step: int, world_size: int, rank: int, micro: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank `rank`'s slice of the global batch."""
    x, y = global_batch(step, world_size, micro)
    rows = slice(rank * BATCH_PER_RANK, (rank + 1) * BATCH_PER_RANK)
    return x[rows], y[rows]


def loss_fn(prediction: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean squared error: the mean of equal-size slices' means is the global mean."""
    return ((prediction - target) ** 2).mean()


def make_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    """SGD with momentum: exercises state that must evolve identically everywhere."""
    return torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)


def reference_training(world_size: int, steps: int, init_seed: int = 0) -> MixedModel:
    """One process, whole global batches: what every distributed rank must end with."""
    model = MixedModel(init_seed)
    optimizer = make_optimizer(model)
    for step in range(steps):
        optimizer.zero_grad()
        x, y = global_batch(step, world_size)
        loss_fn(model(x), y).backward()
        optimizer.step()
    return model


def reference_accumulated_gradients(world_size: int, micro_batches: int) -> dict[str, torch.Tensor]:
    """Gradients of `micro_batches` accumulated global batches (the no_sync target)."""
    model = MixedModel(0)
    for micro in range(micro_batches):
        x, y = global_batch(0, world_size, micro)
        loss_fn(model(x), y).backward()
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
