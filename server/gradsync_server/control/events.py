"""Control events: the leader's data plane and its shards' planes follow the same decisions.

Every change the data planes must follow (the job started, its membership
changed, a step was aborted) is decided by the job (`control.job`), applied
here to the job's own plane (byte range 0) at once, and queued for the shards
(`take`) in the order decided. A shard applies the same events to its plane
(`gradsync_server.dataplane.plane`), so no process ever compares states.
Pure logic, no gRPC, no asyncio.
"""

from __future__ import annotations

from gradsync_proto.v1 import gradsync_pb2 as pb

from gradsync_server.dataplane.actions import Action
from gradsync_server.dataplane.plane import JobPlane
from gradsync_server.errors import RejectedMessage


class ControlEvents:
    """One job's own plane, and the events its shards have not taken yet.

    Args:
        job_id: the job's name.
        plane: the job's data plane for byte range 0 (the whole bucket when unsharded).
        shard_count: how many planes the buckets are cut into (1: nobody else to tell).
    """

    def __init__(self, job_id: str, plane: JobPlane, shard_count: int) -> None:
        self._job_id = job_id
        self._plane = plane
        self._shard_count = shard_count
        #: Events not yet taken by the shards, in decision order.
        self._events: list[pb.LeaderMessage] = []
        self._last_abort = -1

    def take(self) -> list[pb.LeaderMessage]:
        """The events decided since the last call, for the shards, in order.

        Each was already applied to the job's own plane. Always empty when unsharded.
        """
        if not self._events:
            return []  # the common case, on every batch of actions
        events, self._events = self._events, []
        return events

    def start(self, view: pb.ShardJobView) -> None:
        """The job starts (or goes on after a restart) as `view` says."""
        self._plane.start(view)
        self._tell(pb.LeaderMessage(job=view))

    def follow(self, view: pb.ShardJobView) -> list[Action]:
        """The membership changed to `view`: apply it to the job's plane now, and tell the shards.

        Returns the averages a dropped rank or a rank out of inputs completed
        here, or the step's abort when a rejoining rank cannot be summed in rank
        order (the shards then drop that step before they follow the view).
        """
        followed = self._plane.follow(view)
        actions = followed.actions
        if followed.refused is not None:
            rank, rejection = followed.refused
            actions += self.abort(rank, rejection)
        self._tell(pb.LeaderMessage(job=view))
        return actions

    def abort(self, culprit: int, rejection: RejectedMessage) -> list[Action]:
        """Abort the open step for every rank because of `culprit`'s message."""
        step = self._plane.step.step
        actions = self._plane.step.abort(culprit, rejection)
        self.aborted(step)
        return actions

    def aborted(self, step: int) -> None:
        """Every rank is told `step` is aborted: the shards drop it too (once per step)."""
        if step != self._last_abort:
            self._last_abort = step
            self._tell(pb.LeaderMessage(abort=pb.ShardAbort(job_id=self._job_id, step=step)))

    def _tell(self, event: pb.LeaderMessage) -> None:
        if self._shard_count > 1:
            self._events.append(event)
