"""Elastic membership of a running job: lose a rank and go on, heal a rejoining one.

Under `--on-failure elastic` a lost rank is dropped from the open step (chunks
it never contributed to complete over the live ranks; every chunk's divisor
is the number of contributions it holds) and the membership epoch moves on.
A restarted rank that joins a running job waits until the lowest live rank
reaches a step boundary and uploads its state (model, optimizer, step); the
coordinator relays that state to the newcomer and adds it to the open step.

This is a mixin of `Job`: it shares the job's state and is kept apart only to
keep each module readable.
"""

from __future__ import annotations

from collections.abc import Callable

from gradsync.protocol import chunking
from gradsync.protocol.codes import Code
from gradsync.server import signature as signatures
from gradsync.server.actions import Action, Member, Send
from gradsync.server.aggregation import BucketReduction
from gradsync.server.budget import ByteBudget
from gradsync.server.errors import RejectedMessage
from gradsync.server.uploads import BlobAssembler
from gradsync.v1 import gradsync_pb2 as pb


class ElasticMembership:
    """Membership changes of a running job (mixed into `Job`)."""

    # State owned by Job, declared here for the type checker.
    job_id: str
    world_size: int
    chunk_bytes: int
    max_message_bytes: int
    heartbeat_interval_s: float
    checkpoint_every: int
    membership_epoch: int
    open_step: int
    members: dict[int, Member]
    _newcomers: dict[int, Member]
    _heal: tuple[int, BlobAssembler | None] | None
    _reductions: dict[int, BucketReduction]
    _budget: ByteBudget
    _signature: pb.ModelSignature | None
    _reference_rank: int | None
    _state_bytes: int
    _clock: Callable[[], float]

    def _ranks(self) -> tuple[int, ...]:
        raise NotImplementedError

    def _completed_chunk(self, bucket: int, offset: int, averaged: memoryview) -> list[Action]:
        raise NotImplementedError

    def _welcome_message(self, resume_bytes: int = 0) -> pb.CoordinatorMessage:
        """The Welcome of this job as it stands (for assembly and for newcomers)."""
        return pb.CoordinatorMessage(
            welcome=pb.Welcome(
                job_id=self.job_id,
                world_size=self.world_size,
                membership_epoch=self.membership_epoch,
                start_step=self.open_step,
                chunk_bytes=self.chunk_bytes,
                max_message_bytes=self.max_message_bytes,
                state_bytes=self._state_bytes,
                resume_bytes=resume_bytes,
                heartbeat_interval_s=self.heartbeat_interval_s,
                checkpoint_every_steps=self.checkpoint_every,
            )
        )

    def _resume_messages(self, ranks: tuple[int, ...], step: int, blob: bytes) -> list[Action]:
        """A state blob (checkpoint or a donor's state) cut into resume chunks for `ranks`."""
        actions: list[Action] = []
        for offset, length in chunking.chunk_spans(len(blob), self.chunk_bytes):
            piece = pb.CheckpointChunk(
                step=step,
                offset=offset,
                total_bytes=len(blob),
                payload=blob[offset : offset + length],
            )
            actions.append(Send(ranks, pb.CoordinatorMessage(resume=piece)))
        return actions

    def set_peer(self, rank: int, peer: str) -> None:
        """Remember the network address of `rank` (member or newcomer), for status."""
        member = self.members.get(rank) or self._newcomers.get(rank)
        if member is not None:
            member.peer = peer

    def _membership_message(self, reason: str) -> pb.CoordinatorMessage:
        return pb.CoordinatorMessage(
            membership=pb.MembershipChanged(
                membership_epoch=self.membership_epoch,
                ranks=list(self._ranks()),
                step=self.open_step,
                reason=reason,
            )
        )

    def _shrink(self, lost: int, reason: str) -> list[Action]:
        """Elastic: go on without `lost`; finish the open step over the live ranks."""
        self.membership_epoch += 1
        reason = (
            f"{reason} at step {self.open_step}; continuing with ranks {list(self._ranks())} "
            f"(membership epoch {self.membership_epoch})"
        )
        actions: list[Action] = [Send(self._ranks(), self._membership_message(reason))]
        if self._heal is not None and self._heal[0] == lost:
            self._heal = None  # the donor is gone: ask another live rank
            actions += self._request_heal()
        step = self.open_step
        for bucket, reduction in list(self._reductions.items()):
            before = reduction.buffered_bytes
            completed = reduction.drop_rank(lost)
            self._budget.adjust(reduction.buffered_bytes - before)
            for offset, averaged in completed:
                actions += self._completed_chunk(bucket, offset, averaged)
            if self.open_step != step:
                break  # the step completed over the live ranks
        return actions

    def _admit_newcomer(self, rank: int, join: pb.Join) -> list[Action]:
        """A restarted rank joins a running elastic job: heal it at a step boundary."""
        assert self._reference_rank is not None and self._signature is not None
        difference = signatures.first_difference(
            self._reference_rank, self._signature, rank, join.signature
        )
        if difference is not None:
            raise RejectedMessage(
                Code.INVALID_ARGUMENT,
                f"rank {rank} cannot rejoin: model signatures differ: {difference}",
            )
        now = self._clock()
        self._newcomers[rank] = Member(rank, join.incarnation, join.signature, now, last_seen=now)
        return self._request_heal() if self._heal is None else []

    def _request_heal(self) -> list[Action]:
        if not self._newcomers or not self.members:
            return []
        # The lowest live rank donates: until its own chunks of the open step
        # arrive, no chunk of that step can have folded anyone in, so the
        # newcomers can still be added to the step's reductions.
        donor = min(self.members)
        self._heal = (donor, None)
        request = pb.StateRequest(for_rank=min(self._newcomers))
        return [Send((donor,), pb.CoordinatorMessage(state_request=request))]

    def _on_heal_chunk(self, rank: int, chunk: pb.CheckpointChunk) -> list[Action]:
        """Collect the donor's state; when complete, admit the newcomers with it."""
        if self._heal is None or self._heal[0] != rank:
            raise RejectedMessage(
                Code.FAILED_PRECONDITION,
                f"rank {rank} sent healing state for step {chunk.step} that nobody asked for",
            )
        donor, assembler = self._heal
        if assembler is None:
            what = f"healing state of step {chunk.step} from rank {donor}"
            assembler = BlobAssembler(what, chunk.total_bytes, self.chunk_bytes, self._budget.limit)
            self._heal = (donor, assembler)
        if not assembler.add(chunk.offset, chunk.payload):
            return []
        self._heal = None
        if chunk.step != self.open_step:
            return self._request_heal()  # not at the boundary we can use: ask again
        newcomers = sorted(self._newcomers)
        for rank_joining in newcomers:
            self.members[rank_joining] = self._newcomers.pop(rank_joining)
            for reduction in self._reductions.values():
                reduction.add_rank(rank_joining)
        self.membership_epoch += 1
        blob = assembler.blob()
        reason = (
            f"rank(s) {newcomers} rejoined job '{self.job_id}' at step {self.open_step} with "
            f"rank {donor}'s state (membership epoch {self.membership_epoch})"
        )
        old = tuple(r for r in self._ranks() if r not in newcomers)
        actions: list[Action] = [Send(old, self._membership_message(reason))]
        assert self._signature is not None
        welcome = self._welcome_message(resume_bytes=len(blob))
        targets = tuple(newcomers)
        actions.append(Send(targets, welcome))
        actions += self._resume_messages(targets, self.open_step, blob)
        return actions
