"""One training job's lifecycle: the state machine over its owned components (pure logic).

The servicer hands every parsed message to a `Job` and carries out the
actions it returns: `Send` a message to some ranks, `Terminate` their
streams with a status code, or `Persist` a checkpoint. Keeping this free of
gRPC and asyncio lets the whole protocol be unit-tested by calling methods.

A job is a small composition, each part owning its own state:

- `Membership` (`membership.py`): members, rejoining newcomers, signature, epoch;
- `OpenStep` (`open_step.py`): the step in flight, its reductions and aborts;
- `Liveness` (`liveness.py`): when each rank was last heard from;
- `Persistence` (`persistence.py`): checkpoint uploads and the resume point.

This module holds only what spans them: the lifecycle below, the state
broadcast at start, and the elastic policy (lose a rank and go on, heal a
rejoining one)::

    ASSEMBLING --(all ranks joined, signatures match)--> RUNNING
    ASSEMBLING / RUNNING --(signature mismatch, bad state broadcast)--> REFUSED
    RUNNING --(a rank leaves or disconnects; abort policy)--> BROKEN

A message that breaks the rules aborts the open step (nothing is averaged),
every rank is told why in-band, and the job carries on at the next step.
Under `--on-failure elastic` a lost rank is dropped from the open step (the
chunks it never contributed to complete over the live ranks) and the epoch
moves on; a restarted rank waits until the lowest live rank uploads its state
at a step boundary, which the coordinator relays to it before adding it to
the open step.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable, Sequence

from gradsync.protocol import defaults
from gradsync.protocol.codec import ChunkHeader
from gradsync.protocol.codes import Code
from gradsync.server import signature as signatures
from gradsync.server.actions import Action, Member, Send, Terminate
from gradsync.server.budget import ByteBudget
from gradsync.server.errors import RejectedMessage
from gradsync.server.liveness import Liveness
from gradsync.server.membership import Membership
from gradsync.server.metrics import CoordinatorMetrics
from gradsync.server.open_step import OpenStep, abort_message, check_chunk
from gradsync.server.persistence import Persistence, resume_messages
from gradsync.server.progress import StepProgress
from gradsync.server.uploads import BlobAssembler
from gradsync.v1 import gradsync_pb2 as pb


class JobState(enum.Enum):
    """Where a job is in its lifecycle."""

    ASSEMBLING = "assembling"
    RUNNING = "running"
    REFUSED = "refused"
    BROKEN = "broken"


class Job:
    """Membership, validation and aggregation for one job id.

    Args:
        job_id: the job's name.
        world_size: ranks the job needs.
        chunk_bytes: chunk size every rank must use.
        max_message_bytes: gRPC message limit (advertised in Welcome).
        budget: coordinator-wide cap on buffered gradient bytes.
        clock: monotonic time source (injectable for tests).
        heartbeat_interval_s: how often workers send a sign of life (advertised in Welcome).
        checkpoint_every: rank 0 uploads a checkpoint every this many steps (0 = on request).
        metrics: where latencies go, if anywhere.
        on_failure: "abort" or "elastic" (see the module docstring).
        min_workers: under the elastic policy, the fewest live ranks to go on with.
    """

    def __init__(
        self,
        job_id: str,
        world_size: int,
        chunk_bytes: int,
        max_message_bytes: int,
        budget: ByteBudget,
        clock: Callable[[], float] = time.monotonic,
        heartbeat_interval_s: float = defaults.HEARTBEAT_INTERVAL_S,
        checkpoint_every: int = defaults.CHECKPOINT_EVERY_STEPS,
        metrics: CoordinatorMetrics | None = None,
        on_failure: str = defaults.ON_FAILURE,
        min_workers: int = defaults.MIN_WORKERS,
    ) -> None:
        self.job_id = job_id
        self.world_size = world_size
        self.chunk_bytes = chunk_bytes
        self.max_message_bytes = max_message_bytes
        self.heartbeat_interval_s = heartbeat_interval_s
        self.checkpoint_every = checkpoint_every
        self.on_failure = on_failure
        self.min_workers = min_workers
        self._budget_limit = budget.limit
        self.membership = Membership(job_id, world_size, clock)
        self.in_flight = OpenStep(self.membership, chunk_bytes, budget, clock, metrics)
        self.liveness = Liveness(clock)
        self.persistence = Persistence(chunk_bytes, budget.limit)
        self.state = JobState.ASSEMBLING
        self._state_bytes = 0
        self._state_offsets_seen: set[int] = set()
        #: (donor rank, its state upload in progress) while healing newcomers.
        self._heal: tuple[int, BlobAssembler | None] | None = None
        self._broken_reason = ""

    # ------------------------------------------------------------ read-only views
    @property
    def members(self) -> dict[int, Member]:
        """Members of the current epoch by rank."""
        return self.membership.members

    @property
    def membership_epoch(self) -> int:
        """The current membership epoch."""
        return self.membership.epoch

    @property
    def open_step(self) -> int:
        """The step in flight."""
        return self.in_flight.step

    @property
    def steps_completed(self) -> int:
        """Steps whose every bucket was averaged."""
        return self.in_flight.steps_completed

    @property
    def progress(self) -> StepProgress | None:
        """Delivery bookkeeping of the open step (None before assembly)."""
        return self.in_flight.progress

    def joined_ranks(self) -> Sequence[int]:
        """Ranks currently connected, ascending."""
        return self.membership.ranks()

    def set_peer(self, rank: int, peer: str) -> None:
        """Remember the network address of `rank`, for status."""
        self.membership.set_peer(rank, peer)

    # ---------------------------------------------------------------------- join
    def join(self, rank: int, join: pb.Join) -> list[Action]:
        """Admit `rank`; return the Welcome broadcast once all ranks are in.

        Raises:
            RejectedMessage: this worker alone is refused (its stream ends).
        """
        self.membership.check_join(rank, join)
        if self.state is JobState.RUNNING and self.on_failure == "elastic":
            self.membership.admit_newcomer(rank, join)
            self.liveness.start(rank)
            return self._request_heal() if self._heal is None else []
        if self.state is not JobState.ASSEMBLING:
            raise RejectedMessage(
                Code.FAILED_PRECONDITION,
                f"job '{self.job_id}' is {self.state.value} at step {self.open_step}; "
                f"rank {rank} cannot join it now (rejoining a running job is not supported "
                "yet: restart all ranks, or use another job id)",
            )
        difference = self.membership.admit(rank, join)
        self.liveness.start(rank)
        if difference is not None:
            return self._refuse(
                Code.INVALID_ARGUMENT,
                f"job '{self.job_id}' refused: model signatures differ: {difference}",
            )
        if not self.membership.complete():
            return []
        return self._start()

    def _start(self) -> list[Action]:
        signature = self.membership.signature
        if signature is None:
            raise RuntimeError("an assembled job always has a signature")
        self.state = JobState.RUNNING
        self._state_bytes = signatures.state_bytes(signature)
        resume = self.persistence.resume
        if resume is not None:
            self.membership.epoch = resume.membership_epoch
            self.persistence.saved(resume.step)
        self.in_flight.configure(signature, resume.step if resume else 0)
        ranks = self.membership.ranks()
        resume_bytes = len(resume.payload) if resume is not None else 0
        actions: list[Action] = [Send(ranks, self._welcome_message(resume_bytes))]
        if resume is not None:
            actions += resume_messages(ranks, resume.step, resume.payload, self.chunk_bytes)
        return actions

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

    # ------------------------------------------------------------------ liveness
    def touch(self, rank: int, reported_step: int | None = None) -> None:
        """Record a sign of life from `rank` (any message counts)."""
        self.liveness.touch(rank, reported_step)

    def silent_ranks(self, timeout_s: float) -> list[int]:
        """Members not heard from for longer than `timeout_s`."""
        return self.liveness.silent_ranks(self.membership.ranks(), timeout_s)

    def late_ranks(self) -> dict[int, list[int]]:
        """Ranks the open step waits for, with the buckets others already delivered."""
        if self.state is not JobState.RUNNING:
            return {}
        return self.in_flight.late_ranks()

    # --------------------------------------------------------------- checkpoints
    def on_checkpoint_chunk(self, rank: int, chunk: pb.CheckpointChunk) -> list[Action]:
        """Collect rank 0's checkpoint upload (or a donor's healing state).

        Raises:
            RejectedMessage: the upload is malformed (this worker's stream ends).
        """
        if chunk.heal and self.state is JobState.RUNNING:
            return self._on_heal_chunk(rank, chunk)
        if self.state is not JobState.RUNNING or rank != 0:
            raise RejectedMessage(
                Code.FAILED_PRECONDITION if rank == 0 else Code.INVALID_ARGUMENT,
                f"rank {rank} sent a checkpoint chunk for step {chunk.step}; only rank 0 of a "
                f"running job uploads checkpoints (job is {self.state.value})",
            )
        persist = self.persistence.on_upload_chunk(chunk)
        return [] if persist is None else [persist]

    # ----------------------------------------------------------- state broadcast
    def on_state_chunk(self, rank: int, chunk: pb.StateChunk) -> list[Action]:
        """Relay a chunk of rank 0's parameters and buffers to the other ranks."""
        problem = None
        if self.state is not JobState.RUNNING:
            problem = (
                Code.FAILED_PRECONDITION,
                f"rank {rank} sent state before job '{self.job_id}' was assembled "
                f"({len(self.members)}/{self.world_size} joined)",
            )
        elif rank != 0:
            problem = (Code.INVALID_ARGUMENT, f"rank {rank} sent state; only rank 0 broadcasts")
        else:
            problem = check_chunk(
                "state",
                chunk.offset,
                len(chunk.payload),
                self._state_bytes,
                "the state blob",
                self.chunk_bytes,
                rank=0,
            )
            if problem is None and chunk.offset in self._state_offsets_seen:
                problem = (
                    Code.INVALID_ARGUMENT,
                    f"rank 0 sent the state chunk at offset {chunk.offset} twice",
                )
        if problem is not None:
            code, details = problem
            if self.state is JobState.RUNNING:
                return self._refuse(code, f"state broadcast failed: {details}")
            raise RejectedMessage(code, details)
        self._state_offsets_seen.add(chunk.offset)
        others = tuple(r for r in self.membership.ranks() if r != 0)
        return [Send(others, pb.CoordinatorMessage(state=chunk))] if others else []

    # ----------------------------------------------------------------- gradients
    def on_gradient(self, rank: int, chunk: ChunkHeader, payload: memoryview) -> list[Action]:
        """Fold one gradient chunk in; return averaged chunks or a step abort."""
        if self.state is JobState.BROKEN:
            if self.in_flight.was_aborted(chunk.step):
                return []  # this rank was already told the step cannot finish
            self.in_flight.remember_aborted(chunk.step)
            return [
                abort_message(
                    self.membership.ranks(),
                    chunk.step,
                    Code.ABORTED,
                    self._broken_reason,
                    -1,
                    pb.ABORT_REASON_PEER_LOST,
                )
            ]
        if self.state is not JobState.RUNNING:
            raise RejectedMessage(
                Code.FAILED_PRECONDITION,
                f"rank {rank} sent gradients for step {chunk.step} before job "
                f"'{self.job_id}' was assembled ({len(self.members)}/{self.world_size} joined)",
            )
        if chunk.step < self.open_step and self.in_flight.was_aborted(chunk.step):
            return []  # late upload for a step everyone was already told is aborted
        try:
            return self.in_flight.accept(rank, chunk, payload)
        except RejectedMessage as rejection:
            return self.in_flight.abort(rank, rejection)

    def on_abandon(self, rank: int, abandon: pb.AbandonStep) -> list[Action]:
        """A rank gave up on a step it started: abort it for everyone (if still open)."""
        if self.state is not JobState.RUNNING or abandon.step != self.open_step:
            return []  # already complete or aborted: nothing to undo
        reason = abandon.reason or "no reason given"
        rejection = RejectedMessage(
            Code.ABORTED,
            f"rank {rank} abandoned step {abandon.step}: {reason}",
            step=abandon.step,
        )
        return self.in_flight.abort(rank, rejection)

    def reject(self, culprit: int, rejection: RejectedMessage) -> list[Action]:
        """Abort the open step because `culprit` sent an unusable message."""
        if self.state is not JobState.RUNNING:
            return [Terminate((culprit,), rejection.code, rejection.message)]
        return self.in_flight.abort(culprit, rejection)

    # ------------------------------------------------------------------- leaving
    def detach(self, rank: int, orderly: bool, reason: str | None = None) -> list[Action]:
        """Forget `rank`'s connection; abort the open step for the others if running.

        Args:
            rank: the departing rank.
            orderly: it said goodbye (Leave) rather than vanishing.
            reason: how it was lost, for the survivors' error (default: left /
                disconnected).
        """
        self.liveness.forget(rank)
        if not self.membership.remove(rank, assembling=self.state is JobState.ASSEMBLING):
            return []
        if self.state is not JobState.RUNNING:
            return []
        how = reason or ("left" if orderly else "disconnected from")
        if self.on_failure == "elastic" and len(self.members) >= self.min_workers:
            return self._shrink(rank, f"rank {rank} {how} job '{self.job_id}'")
        if self.on_failure == "elastic":
            how += f" leaving {len(self.members)} ranks (--min-workers {self.min_workers}) in"
        step = self.open_step
        self._broken_reason = (
            f"rank {rank} {how} job '{self.job_id}' at step {step}; "
            "no partial average is applied and the remaining ranks cannot complete "
            "further steps"
        )
        self.state = JobState.BROKEN
        self.in_flight.release()
        self.in_flight.remember_aborted(step)
        if not self.members:
            return []
        return [
            abort_message(
                self.membership.ranks(),
                step,
                Code.ABORTED,
                self._broken_reason,
                -1,
                pb.ABORT_REASON_PEER_LOST,
                rank,
            )
        ]

    def _refuse(self, code: Code, details: str) -> list[Action]:
        """Refuse the whole job: every connected rank's stream ends with `code`."""
        self.state = JobState.REFUSED
        self.in_flight.release()
        return [Terminate(self.membership.ranks(), code, details, pb.END_REASON_JOB_REFUSED)]

    # ------------------------------------------------------------------- elastic
    def _shrink(self, lost: int, reason: str) -> list[Action]:
        """Elastic: go on without `lost`; finish the open step over the live ranks."""
        self.membership.epoch += 1
        reason = (
            f"{reason} at step {self.open_step}; continuing with ranks "
            f"{list(self.membership.ranks())} (membership epoch {self.membership_epoch})"
        )
        message = self.membership.changed_message(self.open_step, reason)
        actions: list[Action] = [Send(self.membership.ranks(), message)]
        if self._heal is not None and self._heal[0] == lost:
            self._heal = None  # the donor is gone: ask another live rank
            actions += self._request_heal()
        return actions + self.in_flight.drop_rank(lost)

    def _request_heal(self) -> list[Action]:
        if not self.membership.newcomers or not self.members:
            return []
        # The lowest live rank donates: until its own chunks of the open step
        # arrive, no chunk of that step can have folded anyone in, so the
        # newcomers can still be added to the step's reductions.
        donor = min(self.members)
        self._heal = (donor, None)
        request = pb.StateRequest(for_rank=min(self.membership.newcomers))
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
            assembler = BlobAssembler(what, chunk.total_bytes, self.chunk_bytes, self._budget_limit)
            self._heal = (donor, assembler)
        if not assembler.add(chunk.offset, chunk.payload):
            return []
        self._heal = None
        if chunk.step != self.open_step:
            return self._request_heal()  # not at the boundary we can use: ask again
        newcomers = self.membership.promote_newcomers()
        for rank_joining in newcomers:
            self.in_flight.add_rank(rank_joining)
        blob = assembler.blob()
        reason = (
            f"rank(s) {newcomers} rejoined job '{self.job_id}' at step {self.open_step} with "
            f"rank {donor}'s state (membership epoch {self.membership_epoch})"
        )
        old = tuple(r for r in self.membership.ranks() if r not in newcomers)
        actions: list[Action] = [Send(old, self.membership.changed_message(self.open_step, reason))]
        targets = tuple(newcomers)
        actions.append(Send(targets, self._welcome_message(resume_bytes=len(blob))))
        actions += resume_messages(targets, self.open_step, blob, self.chunk_bytes)
        return actions
