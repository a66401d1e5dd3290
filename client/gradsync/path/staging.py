"""One bucket of one step: where its bytes are uploaded from, and how averages reach `.grad`.

torch DDP's rules for a parameter's gradient, which this module reproduces:

- used on this rank (its gradient hook fired since the last synchronized
  step, `no_sync` passes included): it contributes its gradient and gets the
  average;
- not used here but used on another rank: it contributes its existing
  `.grad` if it has one (accumulated under `no_sync`), else zeros, and gets
  the average (a `.grad` is created for it if it had none);
- used on no rank: its `.grad` is left exactly as it was (None stays None, so
  the optimizer skips the parameter, as with DDP).

Whether another rank used a parameter is only known once the step's
"presence" bucket is averaged (see `gradsync.ddp`), so nothing may be written
to a parameter that is not used here before then: its zeros are uploaded
from a scratch tensor and its existing gradient from a copy, and both are
written back afterwards only if some rank used it. A used parameter's CPU
gradient is uploaded in place (averages land straight in `.grad`).

Gradients that are not contiguous CPU tensors (CUDA) are staged through host
memory, pinned when CUDA is available so the device copies are fast, and
copied back after averaging. With a communication hook the bucket is
flattened into one host tensor (the hook sees and may rewrite it) and
scattered back afterwards.

With `gradient_as_bucket_view=True` (CPU modules) the buckets are instead
flat tensors that `.grad` are views of: see `gradsync.path.bucket_views`, whose
stage has the same interface (`Stage`).
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import numpy.typing as npt
import torch
from torch import nn


class Stage(Protocol):
    """One bucket of one step, as the reducer drives it (`BucketStage`, `BucketViewStage`)."""

    #: The bucket's parameter names, in order (for comm hooks).
    names: list[str]
    #: The bucket as one flat host tensor (what a comm hook sees), or None when the
    #: bucket is uploaded from separate tensors.
    flat: torch.Tensor | None

    def segments(self) -> list[npt.NDArray[np.uint8]]:
        """The bucket's bytes as uploaded; averages are written back into them."""
        ...

    def finish(self, used_anywhere: Sequence[bool]) -> None:
        """Leave the averages in `.grad` by DDP's rules, once the presence bucket is in."""
        ...


class _WriteBack(enum.Enum):
    """What happens to a parameter's `.grad` once the average is in `source`."""

    NONE = "none"  # `source` is `.grad` itself: the average is already there
    COPY = "copy"  # copy `source` into `.grad` (staged or flattened)
    COPY_IF_USED = "copy_if_used"  # as COPY, but only if some rank used it
    CREATE_IF_USED = "create_if_used"  # `.grad` was None: create it if some rank used it


@dataclass
class _Slot:
    parameter_index: int
    param: nn.Parameter
    source: torch.Tensor  # 1-D contiguous host tensor that is uploaded and averaged into
    write_back: _WriteBack


class BucketStage:
    """One bucket of one step, from hand-off to `.grad`.

    Args:
        parameters: (index into named_parameters, name, parameter) of the bucket, in order.
        used_here: whether each parameter (by index) was used on this rank since the last sync.
        dtype: the bucket's dtype.
        flatten: gather the bucket into one flat host tensor (for a comm hook).

    Raises:
        ValueError: a gradient is sparse, naming the parameter.
    """

    def __init__(
        self,
        parameters: Sequence[tuple[int, str, nn.Parameter]],
        used_here: Sequence[bool],
        dtype: torch.dtype,
        flatten: bool,
    ) -> None:
        self.names = [name for _, name, _ in parameters]
        self.flat: torch.Tensor | None = None
        if flatten:
            total = sum(param.numel() for _, _, param in parameters)
            self.flat = torch.empty(total, dtype=dtype)
        self._slots: list[_Slot] = []
        offset = 0
        for index, name, param in parameters:
            numel = param.numel()
            view = None if self.flat is None else self.flat[offset : offset + numel]
            offset += numel
            self._slots.append(self._stage(index, name, param, used_here[index], view))

    def _stage(
        self,
        index: int,
        name: str,
        param: nn.Parameter,
        used_here: bool,
        view: torch.Tensor | None,
    ) -> _Slot:
        grad = param.grad
        if grad is None:
            source = torch.zeros(param.numel(), dtype=param.dtype) if view is None else view.zero_()
            return _Slot(index, param, source, _WriteBack.CREATE_IF_USED)
        if grad.is_sparse:
            raise ValueError(
                f"'{name}' has a sparse gradient; gradsync averages dense gradients only"
            )
        grad = grad.detach()
        in_place = grad.device.type == "cpu" and grad.is_contiguous()
        if view is None and in_place and used_here:
            return _Slot(index, param, grad.reshape(-1), _WriteBack.NONE)
        if view is None:  # a CUDA gradient's is page-locked (fast device copies)
            pinned = grad.device.type == "cuda"
            view = torch.empty(grad.numel(), dtype=grad.dtype, pin_memory=pinned)
        view.copy_(grad.reshape(-1) if grad.is_contiguous() else grad.contiguous().reshape(-1))
        return _Slot(index, param, view, _WriteBack.COPY if used_here else _WriteBack.COPY_IF_USED)

    def segments(self) -> list[npt.NDArray[np.uint8]]:
        """The bucket's bytes, as the link uploads them (averages are written back into them)."""
        if self.flat is not None:
            return [self.flat.view(torch.uint8).numpy()]
        return [slot.source.view(torch.uint8).numpy() for slot in self._slots]

    def finish(self, used_anywhere: Sequence[bool]) -> None:
        """Move the averages into `.grad`, by DDP's rules (see the module docstring).

        Args:
            used_anywhere: by parameter index, whether any rank used it this step.
        """
        with torch.no_grad():
            for slot in self._slots:
                used = used_anywhere[slot.parameter_index]
                param = slot.param
                if slot.write_back is _WriteBack.NONE:
                    continue
                if slot.write_back is _WriteBack.CREATE_IF_USED:
                    if used:
                        grad = torch.empty_like(param)
                        grad.copy_(slot.source.view(param.shape))
                        param.grad = grad
                    continue
                if slot.write_back is _WriteBack.COPY_IF_USED and not used:
                    continue
                target = param.grad
                if target is None:  # set to None by user code during backward: recreate it
                    target = param.grad = torch.empty_like(param)
                target.copy_(
                    slot.source.view(target.shape), non_blocking=target.device.type == "cuda"
                )
