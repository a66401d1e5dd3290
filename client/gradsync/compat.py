"""torch DDP's constructor arguments and device rules, for a one-line migration.

`gradsync.DistributedDataParallel` accepts every keyword argument of
`torch.nn.parallel.DistributedDataParallel`, so that replacing the class name
is the whole migration. Those with a meaning here are honoured by the wrapper
(`bucket_cap_mb`, `broadcast_buffers`, `init_sync=True`, `device_ids` /
`output_device` for a single-GPU module, `gradient_as_bucket_view`); those
that are accepted because gradsync always behaves that way
(`find_unused_parameters`, `static_graph`, `check_reduction`: unused
parameters are always handled, without a graph traversal) are silent; the
rest do not apply to a coordinator-based synchronizer and draw one warning
that lists them all. Keeping that table here keeps the wrapper's
constructor readable.

The device rules say which modules the client can serve: parameters and
buffers all on one device, the CPU or an available CUDA device (gradients
are staged through host memory). Anything else (the "meta" device, a CUDA
tensor without CUDA, a module spread over devices) is refused before joining,
naming the tensor and the devices.

`untraced` keeps torch.compile out of the wrapper's network I/O without paying
for `torch._dynamo`'s import (about 2 s of CPU per worker process) when nothing
is compiled.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import torch
from torch._compile import _disable_dynamo

_Fn = TypeVar("_Fn", bound=Callable[..., Any])

#: The DDP arguments gradsync cannot honour, with the value that means "not used".
_IGNORED_UNLESS: dict[str, Any] = {
    "dim": 0,
    "process_group": None,
    "delay_all_reduce_named_params": None,
    "param_to_hook_all_reduce": None,
    "mixed_precision": None,
    "device_mesh": None,
    "skip_all_reduce_unused_params": False,
    "init_sync": True,
}


def ignored_arguments(arguments: Mapping[str, Any]) -> list[str]:
    """The DDP arguments given with a value gradsync cannot honour (warned about once).

    Args:
        arguments: DDP-only keyword arguments as passed (None = not passed).
    """
    return [
        name
        for name, unused in _IGNORED_UNLESS.items()
        if name in arguments and arguments[name] != unused
    ]


def warn_ignored(names: Sequence[str]) -> None:
    """One warning naming every DDP argument that has no effect here."""
    if names:
        warnings.warn(
            "gradsync.DistributedDataParallel ignores these torch DDP arguments, which do not "
            f"apply to a coordinator-based synchronizer: {', '.join(names)} (see its docstring)",
            UserWarning,
            stacklevel=3,
        )


def module_device(
    named_tensors: Sequence[tuple[str, torch.Tensor]], cuda_available: bool | None = None
) -> torch.device:
    """The one device of a module's parameters and buffers.

    Raises:
        ValueError: a tensor on a device the client cannot serve, or tensors on
            several devices, naming the tensor and the devices.
    """
    cuda = torch.cuda.is_available() if cuda_available is None else cuda_available
    device: torch.device | None = None
    first_name = ""
    for name, tensor in named_tensors:
        kind = tensor.device.type
        if kind not in ("cpu", "cuda"):
            raise ValueError(
                f"'{name}' is on device '{tensor.device}', which gradsync cannot serve: "
                "move the module to the CPU or a CUDA device before wrapping it"
            )
        if kind == "cuda" and not cuda:
            raise ValueError(f"'{name}' is on '{tensor.device}' but CUDA is not available here")
        if device is None:
            device, first_name = tensor.device, name
        elif tensor.device != device:
            raise ValueError(
                f"'{name}' is on '{tensor.device}' but '{first_name}' is on '{device}': "
                "gradsync serves modules on a single device"
            )
    return device if device is not None else torch.device("cpu")


def input_device(
    device_ids: Sequence[int | torch.device] | None, module_on: torch.device
) -> torch.device | None:
    """Where forward moves its tensor inputs (DDP's `device_ids=[i]`), or None for nowhere.

    Raises:
        ValueError: device_ids with more than one device, or for a CPU module (as DDP).
    """
    if not device_ids:
        return None
    if len(device_ids) != 1:
        raise ValueError(f"device_ids must hold a single device, got {list(device_ids)}")
    if module_on.type != "cuda":
        raise ValueError(
            f"device_ids={list(device_ids)} only applies to a CUDA module; this module is on "
            f"'{module_on}' (pass device_ids=None, as torch DDP requires for CPU modules)"
        )
    (only,) = device_ids
    return torch.device("cuda", only) if isinstance(only, int) else torch.device(only)


def to_device(value: Any, device: torch.device) -> Any:
    """`value` with every tensor inside (tuples, lists, dicts) moved to `device`."""
    if isinstance(value, torch.Tensor):
        return value.to(device, non_blocking=True)
    if isinstance(value, tuple):
        return (
            type(value)(*(to_device(v, device) for v in value))
            if hasattr(value, "_fields")
            else tuple(to_device(v, device) for v in value)
        )
    if isinstance(value, list):
        return [to_device(v, device) for v in value]
    if isinstance(value, dict):
        return {k: to_device(v, device) for k, v in value.items()}
    return value


def untraced(fn: _Fn) -> _Fn:
    """`fn`, never traced by torch.compile, with torch._dynamo imported only when compiling.

    `@torch.compiler.disable` imports torch._dynamo where it decorates: about 2 s
    of CPU in every worker process at import, for the many jobs that never
    compile (16 ranks on one host spent half a minute of CPU on it). Outside a
    trace `fn` is called directly; inside one (`is_compiling()` is a constant
    True to dynamo, which is imported by then), the call goes through torch's
    lazily disabled wrapper, which dynamo runs eagerly, as a graph break.
    """
    lazily_disabled = _disable_dynamo(fn)

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling():
            return lazily_disabled(*args, **kwargs)
        return fn(*args, **kwargs)

    return call  # type: ignore[return-value]
