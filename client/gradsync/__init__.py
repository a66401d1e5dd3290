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


def __getattr__(name: str) -> Any:
    # torch is imported lazily so that the coordinator, which shares this
    # package, starts without loading it.
    if name == "DistributedDataParallel":
        from gradsync.ddp import DistributedDataParallel

        return DistributedDataParallel
    if name == "DiLoCo":
        from gradsync.diloco import DiLoCo

        return DiLoCo
    if name == "SparseWire":  # DiLoCo(wire_dtype=SparseWire(density=...))
        from gradsync.sparse_wire import SparseWire

        return SparseWire
    if name == "convert_sync_batchnorm":
        from gradsync.syncbn import convert_sync_batchnorm

        return convert_sync_batchnorm
    if name == "query_status":  # what `gradsync status` shows, as a StatusReply
        from gradsync.status import query_status

        return query_status
    if name == "collectives":
        import gradsync.collectives

        return gradsync.collectives
    if name == "hooks":  # comm hooks: fp16_compress_hook, bf16_compress_hook, ...
        import gradsync.hooks

        return gradsync.hooks
    raise AttributeError(f"module 'gradsync' has no attribute {name!r}")


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
