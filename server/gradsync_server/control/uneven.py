"""Uneven inputs (DDP's `join()`): ranks that run out of data before the others.

With uneven data, one rank finishes its epoch first. Under DDP's Join it
shadows the others' collectives until all are done; here the coordinator
does it for it: a rank that sends OutOfInputs{step} is no longer expected in
gradient reductions (which keep dividing by the membership's size, DDP's
`divide_by_initial_world_size=True`) nor in collectives, and hears a
JoinProgress after every completed step. When the last rank runs out, every
rank gets JoinProgress(all_joined, last_joiner, next_step, next_collective):
all continue from that step and collective, and the wrappers broadcast the
last joiner's parameters so that every rank ends equal. Pure logic, no gRPC,
no asyncio.
"""

from __future__ import annotations

from collections.abc import Callable

from gradsync_proto.codes import Code
from gradsync_proto.v1 import gradsync_pb2 as pb

from gradsync_server.control.collectives import Collectives
from gradsync_server.control.membership import Membership
from gradsync_server.dataplane.actions import Action, Send
from gradsync_server.dataplane.open_step import OpenStep
from gradsync_server.errors import RejectedMessage


class UnevenInputs:
    """The join() of one job over its open step and collectives.

    Args:
        membership: the job's members.
        in_flight: the job's open step (read here; changed only through `publish`).
        collectives: the job's collectives in flight.
        publish: applies the changed membership (`out_of_inputs` included) to the job's
            data planes (`Job._publish`) and returns what that completed.

    Attributes:
        out_of_inputs: the ranks that ran out of inputs, not expected in reductions.
    """

    def __init__(
        self,
        membership: Membership,
        in_flight: OpenStep,
        collectives: Collectives,
        publish: Callable[[], list[Action]],
    ) -> None:
        self._membership = membership
        self._in_flight = in_flight
        self._collectives = collectives
        self._publish = publish
        self.out_of_inputs: set[int] = set()
        #: The rank whose OutOfInputs arrived last.
        self.last_joiner = -1

    def run_out(self, rank: int, message: pb.OutOfInputs) -> list[Action]:
        """`rank` ran out of inputs: go on without it, or end the join if it was the last.

        Raises:
            RejectedMessage: not at the job's open step, or twice (this worker's stream ends).
        """
        in_flight = self._in_flight
        step = in_flight.step
        problem = None
        if rank in self.out_of_inputs:
            problem = "twice"
        elif message.step != step:
            problem = f"at step {message.step}, but the job's open step is {step}"
        elif in_flight.progress is not None and in_flight.progress.delivered_any(rank):
            problem = f"at step {step} after sending gradients for it"
        if problem is not None:
            raise RejectedMessage(
                Code.FAILED_PRECONDITION, f"rank {rank} ran out of inputs (join()) {problem}"
            )
        self.last_joiner = rank
        if set(self._membership.members) <= self.out_of_inputs | {rank}:
            return self._collectives.drop_participant(rank) + self._all_joined()
        completed = in_flight.steps_completed
        self.out_of_inputs.add(rank)
        actions = self._publish()  # the step stops waiting for `rank`
        actions += self._collectives.drop_participant(rank)
        return actions + self.progress(completed, always=True)

    def progress(self, completed_before: int, always: bool = False) -> list[Action]:
        """JoinProgress for the ranks out of inputs if a step completed since `completed_before`."""
        joined = sorted(self.out_of_inputs)
        if not joined or (self._in_flight.steps_completed == completed_before and not always):
            return []
        message = pb.JoinProgress(
            joined_ranks=joined,
            next_step=self._in_flight.step,
            next_collective=self._collectives.next_sequence,
        )
        return [Send(tuple(joined), pb.CoordinatorMessage(join_progress=message))]

    def lost(self, rank: int) -> list[Action]:
        """`rank` left for good (elastic): if every rank left is out of inputs, the join ends."""
        out = self.out_of_inputs
        out.discard(rank)  # the planes forgot it with the member
        members = set(self._membership.members)
        if out and members <= out:
            if self.last_joiner not in members:
                self.last_joiner = max(members)
            return self._all_joined()
        return []

    def _all_joined(self) -> list[Action]:
        """Every rank ran out of inputs: all continue from the same step and collective."""
        ranks = self._membership.ranks()
        joined = sorted(set(ranks) | self.out_of_inputs)
        self.out_of_inputs.clear()
        actions = self._publish()  # every rank takes part again (nothing waits only for them)
        message = pb.JoinProgress(
            joined_ranks=joined,
            all_joined=True,
            last_joiner=self.last_joiner,
            next_step=self._in_flight.step,
            next_collective=self._collectives.next_sequence,
        )
        return [*actions, Send(ranks, pb.CoordinatorMessage(join_progress=message))]
