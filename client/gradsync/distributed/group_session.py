"""One c10d group's session with the coordinator: a collectives-only job.

Each group c10d creates (the default group, every `new_group`, every
DeviceMesh dimension) is a job of its own on the coordinator, joined by the
group's ranks with their rank in the group and the group's size. The Join
carries an empty `ModelSignature`: no parameters, buffers or buckets, which
the coordinator takes as a collectives-only session. It assembles the job,
runs heartbeats and liveness on it (a lost rank is named within the heartbeat
timeout), lists it in `gradsync status`, and runs its collectives; there is no
state broadcast and no step. The session is one `Transport` (the same Sync
stream, pipe and security as the model wrapper's) and a `Collectives` over it.
A coordinator that restarts on the same address takes the group back: the
session rejoins the same job with the same rank and sends the collectives in
flight again (`gradsync.distributed.reconnect`). On a sharded coordinator the
Welcome lists the shards; the transport opens a data stream to each, and the
group's bulk ops are spread over them (`gradsync.distributed.shard_routes`).
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable
from typing import cast

from gradsync_proto.net.channels import ChannelSecurity
from gradsync_proto.v1 import gradsync_pb2 as pb

from gradsync import __version__, defaults
from gradsync.collectives import Collectives
from gradsync.control.link import CoordinatorLink, SessionLink
from gradsync.control.transport import Transport
from gradsync.distributed.reconnect import ResumingLink
from gradsync.distributed.shard_routes import ShardRoutes

log = logging.getLogger("gradsync.client")

#: How long closing a group's stream may take (the goodbye and the teardown).
CLOSE_TIMEOUT_S = 5.0


class GroupSession:
    """A group's membership of its collectives-only job, and its `Collectives`.

    Args:
        address: the coordinator's "host:port".
        job_id: the group's job (`gradsync.distributed.backend.group_job_id`).
        rank, world_size: this rank in the group, and the group's size.
        security: TLS and token.
        timeout_s: bound on joining (all ranks of the group arrive) and on each collective.

    Raises:
        GradSyncError: joining failed (coordinator unreachable, refused, timed out).
    """

    def __init__(
        self,
        address: str,
        job_id: str,
        rank: int,
        world_size: int,
        security: ChannelSecurity,
        timeout_s: float,
    ) -> None:
        self.address = address
        self.job_id = job_id
        self.rank = rank
        self.world_size = world_size
        self._security = security
        #: Told each link's upload events (`BucketEventHandler`; the group's trace), or None.
        self._on_link_event: Callable[[str, int, int], None] | None = None
        log.info(
            "rank %d: joining process-group job '%s' at %s (size %d)",
            rank,
            job_id,
            address,
            world_size,
        )
        link, welcome = self._join(None, timeout_s)
        #: The group's link across coordinator restarts (`gradsync.distributed.reconnect`),
        #: reconnecting for as long as the model wrapper does.
        window_s = defaults.RECONNECT_TIMEOUT_S
        sequence = int(welcome.next_collective)
        self.resuming = ResumingLink(link, sequence, self._join, address, rank, window_s)
        #: The group's collectives (blocking; the process group runs them on its thread).
        self.collectives = Collectives(
            lambda: cast(SessionLink, self.resuming), rank, world_size, timeout_s
        )
        #: Spreads bulk ops over the coordinator's shards (None: not sharded).
        self.shard_routes: ShardRoutes | None = None
        if (shards := len(welcome.shards)) > 1:
            self.shard_routes = ShardRoutes(
                lambda: self.resuming.link, shards, rank, world_size, welcome.chunk_bytes, timeout_s
            )
            log.info(
                "rank %d: group '%s' spreads its bulk ops over %d shards", rank, job_id, shards
            )

    def _join(
        self, resume_from: int | None, timeout_s: float
    ) -> tuple[CoordinatorLink, pb.Welcome]:
        """Join the group's job on a new link; return it and its Welcome.

        `resume_from`: a rank rejoining a restarted coordinator claims the lowest
        collective it has no result for (`Join.collective_resume`).
        """
        link: CoordinatorLink = Transport(self.address, self.rank, security=self._security)
        if self._on_link_event is not None:
            link.on_bucket_event = self._on_link_event
        join = pb.Join(
            job_id=self.job_id,
            rank=self.rank,
            world_size=self.world_size,
            signature=pb.ModelSignature(),  # empty: collectives only
            incarnation=uuid.uuid4().hex,
            client_version=__version__,
        )
        if resume_from is not None:
            join.collective_resume.sequence = resume_from
        try:
            link.configure_buckets([])
            link.open(join)
            welcome = link.wait_welcome(timeout_s)
        except BaseException:
            link.close(CLOSE_TIMEOUT_S)
            raise
        return link, welcome

    def observe(
        self, on_numbered: Callable[[int], None], on_link_event: Callable[[str, int, int], None]
    ) -> None:
        """Tell `on_numbered` each collective's number as it is numbered, and
        `on_link_event` the upload events of this link and every later one (the group's
        trace, `gradsync.distributed.op_trace`)."""
        self._on_link_event = on_link_event
        self.resuming.on_numbered = on_numbered
        self.resuming.link.on_bucket_event = on_link_event

    def close(self) -> None:
        """Leave the job (bounded). Idempotent."""
        self.resuming.close(CLOSE_TIMEOUT_S)
