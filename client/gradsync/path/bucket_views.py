"""`gradient_as_bucket_view=True`: every `.grad` is a view into its bucket's flat tensor.

As with torch DDP's option of the same name, each gradient bucket owns one
flat host tensor (the bucket's dtype, its parameters in the reducer's bucket
order) and each trainable parameter's `.grad` is a view into it. The bucket
is uploaded from that tensor in place, as one segment, and the averages land
in it: nothing is gathered before the upload or scattered after it, and a
comm hook's `GradBucket.buffer` is the flat tensor itself (no flattening
copy). The gradients and the buckets share their memory, as in DDP.

What happens to `.grad`, measured against torch DDP (gloo,
`find_unused_parameters=True`, torch 2.13), which differs here from the
default mode (`gradsync.path.staging`):

- a parameter with a `.grad` (used here or not, used anywhere or not) ends
  the step with `.grad` = its view, holding the average over the ranks of
  their `.grad`. A fresh gradient (after `zero_grad(set_to_none=True)`, or
  one user code assigned) is copied into the view and `.grad` re-pointed at
  it, when its bucket is launched; one that already is the view is not
  copied (autograd accumulates into it in place);
- a parameter with no `.grad` (None) contributes zeros; it gets `.grad` =
  its view (the average) if some rank used it this step, and keeps None if
  no rank did, so the optimizer skips it, as with DDP.

So, as DDP does and unlike the default mode, a parameter no rank used but
that has a `.grad` gets the average of the ranks' `.grad` (the same values
when every rank holds the same gradient, as after a synchronized step).
Under `no_sync()` nothing is copied or re-pointed: a fresh gradient stays a
separate tensor until the next synchronized pass, as DDP's.

The flat tensors come from `allocate`, the one place that decides where
bucket memory lives (host memory today; a shared-memory segment could back
it). Views are host memory, so CUDA modules keep the staging path
(`gradsync.ddp` passes the option only for CPU modules).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import numpy.typing as npt
import torch
from torch import nn

from gradsync.path.bucketing import BucketPlan

#: Where a bucket's flat tensor comes from: (num_bytes, dtype) -> 1-D tensor.
Allocator = Callable[[int, torch.dtype], torch.Tensor]


def allocate(num_bytes: int, dtype: torch.dtype) -> torch.Tensor:
    """A flat, contiguous host tensor of `num_bytes` bytes of `dtype`, zeroed.

    Every bucket's storage comes from here, so that it can later come from a
    shared segment instead without touching the views' bookkeeping.

    Raises:
        ValueError: `num_bytes` is not a whole number of `dtype` elements.
    """
    itemsize = torch.empty(0, dtype=dtype).element_size()
    if num_bytes < 0 or num_bytes % itemsize:
        raise ValueError(f"{num_bytes} bytes is not a whole number of {dtype} elements")
    return torch.zeros(num_bytes // itemsize, dtype=dtype)


def is_view_of(grad: torch.Tensor, view: torch.Tensor) -> bool:
    """Whether `grad` is exactly `view` (same memory, shape and strides), not just overlapping."""
    return (
        grad.data_ptr() == view.data_ptr()
        and grad.shape == view.shape
        and grad.stride() == view.stride()
        and grad.dtype == view.dtype
        and grad.device == view.device
    )


class BucketViews:
    """The flat tensor of every bucket and each parameter's view into it.

    As DDP's `initialize_bucket_views`, a parameter that already has a
    `.grad` when the views are made has it copied into its view and
    `.grad` re-pointed at it.

    Args:
        named_parameters: the module's parameters, in signature order.
        buckets: the gradient buckets (indices into `named_parameters`).
        allocator: where each bucket's flat tensor comes from (`allocate`).

    Raises:
        ValueError: a bucket's byte count disagrees with its parameters'.
    """

    def __init__(
        self,
        named_parameters: Sequence[tuple[str, nn.Parameter]],
        buckets: Sequence[BucketPlan],
        allocator: Allocator = allocate,
    ) -> None:
        self.flats: list[torch.Tensor] = []
        #: By parameter index: its view, shaped as the parameter.
        self.views: dict[int, torch.Tensor] = {}
        for bucket_index, plan in enumerate(buckets):
            dtype: torch.dtype = plan.dtype  # type: ignore[assignment]  # keyed by torch dtype
            params = [named_parameters[i][1] for i in plan.parameter_indices]
            num_bytes = sum(p.numel() * p.element_size() for p in params)
            if num_bytes != plan.num_bytes:
                raise ValueError(
                    f"bucket {bucket_index} holds {num_bytes} bytes of parameters, "
                    f"its plan says {plan.num_bytes}"
                )
            flat = allocator(num_bytes, dtype)
            self.flats.append(flat)
            offset = 0
            for index, param in zip(plan.parameter_indices, params, strict=True):
                view = flat[offset : offset + param.numel()].view(param.shape)
                offset += param.numel()
                self.views[index] = view
                if param.grad is not None:
                    adopt(param, param.grad, view)


def adopt(param: nn.Parameter, grad: torch.Tensor, view: torch.Tensor) -> None:
    """Make `param.grad` (now `grad`) its bucket view, copying `grad` in if it lives elsewhere."""
    if is_view_of(grad, view):
        return
    with torch.no_grad():
        view.copy_(grad.detach())
    param.grad = view


class BucketViewStage:
    """One bucket of one step in bucket-view mode (the `staging.Stage` protocol).

    Launching moves every defined gradient into its view (`adopt`) and zeroes
    the views of parameters without one, so the flat tensor is the bucket as
    uploaded; `finish` only gives `.grad` back to parameters that had none and
    that some rank used (see the module docstring).

    Args:
        parameters: (index into named_parameters, name, parameter) of the bucket, in order.
        flat: the bucket's flat tensor.
        views: by parameter index, its view into `flat`.

    Raises:
        ValueError: a gradient is sparse, naming the parameter.
    """

    def __init__(
        self,
        parameters: Sequence[tuple[int, str, nn.Parameter]],
        flat: torch.Tensor,
        views: dict[int, torch.Tensor],
    ) -> None:
        self.names = [name for _, name, _ in parameters]
        self.flat: torch.Tensor | None = flat
        self._flat = flat
        self._adopted: list[tuple[nn.Parameter, torch.Tensor]] = []
        self._without_grad: list[tuple[int, nn.Parameter, torch.Tensor]] = []
        for index, name, param in parameters:
            view = views[index]
            grad = param.grad
            if grad is None:
                with torch.no_grad():
                    view.zero_()
                self._without_grad.append((index, param, view))
                continue
            if grad.is_sparse:
                raise ValueError(
                    f"'{name}' has a sparse gradient; gradsync averages dense gradients only"
                )
            adopt(param, grad, view)
            self._adopted.append((param, view))

    def segments(self) -> list[npt.NDArray[np.uint8]]:
        """The bucket's bytes: the flat tensor, one segment (averages land in it)."""
        return [self._flat.view(torch.uint8).numpy()]

    def finish(self, used_anywhere: Sequence[bool]) -> None:
        """Point `.grad` at the averages by DDP's rules (see the module docstring).

        Args:
            used_anywhere: by parameter index, whether any rank used it this step.
        """
        for param, view in self._adopted:
            if param.grad is None or not is_view_of(param.grad, view):
                param.grad = view  # user code replaced it during backward: the average wins
        for index, param, view in self._without_grad:
            if used_anywhere[index]:
                param.grad = view
