"""gradsync: data-parallel gradient synchronization for PyTorch through a gRPC coordinator.

Wrap a model like torch DDP::

    model = gradsync.DistributedDataParallel(model, coordinator="host:50051",
                                             rank=r, world_size=3)
    loss.backward()      # averaged gradients are in param.grad when this returns
    optimizer.step()

The coordinator is started with `gradsync serve --world-size 3`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

from gradsync.errors import (
    CheckpointFailedError,
    ClosedError,
    CoordinatorRestartedError,
    CoordinatorUnavailableError,
    DeclaredDeadError,
    GradSyncError,
    JoinRefusedError,
    MessageRejectedError,
    PeerLostError,
    ResourceExhaustedError,
    StepAbortedError,
    SyncTimeoutError,
)

if TYPE_CHECKING:
    from gradsync.ddp import DistributedDataParallel


def __getattr__(name: str) -> Any:
    # torch is imported lazily so that the coordinator, which shares this
    # package, starts without loading it.
    if name == "DistributedDataParallel":
        from gradsync.ddp import DistributedDataParallel

        return DistributedDataParallel
    raise AttributeError(f"module 'gradsync' has no attribute {name!r}")


__all__ = [
    "CheckpointFailedError",
    "ClosedError",
    "CoordinatorRestartedError",
    "CoordinatorUnavailableError",
    "DeclaredDeadError",
    "DistributedDataParallel",
    "GradSyncError",
    "JoinRefusedError",
    "MessageRejectedError",
    "PeerLostError",
    "ResourceExhaustedError",
    "StepAbortedError",
    "SyncTimeoutError",
    "__version__",
]
