"""SyncBatchNorm through the coordinator: batch statistics over every rank's batch.

`torch.nn.SyncBatchNorm` needs a torch.distributed process group; under
gradsync there is none, and torch then silently runs it as plain BatchNorm
over each rank's own batch. `convert_sync_batchnorm(model)` replaces every
BatchNorm1d/2d/3d (and torch's SyncBatchNorm) with this module's
`SyncBatchNorm`, which in training normalizes with the statistics of the
global batch, the concatenation of all ranks' batches:

- forward: each rank sums x and x² per channel and counts its elements; one
  all_reduce SUM of the packed [sum, sum of squares, count] (float64, so the
  variance E[x²] - E[x]² keeps its digits) gives the global mean and biased
  variance to normalize with; the running statistics are updated with the
  global mean and the unbiased variance, exactly as torch's SyncBatchNorm;
- backward (an autograd Function): one all_reduce SUM of the packed per-channel
  [sum dy, sum dy·(x - mean)] gives the two global terms of the input gradient;
  the weight and bias gradients stay local sums, which the wrapper then
  averages across ranks like any other gradient (as torch does).

In eval mode (or without batch statistics to compute) it is plain batch norm
with no communication. The layer reaches the coordinator through the
`gradsync.collectives.Collectives` the model wrapper attaches with `attach`.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.nn.functional as F  # torch's own convention
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.modules.lazy import LazyModuleMixin

from gradsync.collectives import Collectives

__all__ = ["SyncBatchNorm", "attach", "convert_sync_batchnorm"]

log = logging.getLogger("gradsync.client")


class SyncBatchNorm(_BatchNorm):
    """Batch normalization over the global batch of all ranks (see the module docstring).

    Takes the arguments of `torch.nn.BatchNorm2d` and accepts input of any
    rank >= 2 (N, C, ...), like `torch.nn.SyncBatchNorm`.

    Attributes:
        collectives: set by `attach` (the model wrapper does it); training
            without it raises, rather than silently normalizing per rank.
    """

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
        device: Any = None,
        dtype: Any = None,
    ) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats, device, dtype)
        self.collectives: Collectives | None = None

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    def __getstate__(self) -> dict[str, Any]:
        # A copy or pickle of the model must not drag the live connection along.
        state = self.__dict__.copy()
        state["collectives"] = None
        return state

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        """Normalize `input` (N, C, ...) with the global batch's statistics in training."""
        self._check_input_dim(input)
        factor = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            # momentum=None: a cumulative moving average, as torch's batch norm.
            factor = (
                1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
            )
        bn_training = self.training or (self.running_mean is None and self.running_var is None)
        keep_stats = not self.training or self.track_running_stats
        running_mean = self.running_mean if keep_stats else None
        running_var = self.running_var if keep_stats else None
        if not (bn_training and self.training):
            return F.batch_norm(
                input,
                running_mean,
                running_var,
                self.weight,
                self.bias,
                bn_training,
                factor,
                self.eps,
            )
        if self.collectives is None:
            raise RuntimeError(
                "gradsync SyncBatchNorm is training but not attached to a job: wrap the model "
                "in gradsync.DistributedDataParallel (which attaches it), or call "
                "gradsync.syncbn.attach(model, collectives)"
            )
        output: torch.Tensor = _SyncBatchNormFunction.apply(  # type: ignore[no-untyped-call]  # torch leaves Function.apply untyped
            input,
            self.weight,
            self.bias,
            running_mean,
            running_var,
            self.eps,
            factor,
            self.collectives,
        )
        return output


def _stat_shape(x: torch.Tensor) -> list[int]:
    """Shape that broadcasts a per-channel vector over (N, C, ...)."""
    return [1, -1] + [1] * (x.dim() - 2)


def _reduce_dims(x: torch.Tensor) -> list[int]:
    return [0, *range(2, x.dim())]


class _SyncBatchNormFunction(torch.autograd.Function):
    """Forward and backward of batch norm over the global batch; one all_reduce each."""

    @staticmethod
    def forward(
        ctx: Any,
        input: torch.Tensor,
        weight: torch.Tensor | None,
        bias: torch.Tensor | None,
        running_mean: torch.Tensor | None,
        running_var: torch.Tensor | None,
        eps: float,
        factor: float,
        collectives: Collectives,
    ) -> torch.Tensor:
        dims, shape = _reduce_dims(input), _stat_shape(input)
        x = input.detach().to(torch.float64)
        local_count = float(input.numel() // input.size(1)) if input.numel() else 0.0
        packed = torch.cat(
            [
                x.sum(dims),
                (x * x).sum(dims),
                torch.tensor([local_count], dtype=torch.float64),
            ]
        )
        collectives.all_reduce(packed, "sum")
        channels = input.size(1)
        total, total_sq, count = packed[:channels], packed[channels:-1], float(packed[-1])
        if count <= 1:
            raise ValueError(
                "Expected more than 1 value per channel when training, got "
                f"{count:g} across all ranks for input size {list(input.shape)}"
            )
        mean = total / count
        var = (total_sq / count - mean * mean).clamp_min(0.0)
        invstd = torch.rsqrt(var + eps)
        if running_mean is not None and running_var is not None:
            with torch.no_grad():
                unbiased = var * (count / (count - 1))
                running_mean.mul_(1 - factor).add_(mean.to(running_mean.dtype), alpha=factor)
                running_var.mul_(1 - factor).add_(unbiased.to(running_var.dtype), alpha=factor)
        out = (x - mean.view(shape)) * invstd.view(shape)
        if weight is not None:
            out = out * weight.detach().to(torch.float64).view(shape)
        if bias is not None:
            out = out + bias.detach().to(torch.float64).view(shape)
        ctx.save_for_backward(input, weight, mean, invstd)
        ctx.count = count
        ctx.collectives = collectives
        return out.to(input.dtype)

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        input, weight, mean, invstd = ctx.saved_tensors
        collectives: Collectives = ctx.collectives
        dims, shape = _reduce_dims(input), _stat_shape(input)
        dy = grad_output.to(torch.float64)
        xmu = input.to(torch.float64) - mean.view(shape)
        sum_dy = dy.sum(dims)
        sum_dy_xmu = (dy * xmu).sum(dims)
        grad_weight = (sum_dy_xmu * invstd).to(weight.dtype) if ctx.needs_input_grad[1] else None
        grad_bias = sum_dy.to(weight.dtype) if ctx.needs_input_grad[2] else None
        grad_input = None
        if ctx.needs_input_grad[0]:
            # Every rank runs the same graph, so either all ranks reach this
            # collective or none does.
            packed = torch.cat([sum_dy, sum_dy_xmu])
            collectives.all_reduce(packed, "sum")
            channels = input.size(1)
            mean_dy = (packed[:channels] / ctx.count).view(shape)
            mean_dy_xmu = (packed[channels:] / ctx.count).view(shape)
            scale = invstd.view(shape)
            if weight is not None:
                scale = scale * weight.detach().to(torch.float64).view(shape)
            grad = (dy - mean_dy - xmu * invstd.view(shape).pow(2) * mean_dy_xmu) * scale
            grad_input = grad.to(input.dtype)
        return grad_input, grad_weight, grad_bias, None, None, None, None, None


def convert_sync_batchnorm(module: nn.Module) -> nn.Module:
    """Replace every BatchNorm1d/2d/3d and torch SyncBatchNorm in `module` with gradsync's.

    Parameters and running statistics are carried over (the very same
    tensors, so an optimizer built before converting still works), as is
    train/eval mode. Call it before wrapping the model, as with torch's
    `SyncBatchNorm.convert_sync_batchnorm`::

        model = gradsync.DistributedDataParallel(gradsync.convert_sync_batchnorm(net), ...)

    Returns:
        `module` itself with its batch norms replaced, or the replacement when
        `module` is itself a batch norm.

    Raises:
        ValueError: a lazy batch norm whose size is not known yet (run one
            forward pass first).
    """
    converted = module
    if isinstance(module, _BatchNorm) and not isinstance(module, SyncBatchNorm):
        if isinstance(module, LazyModuleMixin) and module.has_uninitialized_params():
            raise ValueError(
                f"{type(module).__name__} is not initialized yet: run one forward pass "
                "before convert_sync_batchnorm"
            )
        replacement = SyncBatchNorm(
            module.num_features,
            module.eps,
            module.momentum,
            module.affine,
            module.track_running_stats,
        )
        if module.affine:
            with torch.no_grad():
                replacement.weight = module.weight
                replacement.bias = module.bias
        replacement.running_mean = module.running_mean
        replacement.running_var = module.running_var
        replacement.num_batches_tracked = module.num_batches_tracked
        replacement.train(module.training)
        if hasattr(module, "qconfig"):
            replacement.qconfig = module.qconfig
        converted = replacement
    for name, child in module.named_children():
        converted.add_module(name, convert_sync_batchnorm(child))
    return converted


def attach(module: nn.Module, collectives: Collectives | None) -> int:
    """Give every gradsync SyncBatchNorm in `module` the collectives it reduces through.

    The model wrapper calls it at construction (and with None at close). It
    also warns about torch's own SyncBatchNorm, which without a process group
    would silently normalize each rank's batch alone.

    Returns:
        How many SyncBatchNorm layers were attached.
    """
    attached = 0
    for name, child in module.named_modules():
        if isinstance(child, SyncBatchNorm):
            child.collectives = collectives
            attached += 1
        elif isinstance(child, nn.SyncBatchNorm) and collectives is not None:
            log.warning(
                "'%s' is torch.nn.SyncBatchNorm, which without a torch.distributed process "
                "group normalizes each rank's batch alone; convert the model with "
                "gradsync.convert_sync_batchnorm(model) before wrapping it",
                name,
            )
    return attached
