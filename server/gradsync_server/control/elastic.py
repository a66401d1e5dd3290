"""The elastic policy: lose a rank and go on; heal a restarted rank with a live one's state.

Under `--on-failure elastic` a lost rank is dropped from the open step (the
chunks it never contributed to complete over the live ranks, the collectives
it never joined over the others) and the membership epoch moves on. A
restarted rank waits as a newcomer until the lowest live rank uploads its
state at a step boundary; the coordinator relays that state to it (Welcome
plus resume chunks) before adding it to the open step, and tells the donor
(MembershipChanged), which uploads that step's gradients only then. The job decides *when*
the policy applies; this module carries it out. Pure logic, no gRPC, no asyncio.
"""

from __future__ import annotations

from collections.abc import Callable

from gradsync_proto.codes import Code
from gradsync_proto.v1 import gradsync_pb2 as pb

from gradsync_server.control.collectives import Collectives
from gradsync_server.control.membership import Membership
from gradsync_server.dataplane.actions import Action, ResumeBlob, Send, Terminate
from gradsync_server.dataplane.budget import OwnerBudget
from gradsync_server.dataplane.open_step import OpenStep
from gradsync_server.dataplane.uploads import DonorState
from gradsync_server.errors import RejectedMessage


class Elastic:
    """Shrinking and healing of one job's membership.

    Args:
        job_id: the job's name (for messages).
        membership: the job's members and newcomers.
        in_flight: the job's open step (read here; changed only through `publish`).
        publish: applies the changed membership to the job's data planes (`Job._publish`)
            and returns what that completed.
        collectives: the job's collectives in flight.
        chunk_bytes: chunk size every rank must use.
        max_blob_bytes: the largest healing state accepted.
        welcome: builds the Welcome of the job as it stands, given the resume size.
        budget: where the healing state's bytes are counted while they arrive.
    """

    def __init__(
        self,
        job_id: str,
        membership: Membership,
        in_flight: OpenStep,
        publish: Callable[[], list[Action]],
        collectives: Collectives,
        chunk_bytes: int,
        max_blob_bytes: int,
        welcome: Callable[[int], pb.CoordinatorMessage],
        budget: OwnerBudget | None = None,
    ) -> None:
        self._budget = budget
        self._job_id = job_id
        self._membership = membership
        self._in_flight = in_flight
        self._publish = publish
        self._collectives = collectives
        self._chunk_bytes = chunk_bytes
        self._max_blob_bytes = max_blob_bytes
        self._welcome = welcome
        #: The donor's state upload while healing newcomers.
        self._heal: DonorState | None = None

    @property
    def healing(self) -> bool:
        """True while a donor has been asked for its state."""
        return self._heal is not None

    def shrink(self, lost: int, how: str, followers: tuple[int, ...] = ()) -> list[Action]:
        """Go on without `lost`; finish the open step and collectives over the live ranks.

        Args:
            how: how it was lost ("left", "disconnected from"), for the others.
            followers: the live ranks of `lost`'s local group (it was their local
                leader): they leave with it, all in one membership epoch. Their
                streams end (ABORTED, PEER_LOST, naming the lost leader): the
                group's shared memory and partial sums were the leader's, so they
                restart and rejoin, flat, like any lost rank.
        """
        membership, step = self._membership, self._in_flight.step
        reason = f"rank {lost} {how} job '{self._job_id}'"
        actions: list[Action] = []
        if followers:
            group = membership.groups.group_of(lost)
            membership.groups.drop_group(lost)
            for follower in followers:
                membership.remove(follower, assembling=False)
            details = (
                f"{reason} at step {step}; it was the local leader of ranks "
                f"{list(group)}, whose gradients went through it, so ranks {list(followers)} "
                "leave the job with it (restart them to rejoin)"
            )
            actions.append(Terminate(followers, Code.ABORTED, details, pb.END_REASON_PEER_LOST))
            reason += f" with its local group {list(group)}"
        membership.epoch += 1  # the members changed without newcomers: a new epoch
        reason = (
            f"{reason} at step {step}; continuing with ranks "
            f"{list(membership.ranks())} (membership epoch {membership.epoch})"
        )
        actions.append(Send(membership.ranks(), membership.changed_message(step, reason)))
        gone = (lost, *followers)
        if self._heal is not None and self._heal.donor in gone:
            self.release()  # the donor is gone: ask another live rank
            actions += self.request_heal()
        actions += self._publish()  # the step finishes what `gone` never contributed to
        for rank in gone:
            actions += self._collectives.drop_participant(rank)
        return actions

    def release(self) -> None:
        """Forget a healing upload in progress and give its bytes back (idempotent)."""
        if self._heal is not None:
            self._heal.release()
        self._heal = None

    def request_heal(self) -> list[Action]:
        """Ask the lowest live rank for its state, if newcomers wait."""
        membership = self._membership
        if not membership.newcomers or not membership.members:
            return []
        # The lowest live rank donates: until its own chunks of the open step
        # arrive, no chunk of that step can have folded anyone in, so the
        # newcomers can still be added to the step's reductions. At the leader
        # the donor's chunks follow its state on the same stream; a shard gets
        # them on another, so the donor uploads nothing of the step until the
        # MembershipChanged below reached it: its chunks carry the new epoch,
        # and a shard holds those until the view adding the newcomers arrives
        # (`JobPlane.awaits_leader`; the client's
        # `gradsync.control.session.await_heal_answer`).
        donor = min(membership.members)
        self._heal = DonorState(donor, self._chunk_bytes, self._max_blob_bytes, self._budget)
        # A newcomer that could not read the donor's direct offer before gets the state
        # itself through us (the donor uploads it raw instead of an offer).
        relay = any(rank in membership.heal_relayed for rank in membership.newcomers)
        request = pb.StateRequest(for_rank=min(membership.newcomers), relay=relay)
        return [Send((donor,), pb.CoordinatorMessage(state_request=request))]

    def on_heal_chunk(self, rank: int, chunk: pb.CheckpointChunk) -> list[Action]:
        """Collect the donor's state; when complete, admit the newcomers with it.

        Raises:
            RejectedMessage: nobody asked `rank` for its state, or the upload is malformed.
        """
        heal = self._heal
        if heal is None or heal.donor != rank:
            raise RejectedMessage(
                Code.FAILED_PRECONDITION,
                f"rank {rank} sent healing state for step {chunk.step} that nobody asked for",
            )
        donor = rank
        try:
            blob = heal.add(f"healing state of step {chunk.step} from rank {donor}", chunk)
        except RejectedMessage:
            self._heal = None
            raise
        if blob is None:
            return []
        self._heal = None
        step = self._in_flight.step
        if chunk.step != step:
            return self.request_heal()  # not at the boundary we can use: ask again
        membership = self._membership
        newcomers = membership.promote_newcomers()
        # The newcomers contribute to the open step from now on.
        actions: list[Action] = self._publish()
        next_collective = self._collectives.add_participants(newcomers)
        reason = (
            f"rank(s) {newcomers} rejoined job '{self._job_id}' at step {step} with "
            f"rank {donor}'s state (membership epoch {membership.epoch})"
        )
        old = tuple(r for r in membership.ranks() if r not in newcomers)
        actions.append(Send(old, membership.changed_message(step, reason)))
        targets = tuple(newcomers)
        for rank_joining in targets:  # each with its own session secret
            welcome = self._welcome(len(blob))
            welcome.welcome.next_collective = next_collective
            welcome.welcome.session = membership.session_of(rank_joining)
            actions.append(Send((rank_joining,), welcome))
        actions.append(Send(targets, ResumeBlob(step, blob, self._chunk_bytes)))
        return actions
