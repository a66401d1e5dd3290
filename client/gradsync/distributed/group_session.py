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
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable

from gradsync_proto.net.channels import ChannelSecurity
from gradsync_proto.v1 import gradsync_pb2 as pb

from gradsync import __version__
from gradsync.collectives import Collectives
from gradsync.control.link import CoordinatorLink
from gradsync.control.transport import Transport

log = logging.getLogger("gradsync.client")

#: Builds a link from (coordinator "host:port", rank, security); tests pass another.
GroupLinkFactory = Callable[[str, int, ChannelSecurity], CoordinatorLink]

#: How long closing a group's stream may take (the goodbye and the teardown).
CLOSE_TIMEOUT_S = 5.0


def transport_link(address: str, rank: int, security: ChannelSecurity) -> CoordinatorLink:
    """The production link: the Sync stream over frames or gRPC."""
    return Transport(address, rank, security=security)


class GroupSession:
    """A group's membership of its collectives-only job, and its `Collectives`.

    Args:
        address: the coordinator's "host:port".
        job_id: the group's job (`gradsync.distributed.backend.group_job_id`).
        rank, world_size: this rank in the group, and the group's size.
        security: TLS and token.
        timeout_s: bound on joining (all ranks of the group arrive) and on each collective.
        link_factory: builds the link (default: `transport_link`).

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
        link_factory: GroupLinkFactory = transport_link,
    ) -> None:
        self.address = address
        self.job_id = job_id
        self.rank = rank
        self.world_size = world_size
        self._link = link_factory(address, rank, security)
        self._closed = False
        try:
            self._link.configure_buckets([])
            self._link.open(
                pb.Join(
                    job_id=job_id,
                    rank=rank,
                    world_size=world_size,
                    signature=pb.ModelSignature(),  # empty: collectives only
                    incarnation=uuid.uuid4().hex,
                    client_version=__version__,
                )
            )
            log.info(
                "rank %d: joining process-group job '%s' at %s (size %d)",
                rank,
                job_id,
                address,
                world_size,
            )
            welcome = self._link.wait_welcome(timeout_s)
            self._link.set_collective_sequence(int(welcome.next_collective))
        except BaseException:
            self._link.close(CLOSE_TIMEOUT_S)
            raise
        #: The group's collectives (blocking; the process group runs them on its thread).
        self.collectives = Collectives(lambda: self._link, rank, world_size, timeout_s)

    @property
    def link(self) -> CoordinatorLink:
        """The stream to the coordinator."""
        return self._link

    def close(self) -> None:
        """Leave the job (bounded). Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._link.close(CLOSE_TIMEOUT_S)
