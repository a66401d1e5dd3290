"""A Ray Train backend: `DataParallelTrainer(..., backend_config=GradsyncConfig())`.

Ray Train places the workers, restarts the group after a failure and keeps the reported
metrics and checkpoints; gradsync averages the gradients. Where Ray Train's torch backend
sets up a gloo/NCCL process group, this one starts a gradsync coordinator (or uses a
running one) and gives every worker the environment `gradsync.DistributedDataParallel`
reads: `RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `LOCAL_WORLD_SIZE` (Ray Train's world and local
ranks), `GRADSYNC_COORDINATOR` and the coordinator's token. The training function wraps
its model in `gradsync.DistributedDataParallel` and reports with `ray.train.report`.
"""

from __future__ import annotations

import html
import os
import uuid
from dataclasses import dataclass, field, fields
from typing import Any

from gradsync_proto import auth
from ray.train.backend import Backend, BackendConfig

from gradsync.config import (
    ENV_COORDINATOR,
    ENV_JOB_ID,
    ENV_LOCAL_RANK,
    ENV_LOCAL_WORLD_SIZE,
    ENV_RANK,
    ENV_WORLD_SIZE,
)
from gradsync.ray.coordinator import Coordinator, start_coordinator
from gradsync.ray.workers import apply_environment


@dataclass
class GradsyncConfig(BackendConfig):
    """How the Ray Train workers reach gradsync.

    Attributes:
        coordinator: "host:port" of a running coordinator; None starts one for each
            start of the worker group (and stops it with the group).
        token: the token of that running coordinator (None: the workers' environment).
        shards: coordinator shards when one is started here (`start_coordinator`).
        coordinator_resources: the started coordinator's actors' resources.
        serve_options: more `CoordinatorConfig` fields for the started coordinator.
        env: more environment variables for every worker (e.g. GRADSYNC_HIERARCHICAL).
    """

    coordinator: str | None = None
    token: str | None = field(default=None, repr=False)
    shards: int = 1
    coordinator_resources: dict[str, float] | None = None
    serve_options: dict[str, Any] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)

    @property
    def backend_cls(self) -> type[GradsyncBackend]:
        """The backend Ray Train instantiates for this config."""
        return GradsyncBackend

    def to_dict(self) -> dict[str, Any]:
        """What Ray Train exports of this config (never the token)."""
        return {"coordinator": self.coordinator, "shards": self.shards}

    def __repr__(self) -> str:
        """Every field but the token, and no token given in serve_options or env either."""
        shown = {f.name: getattr(self, f.name) for f in fields(self) if f.repr}
        shown["serve_options"] = _hide(self.serve_options, "token")
        shown["env"] = _hide(self.env, auth.ENV_TOKEN)
        return f"{type(self).__name__}({', '.join(f'{k}={v!r}' for k, v in shown.items())})"

    def _repr_html_(self) -> str:
        """Jupyter's view: the repr. Ray's default table lists every attribute, the token too."""
        return f"<pre>{html.escape(repr(self))}</pre>"


def _hide(values: dict[str, Any], secret: str) -> dict[str, Any]:
    return {name: "<hidden>" if name == secret else value for name, value in values.items()}


def _set_ranks() -> None:
    # Ray Train's context exists from on_training_start: its ranks are torchrun's.
    from ray import train

    context = train.get_context()
    os.environ[ENV_RANK] = str(context.get_world_rank())
    os.environ[ENV_WORLD_SIZE] = str(context.get_world_size())
    os.environ[ENV_LOCAL_RANK] = str(context.get_local_rank())
    os.environ[ENV_LOCAL_WORLD_SIZE] = str(context.get_local_world_size())


class GradsyncBackend(Backend):
    """Starts (or finds) the coordinator and sets up every worker's environment."""

    def __init__(self) -> None:
        self._owned: Coordinator | None = None

    def on_start(self, worker_group: Any, backend_config: BackendConfig) -> None:
        """Before the training function: a coordinator, and where to reach it."""
        if not isinstance(backend_config, GradsyncConfig):
            raise TypeError(f"GradsyncBackend needs a GradsyncConfig, got {backend_config!r}")
        world_size = len(worker_group)
        if backend_config.coordinator is None:
            self._owned = start_coordinator(
                world_size,
                shards=backend_config.shards,
                resources=backend_config.coordinator_resources,
                name=f"train-{uuid.uuid4().hex[:12]}",
                **backend_config.serve_options,
            )
            environment = self._owned.environment()
        else:
            environment = {ENV_COORDINATOR: backend_config.coordinator}
            if backend_config.token is not None:
                environment[auth.ENV_TOKEN] = backend_config.token
        environment.update(backend_config.env)
        # One job id per start of the group: a restarted group is a new gradsync job.
        environment.setdefault(ENV_JOB_ID, f"raytrain-{uuid.uuid4().hex[:12]}")
        worker_group.execute(apply_environment, environment)

    def on_training_start(self, worker_group: Any, backend_config: BackendConfig) -> None:
        """Ray Train's ranks are known now: set torchrun's variables from them."""
        worker_group.execute(_set_ranks)

    def on_shutdown(self, worker_group: Any, backend_config: BackendConfig) -> None:
        """Stop the coordinator this backend started, if any."""
        owned, self._owned = self._owned, None
        if owned is not None:
            owned.stop(grace_s=1.0)
