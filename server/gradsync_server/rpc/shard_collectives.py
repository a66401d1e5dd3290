"""A shard's part of process groups' collectives: its range of each spread bulk op.

A c10d process group on a sharded coordinator (`gradsync.distributed.shard_routes`)
cuts each large all-reduce, all-gather and reduce-scatter into one contiguous
element range per shard, as the wrapper cuts a bucket: range 0 goes to the
leader on the rank's Sync stream, range i to shard i on the rank's `Shard.Data`
stream, as a `CollectiveChunk` of that range alone. Every rank numbers the
collectives it sends to one shard 0, 1, 2, ... (the same on every rank: they
issue the same ops in the same order), so each shard pairs the ranks' inputs
by its own sequence with the coordinator's `Collectives`, unchanged: the same
checks (op, dtype, size), the same byte budget, the same reduction in ascending
rank order (so the spread result is bitwise the one a single coordinator
computes), the same failure for every rank when they disagree. The results go
back on the same data streams.

The leader stays the authority: a shard follows its views (the members of a
job; a rank no longer a member stops taking part) and forgets a job's
collectives when the job ends or the leader is lost. Pure bookkeeping, on the
shard's loop; no gRPC.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from gradsync_proto.v1 import gradsync_pb2 as pb

from gradsync_server.control.collectives import Collectives
from gradsync_server.dataplane.actions import Action
from gradsync_server.dataplane.budget import ByteBudget
from gradsync_server.dataplane.observer import StepObserver

log = logging.getLogger("gradsync.shard")


@dataclass
class _Group:
    """One job's collectives at this shard, and the ranks taking part."""

    collectives: Collectives
    members: tuple[int, ...]


class ShardCollectives:
    """The collectives of every job this shard follows, by job id.

    Args:
        max_bytes: cap on one rank's input to one collective.
        budget: the shard's byte budget (each job takes its share by its id).
        observer: the shard's metrics (every completed range is counted there).
        clock: monotonic time source.
    """

    def __init__(
        self,
        max_bytes: int,
        budget: ByteBudget,
        observer: StepObserver | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._max_bytes = max_bytes
        self._budget = budget
        self._observer = observer
        self._clock = clock
        self._groups: dict[str, _Group] = {}

    def follow(self, view: pb.ShardJobView) -> list[Action]:
        """A job started or its members changed at the leader.

        Returns:
            The results of rounds that waited only for ranks no longer members.
        """
        members = tuple(sorted(member.rank for member in view.members))
        group = self._groups.get(view.job_id)
        if group is None:
            collectives = Collectives(
                view.world_size,
                view.chunk_bytes,
                self._max_bytes,
                self._budget.for_owner(view.job_id),
                self._observer,
                self._clock,
            )
            self._groups[view.job_id] = _Group(collectives, members)
            return []
        actions: list[Action] = []
        for rank in sorted(set(group.members) - set(members)):
            actions += group.collectives.drop_participant(rank)
        group.members = members
        return actions

    def accept(self, job_id: str, rank: int, chunk: pb.CollectiveChunk) -> list[Action]:
        """Take one chunk of `rank`'s input to this shard's range of a collective.

        Raises:
            RejectedMessage: the chunk is malformed, oversized or out of order (the
                sender's stream ends, as at the leader).
            KeyError: no view announced `job_id` (the caller checked that it did).
        """
        group = self._groups[job_id]
        return group.collectives.accept(rank, chunk, group.members)

    def knows(self, job_id: str) -> bool:
        """True once a view of `job_id` arrived (and until it ended)."""
        return job_id in self._groups

    def forget(self, job_id: str) -> None:
        """The job ended: free what its collectives buffer."""
        group = self._groups.pop(job_id, None)
        if group is not None:
            group.collectives.release()

    def clear(self) -> None:
        """The leader was lost: forget every job."""
        for job_id in list(self._groups):
            self.forget(job_id)
