"""gradsync on Ray (`pip install gradsync[ray]`): the coordinator and the workers as actors.

- `start_coordinator(world_size, shards=, resources=, **serve_options)` places the
  leader and its shards as named actors; `get_coordinator(name)` finds them from any
  driver; `Coordinator.stop()` ends them.
- `run(train_fn, num_workers=N, ...)` runs an unchanged torchrun training function on
  N actors, streams `report(...)` calls back, restarts lost ranks (`max_restarts`).
- `GradsyncConfig` is a Ray Train backend: `DataParallelTrainer(train_fn,
  backend_config=GradsyncConfig(), scaling_config=ScalingConfig(num_workers=N))`.
"""

from __future__ import annotations

try:
    import ray as _ray  # noqa: F401  (only to say what to install when it is missing)
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        "gradsync.ray needs Ray: pip install 'gradsync[ray]' (or pip install 'ray[train]')"
    ) from exc

from gradsync.ray.coordinator import Coordinator, get_coordinator, start_coordinator
from gradsync.ray.train_backend import GradsyncBackend, GradsyncConfig
from gradsync.ray.workers import (
    Report,
    RunResult,
    WorkerContext,
    WorkerFailedError,
    get_context,
    report,
    run,
)

__all__ = [
    "Coordinator",
    "GradsyncBackend",
    "GradsyncConfig",
    "Report",
    "RunResult",
    "WorkerContext",
    "WorkerFailedError",
    "get_context",
    "get_coordinator",
    "report",
    "run",
    "start_coordinator",
]
