"""gradsync as a torch.distributed backend: `import gradsync.distributed` registers "gradsync".

::

    import torch.distributed as dist
    import gradsync.distributed  # registers the backend "gradsync" and gradsync://

    dist.init_process_group("gradsync", init_method="gradsync://coordinator-host:50051")
    model = torch.nn.parallel.DistributedDataParallel(model)  # stock DDP

Every c10d group is a collectives-only job on the coordinator; its
collectives never block the caller (see `gradsync.distributed.process_group`,
and docs/backend.md for each op's cost on the wire and what is refused).
"""

from __future__ import annotations

from gradsync.distributed.backend import GradsyncOptions, group_job_id, register
from gradsync.distributed.process_group import BACKEND_NAME, ProcessGroupGradsync

__all__ = ["BACKEND_NAME", "GradsyncOptions", "ProcessGroupGradsync", "group_job_id", "register"]

register()
