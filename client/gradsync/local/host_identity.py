"""Which host a worker runs on: `gradsync_proto.host`, shared with the coordinator.

Kept as the client's name for it (`DistributedDataParallel(hierarchical=...)`
documents it); the coordinator computes its own id with the same function,
to know which local leaders share its host.
"""

from __future__ import annotations

from gradsync_proto.host import ENV_HOST_ID, MAX_HOST_ID_CHARS, host_id

__all__ = ["ENV_HOST_ID", "MAX_HOST_ID_CHARS", "host_id"]
