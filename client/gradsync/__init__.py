"""gradsync: data-parallel gradient synchronization for PyTorch through a gRPC coordinator.

Wrap a model like torch DDP::

    model = gradsync.DistributedDataParallel(model, coordinator="host:50051",
                                             rank=r, world_size=3)
    loss.backward()      # averaged gradients are in param.grad when this returns
    optimizer.step()

The coordinator is started with `gradsync serve --world-size 3`.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from gradsync_proto import __version__

from gradsync.errors import (
    AuthenticationError,
    CheckpointFailedError,
    CheckpointMismatchError,
    ClosedError,
    CoordinatorRestartedError,
    CoordinatorUnavailableError,
    DeclaredDeadError,
    GradSyncError,
    JoinRefusedError,
    MessageRejectedError,
    NonFiniteGradientError,
    PeerLostError,
    ResourceExhaustedError,
    ShardUnavailableError,
    SharedMemoryError,
    StepAbortedError,
    SyncTimeoutError,
    TransportSecurityError,
)

if TYPE_CHECKING:
    from gradsync import collectives, hooks
    from gradsync.ddp import DistributedDataParallel
    from gradsync.diloco import DiLoCo
    from gradsync.sparse_wire import SparseWire
    from gradsync.status import query_status
    from gradsync.syncbn import convert_sync_batchnorm


#: Names loaded on first use: torch is imported lazily so that the coordinator, which
#: shares this package, starts without loading it. Name -> (module, its attribute, or
#: None for the module itself).
_LAZY: dict[str, tuple[str, str | None]] = {
    "DistributedDataParallel": ("gradsync.ddp", "DistributedDataParallel"),
    "DiLoCo": ("gradsync.diloco", "DiLoCo"),
    "SparseWire": ("gradsync.sparse_wire", "SparseWire"),  # DiLoCo(wire_dtype=SparseWire(...))
    "convert_sync_batchnorm": ("gradsync.syncbn", "convert_sync_batchnorm"),
    "query_status": ("gradsync.status", "query_status"),  # what `gradsync status` shows
    "collectives": ("gradsync.collectives", None),
    "hooks": ("gradsync.hooks", None),  # comm hooks: fp16_compress_hook, bf16_compress_hook, ...
}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'gradsync' has no attribute {name!r}")
    module_name, attribute = _LAZY[name]
    module = importlib.import_module(module_name)
    return module if attribute is None else getattr(module, attribute)


__all__ = [
    "AuthenticationError",
    "CheckpointFailedError",
    "CheckpointMismatchError",
    "ClosedError",
    "CoordinatorRestartedError",
    "CoordinatorUnavailableError",
    "DeclaredDeadError",
    "DiLoCo",
    "DistributedDataParallel",
    "GradSyncError",
    "JoinRefusedError",
    "MessageRejectedError",
    "NonFiniteGradientError",
    "PeerLostError",
    "ResourceExhaustedError",
    "ShardUnavailableError",
    "SharedMemoryError",
    "SparseWire",
    "StepAbortedError",
    "SyncTimeoutError",
    "TransportSecurityError",
    "__version__",
    "collectives",
    "convert_sync_batchnorm",
    "hooks",
    "query_status",
]
