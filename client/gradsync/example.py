"""The example training job behind `gradsync worker` and `gradsync demo`.

A small MLP learns scikit-learn's bundled handwritten digits (8x8 images, no
download). Every rank walks the same shuffled order of global batches and
trains on its own slice of each, so the distributed run is mathematically the
same as one process training on whole global batches — which is exactly what
`train_reference` does, to check the result.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from gradsync import defaults

log = logging.getLogger("gradsync.example")

#: Size of scikit-learn's digits data set, and the share `load_digits` trains on.
DIGITS_SAMPLES = 1797
TRAIN_FRACTION = 0.8
#: The loss of every run, distributed and reference alike.
_CROSS_ENTROPY = nn.CrossEntropyLoss()


@dataclass(frozen=True)
class TrainSettings:
    """Hyper-parameters shared by every rank and by the reference run."""

    world_size: int
    epochs: int = 5
    batch_size: int = 32  # per rank
    lr: float = 0.5
    data_seed: int = 0
    #: 0: synchronize every step (DistributedDataParallel); H > 0: gradsync.DiLoCo every H.
    sync_every: int = 0
    outer_lr: float = 0.7
    outer_momentum: float = 0.9


@dataclass(frozen=True)
class Digits:
    """Train / test tensors of the digits data set."""

    train_x: torch.Tensor
    train_y: torch.Tensor
    test_x: torch.Tensor
    test_y: torch.Tensor


def load_digits(data_seed: int = 0) -> Digits:
    """Load the digits, scale pixels to [0, 1], hold out 20 % for testing."""
    from sklearn.datasets import load_digits as sklearn_digits

    images, labels = sklearn_digits(return_X_y=True)
    order = np.random.default_rng(data_seed).permutation(len(labels))
    x = torch.tensor(images[order] / 16.0, dtype=torch.float32)
    y = torch.tensor(labels[order], dtype=torch.int64)
    cut = int(TRAIN_FRACTION * len(y))
    return Digits(x[:cut], y[:cut], x[cut:], y[cut:])


def train_samples() -> int:
    """Training samples of the digits split, known without loading scikit-learn.

    The CLI checks with it that a global batch fits the data set at all.
    """
    return int(TRAIN_FRACTION * DIGITS_SAMPLES)


def build_model(seed: int) -> nn.Module:
    """The MLP; `seed` picks its initial weights."""
    generator_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
    torch.random.set_rng_state(generator_state)
    return model


def global_batches(num_samples: int, settings: TrainSettings) -> list[torch.Tensor]:
    """Index tensors of every global batch, identical on all ranks (drop last)."""
    global_batch = settings.batch_size * settings.world_size
    generator = torch.Generator().manual_seed(settings.data_seed + 1)
    batches = []
    for _ in range(settings.epochs):
        order = torch.randperm(num_samples, generator=generator)
        for start in range(0, num_samples - global_batch + 1, global_batch):
            batches.append(order[start : start + global_batch])
    return batches


def accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    """Fraction of `x` classified correctly."""
    with torch.no_grad():
        return float((model(x).argmax(dim=1) == y).float().mean())


def train_worker(
    coordinator: str,
    rank: int,
    settings: TrainSettings,
    *,
    init_seed: int,
    job_id: str | None = None,
    timeout_s: float = defaults.EXAMPLE_TIMEOUT_S,
    progress: bool = False,
    save_path: Path | None = None,
    token: str | None = None,
    on_step: Callable[[int, float], None] | None = None,
    **options: Any,
) -> float:
    """Train one rank of the example job; return the final test accuracy.

    `token` and `options` (`metrics_port`, `trace_path`, `log_every_steps`,
    `metrics_host`, `tls_*`) go to `DistributedDataParallel` as they are (left out:
    its defaults, from the environment). `on_step(step, loss)` is called after
    every optimizer step (`gradsync demo --ray` reports progress with it).
    """
    import gradsync

    data = load_digits(settings.data_seed)
    joining: dict[str, Any] = dict(
        coordinator=coordinator,
        rank=rank,
        world_size=settings.world_size,
        job_id=job_id,
        timeout_s=timeout_s,
        join_timeout_s=timeout_s,
        token=token,
    )
    if settings.sync_every:
        return _train_diloco(rank, settings, data, init_seed, save_path, on_step, joining)
    model = gradsync.DistributedDataParallel(build_model(init_seed), **joining, **options)
    optimizer = torch.optim.SGD(model.parameters(), lr=settings.lr)
    model.register_optimizer(optimizer)  # checkpoints carry its state
    batches = global_batches(len(data.train_y), settings)
    # A job resumed from a checkpoint starts at model.step, on the same batch order.
    steps = _progress(batches[model.step :], enabled=progress)
    with model:
        for indices in steps:
            loss = _sgd_step(model, optimizer, data, _slice(indices, rank, settings.batch_size))
            if on_step is not None:
                on_step(model.step, loss)
            if progress and hasattr(steps, "set_postfix"):
                steps.set_postfix(loss=f"{loss:.3f}")
    return _evaluate(model.module, data, save_path)


def _train_diloco(
    rank: int,
    settings: TrainSettings,
    data: Digits,
    init_seed: int,
    save_path: Path | None,
    on_step: Callable[[int, float], None] | None,
    joining: dict[str, Any],
) -> float:
    """One rank of the example job under `gradsync.DiLoCo`: its own slice, a round every H.

    `joining`: `train_worker`'s arguments of the job (coordinator, rank, timeouts, ...).
    """
    import gradsync

    model = build_model(init_seed)
    optimizer = torch.optim.SGD(model.parameters(), lr=settings.lr)
    with gradsync.DiLoCo(
        model,
        optimizer,
        sync_every=settings.sync_every,
        outer_lr=settings.outer_lr,
        outer_momentum=settings.outer_momentum,
        **joining,
    ) as diloco:
        for indices in global_batches(len(data.train_y), settings):
            loss = _sgd_step(model, optimizer, data, _slice(indices, rank, settings.batch_size))
            diloco.step()
            if on_step is not None:
                on_step(diloco.inner_steps, loss)
        if diloco.inner_steps % settings.sync_every:
            diloco.sync()  # the last, shorter round: every rank ends on the global model
    return _evaluate(model, data, save_path)


def train_reference(settings: TrainSettings, init_seed: int) -> tuple[nn.Module, float]:
    """Single-process training on whole global batches: what the workers must equal.

    Under DiLoCo (`sync_every`), W replicas each train on their slice and an outer
    SGD with Nesterov momentum applies their mean pseudo-gradient every H steps.
    """
    if settings.sync_every:
        return _reference_diloco(settings, init_seed)
    data = load_digits(settings.data_seed)
    model = build_model(init_seed)
    optimizer = torch.optim.SGD(model.parameters(), lr=settings.lr)
    for indices in global_batches(len(data.train_y), settings):
        # The mean over the global batch equals the mean of the ranks' means,
        # because every rank's slice has the same size.
        _sgd_step(model, optimizer, data, indices)
    return model, accuracy(model, data.test_x, data.test_y)


def _reference_diloco(settings: TrainSettings, init_seed: int) -> tuple[nn.Module, float]:
    data = load_digits(settings.data_seed)
    world, size, every = settings.world_size, settings.batch_size, settings.sync_every
    global_model = build_model(init_seed)
    replicas = [build_model(init_seed) for _ in range(world)]
    inner = [torch.optim.SGD(r.parameters(), lr=settings.lr) for r in replicas]
    outer = torch.optim.SGD(
        global_model.parameters(),
        lr=settings.outer_lr,
        momentum=settings.outer_momentum,
        nesterov=settings.outer_momentum > 0,
    )
    batches = global_batches(len(data.train_y), settings)
    for step, indices in enumerate(batches, start=1):
        for rank, (replica, optimizer) in enumerate(zip(replicas, inner, strict=True)):
            _sgd_step(replica, optimizer, data, _slice(indices, rank, size))
        if step % every and step != len(batches):
            continue
        outer.zero_grad()
        for index, g in enumerate(global_model.parameters()):
            locals_ = [list(r.parameters())[index].detach() for r in replicas]
            g.grad = torch.stack([g.detach() - p for p in locals_]).sum(0) / world
        outer.step()
        with torch.no_grad():
            for replica in replicas:
                for p, g in zip(replica.parameters(), global_model.parameters(), strict=True):
                    p.copy_(g)
    return global_model, accuracy(global_model, data.test_x, data.test_y)


def _slice(indices: torch.Tensor, rank: int, batch_size: int) -> torch.Tensor:
    """The samples of `rank` in a global batch: the rank-th slice of `batch_size`."""
    return indices[rank * batch_size : (rank + 1) * batch_size]


def _sgd_step(
    model: nn.Module, optimizer: torch.optim.Optimizer, data: Digits, indices: torch.Tensor
) -> float:
    """One optimizer step on the training samples `indices`; the loss before it."""
    optimizer.zero_grad(set_to_none=True)
    loss = _CROSS_ENTROPY(model(data.train_x[indices]), data.train_y[indices])
    loss.backward()
    optimizer.step()
    return float(loss.item())


def _evaluate(model: nn.Module, data: Digits, save_path: Path | None) -> float:
    """The test accuracy of a trained rank's `model`, saved with it when asked."""
    test_accuracy = accuracy(model, data.test_x, data.test_y)
    if save_path is not None:
        save_parameters(model, save_path, test_accuracy)
    return test_accuracy


def save_parameters(model: nn.Module, path: Path, test_accuracy: float) -> None:
    """Write parameters (and the accuracy) to an .npz file."""
    arrays = {name: p.detach().cpu().numpy() for name, p in model.named_parameters()}
    arrays["__accuracy__"] = np.array(test_accuracy)
    np.savez(path, **arrays)  # type: ignore[arg-type]


def max_relative_difference(model: nn.Module, saved: dict[str, np.ndarray]) -> float:
    """Largest ||a - b|| / ||b|| over parameters (b from the reference `model`)."""
    worst = 0.0
    for name, param in model.named_parameters():
        reference = param.detach().cpu().numpy().astype(np.float64)
        got = saved[name].astype(np.float64)
        worst = max(worst, float(np.linalg.norm(got - reference) / np.linalg.norm(reference)))
    return worst


def _progress(batches: list[torch.Tensor], enabled: bool) -> list[torch.Tensor]:
    if not enabled:
        return batches
    try:
        from tqdm import tqdm
    except ImportError:
        return batches
    bar: list[torch.Tensor] = tqdm(batches, desc="rank 0 training", unit="step", file=sys.stderr)
    return bar
