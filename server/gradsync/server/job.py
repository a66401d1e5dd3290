"""One training job's membership and step state machine (pure logic, no gRPC).

The servicer hands every parsed message to a `Job` and carries out the
actions it returns: `Send` a message to some ranks, or `Terminate` their
streams with a status code. Keeping this free of gRPC and asyncio lets the
whole protocol be unit-tested by calling methods.

Lifecycle::

    ASSEMBLING --(all ranks joined, signatures match)--> RUNNING
    ASSEMBLING / RUNNING --(signature mismatch, bad state broadcast)--> REFUSED
    RUNNING --(a rank leaves or disconnects)--> BROKEN

Steps are lock-step: ranks can only start step s + 1 after receiving every
averaged bucket of step s, so exactly one step (`open_step`) is in flight per
job. A message that breaks the rules aborts the open step (nothing is
averaged), every rank is told why in-band, and the job carries on at the next
step.
"""

from __future__ import annotations

import enum
import time
from collections import deque
from collections.abc import Callable, Sequence

from gradsync.protocol import chunking, dtypes
from gradsync.protocol.codec import ChunkHeader, encode_gradient
from gradsync.protocol.codes import Code
from gradsync.server import signature as signatures
from gradsync.server.actions import Action, Member, Persist, Send, Terminate
from gradsync.server.aggregation import BucketReduction, DuplicateContributionError
from gradsync.server.budget import ByteBudget
from gradsync.server.checkpoint import Checkpoint
from gradsync.server.elastic import ElasticMembership
from gradsync.server.errors import RejectedMessage
from gradsync.server.metrics import CoordinatorMetrics
from gradsync.server.progress import StepProgress
from gradsync.server.uploads import BlobAssembler
from gradsync.v1 import gradsync_pb2 as pb

#: Aborted step numbers remembered so that late chunks for them are dropped
#: quietly instead of being reported as stale.
_ABORTED_STEPS_REMEMBERED = 64


class JobState(enum.Enum):
    """Where a job is in its lifecycle."""

    ASSEMBLING = "assembling"
    RUNNING = "running"
    REFUSED = "refused"
    BROKEN = "broken"


class Job(ElasticMembership):
    """Membership, validation and aggregation for one job id.

    Args:
        job_id: the job's name.
        world_size: ranks the job needs.
        chunk_bytes: chunk size every rank must use.
        max_message_bytes: gRPC message limit (advertised in Welcome).
        budget: coordinator-wide cap on buffered gradient bytes.
        clock: monotonic time source (injectable for tests).
    """

    def __init__(
        self,
        job_id: str,
        world_size: int,
        chunk_bytes: int,
        max_message_bytes: int,
        budget: ByteBudget,
        clock: Callable[[], float] = time.monotonic,
        heartbeat_interval_s: float = 0.5,
        checkpoint_every: int = 0,
        metrics: CoordinatorMetrics | None = None,
        on_failure: str = "abort",
        min_workers: int = 1,
    ) -> None:
        self.job_id = job_id
        self.world_size = world_size
        self.chunk_bytes = chunk_bytes
        self.max_message_bytes = max_message_bytes
        self._budget = budget
        self._clock = clock
        self.heartbeat_interval_s = heartbeat_interval_s
        self.checkpoint_every = checkpoint_every
        self._metrics = metrics
        self.on_failure = on_failure
        self.min_workers = min_workers
        #: Restarted ranks waiting to be healed with a live rank's state (elastic).
        self._newcomers: dict[int, Member] = {}
        #: (donor rank, its state upload in progress) while healing newcomers.
        self._heal: tuple[int, BlobAssembler | None] | None = None
        self._step_start_epoch = 0
        self.progress: StepProgress | None = None
        #: Checkpoint this job resumes from (set by the servicer before assembly).
        self.resume: Checkpoint | None = None
        self.last_checkpoint_step = -1
        self._checkpoint_upload: tuple[int, BlobAssembler] | None = None
        self.state = JobState.ASSEMBLING
        self.membership_epoch = 0
        self.open_step = 0
        self.members: dict[int, Member] = {}
        self._reference_rank: int | None = None
        self._signature: pb.ModelSignature | None = None
        self._bucket_bytes: list[int] = []
        self._state_bytes = 0
        self._state_offsets_seen: set[int] = set()
        self._reductions: dict[int, BucketReduction] = {}
        self._buckets_done = 0
        self._aborted_steps: deque[int] = deque(maxlen=_ABORTED_STEPS_REMEMBERED)
        self._broken_reason = ""
        self.steps_completed = 0

    # ------------------------------------------------------------------ join
    def join(self, rank: int, join: pb.Join) -> list[Action]:
        """Admit `rank`; return the Welcome broadcast once all ranks are in.

        Raises:
            RejectedMessage: this worker alone is refused (its stream ends).
        """
        if join.world_size != self.world_size:
            raise RejectedMessage(
                Code.INVALID_ARGUMENT,
                f"rank {rank} joined job '{self.job_id}' with world size {join.world_size}, "
                f"but the coordinator runs world size {self.world_size}",
            )
        if rank in self.members or rank in self._newcomers:
            member = self.members.get(rank) or self._newcomers[rank]
            raise RejectedMessage(
                Code.ALREADY_EXISTS,
                f"rank {rank} of job '{self.job_id}' is already connected (incarnation "
                f"{member.incarnation}, joined {self._clock() - member.joined_at:.1f}s ago); "
                f"incarnation {join.incarnation} cannot claim it too",
            )
        if self.state is JobState.RUNNING and self.on_failure == "elastic":
            return self._admit_newcomer(rank, join)
        if self.state is not JobState.ASSEMBLING:
            raise RejectedMessage(
                Code.FAILED_PRECONDITION,
                f"job '{self.job_id}' is {self.state.value} at step {self.open_step}; "
                f"rank {rank} cannot join it now (rejoining a running job is not supported "
                "yet: restart all ranks, or use another job id)",
            )
        signatures.validate(rank, join.signature)
        now = self._clock()
        self.members[rank] = Member(rank, join.incarnation, join.signature, now, last_seen=now)
        if self._signature is None:
            self._signature = join.signature
            self._reference_rank = rank
        else:
            assert self._reference_rank is not None
            difference = signatures.first_difference(
                self._reference_rank, self._signature, rank, join.signature
            )
            if difference is not None:
                return self._refuse(
                    Code.INVALID_ARGUMENT,
                    f"job '{self.job_id}' refused: model signatures differ: {difference}",
                )
        if len(self.members) < self.world_size:
            return []
        return self._start()

    def _start(self) -> list[Action]:
        assert self._signature is not None
        self.state = JobState.RUNNING
        self._bucket_bytes = [signatures.bucket_bytes(b) for b in self._signature.buckets]
        self._state_bytes = signatures.state_bytes(self._signature)
        self.progress = StepProgress(
            [chunking.num_chunks(size, self.chunk_bytes) for size in self._bucket_bytes],
            self._clock,
        )
        resume = self.resume
        if resume is not None:
            self.open_step = resume.step
            self.membership_epoch = resume.membership_epoch
            self.last_checkpoint_step = resume.step
        resume_bytes = len(resume.payload) if resume is not None else 0
        actions: list[Action] = [Send(self._ranks(), self._welcome_message(resume_bytes))]
        if resume is not None:
            actions += self._resume_messages(self._ranks(), resume.step, resume.payload)
        return actions

    # ------------------------------------------------------------- liveness
    def touch(self, rank: int, reported_step: int | None = None) -> None:
        """Record a sign of life from `rank` (any message counts)."""
        member = self.members.get(rank)
        if member is not None:
            member.last_seen = self._clock()
            if reported_step is not None:
                member.reported_step = reported_step

    def silent_ranks(self, timeout_s: float) -> list[int]:
        """Ranks not heard from for longer than `timeout_s`."""
        now = self._clock()
        return [r for r, m in sorted(self.members.items()) if now - m.last_seen > timeout_s]

    def late_ranks(self) -> dict[int, list[int]]:
        """Ranks the open step waits for, with the buckets others already delivered."""
        if self.progress is None or self.state is not JobState.RUNNING:
            return {}
        return self.progress.late_ranks(self._ranks())

    # ---------------------------------------------------------- checkpoints
    def on_checkpoint_chunk(self, rank: int, chunk: pb.CheckpointChunk) -> list[Action]:
        """Collect rank 0's checkpoint upload; once complete, ask for it to be persisted.

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
        if chunk.total_bytes == 0:
            raise RejectedMessage(Code.INVALID_ARGUMENT, "rank 0 sent an empty checkpoint")
        if self._checkpoint_upload is None or self._checkpoint_upload[0] != chunk.step:
            what = f"checkpoint of step {chunk.step} from rank 0"
            limit = self._budget.limit
            self._checkpoint_upload = (
                chunk.step,
                BlobAssembler(what, chunk.total_bytes, self.chunk_bytes, limit),
            )
        step, assembler = self._checkpoint_upload
        if chunk.total_bytes != assembler.total_bytes:
            raise RejectedMessage(
                Code.INVALID_ARGUMENT,
                f"rank 0 changed the size of the checkpoint of step {step} from "
                f"{assembler.total_bytes} to {chunk.total_bytes} bytes mid-upload",
            )
        if not assembler.add(chunk.offset, chunk.payload):
            return []
        self._checkpoint_upload = None
        return [Persist(step, assembler.blob())]

    def status(self) -> pb.JobStatus:
        """A snapshot for `gradsync status`."""
        now = self._clock()
        late = self.late_ranks()
        return pb.JobStatus(
            job_id=self.job_id,
            state=self.state.value,
            world_size=self.world_size,
            membership_epoch=self.membership_epoch,
            open_step=self.open_step,
            steps_completed=self.steps_completed,
            members=[
                pb.MemberStatus(
                    rank=m.rank,
                    incarnation=m.incarnation,
                    peer=m.peer,
                    last_seen_s=now - m.last_seen,
                    reported_step=m.reported_step,
                )
                for _, m in sorted(self.members.items())
            ],
            late=[pb.LateRank(rank=r, bucket_indices=b) for r, b in sorted(late.items())],
            step_age_s=self.progress.age() if self.progress is not None else 0.0,
            last_checkpoint_step=self.last_checkpoint_step,
        )

    # ------------------------------------------------------- state broadcast
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
            problem = self._check_chunk(
                "state", chunk.offset, len(chunk.payload), self._state_bytes, "the state blob"
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
        others = tuple(r for r in self._ranks() if r != 0)
        return [Send(others, pb.CoordinatorMessage(state=chunk))] if others else []

    # -------------------------------------------------------------- gradients
    def on_gradient(self, rank: int, chunk: ChunkHeader, payload: memoryview) -> list[Action]:
        """Fold one gradient chunk in; return averaged chunks or a step abort."""
        if self.state is JobState.BROKEN:
            if chunk.step in self._aborted_steps:
                return []  # this rank was already told the step cannot finish
            self._aborted_steps.append(chunk.step)
            return [
                self._abort_message(
                    self._ranks(),
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
        if chunk.step < self.open_step and chunk.step in self._aborted_steps:
            return []  # late upload for a step everyone was already told is aborted
        try:
            averaged = self._accept(rank, chunk, payload)
        except RejectedMessage as rejection:
            return self._abort_open_step(rank, rejection)
        if averaged is None:
            return []
        return self._completed_chunk(chunk.bucket_index, chunk.offset, averaged)

    def _completed_chunk(self, bucket: int, offset: int, averaged: memoryview) -> list[Action]:
        """Send an averaged chunk to every live rank; close the bucket / step when done."""
        reduction = self._reductions[bucket]
        assert self._signature is not None
        reply = encode_gradient(
            ChunkHeader(
                step=self.open_step,
                membership_epoch=self.membership_epoch,
                bucket_index=bucket,
                offset=offset,
                dtype=self._signature.buckets[bucket].dtype,
                contributors=reduction.last_contributors,
            ),
            averaged,
        )
        actions: list[Action] = [Send(self._ranks(), reply)]
        if reduction.complete:
            self._buckets_done += 1
            if self._metrics is not None and self.progress is not None:
                sent = self._bucket_bytes[bucket] * len(self.members)
                self._metrics.observe_bucket_done(self.progress.bucket_age(bucket), sent)
            if self._buckets_done == len(self._bucket_bytes):
                if self._metrics is not None and self.progress is not None:
                    self._metrics.observe_step_done(self.progress.age(), self.open_step)
                self._advance_step()
                self.steps_completed += 1
        return actions

    def _accept(self, rank: int, chunk: ChunkHeader, payload: memoryview) -> memoryview | None:
        """Validate `chunk` against the job, then fold it into its reduction."""
        step = chunk.step
        # A step begun before a membership change may finish in the old epoch.
        if not self._step_start_epoch <= chunk.membership_epoch <= self.membership_epoch:
            raise RejectedMessage(
                Code.FAILED_PRECONDITION,
                f"rank {rank} sent step {step} for membership epoch {chunk.membership_epoch}, "
                f"expected epoch {self.membership_epoch}",
                step=step,
            )
        if rank not in self.members:
            raise RejectedMessage(
                Code.FAILED_PRECONDITION,
                f"rank {rank} sent step {step} but is not a member of job '{self.job_id}' "
                f"(epoch {self.membership_epoch}); it must rejoin first",
                step=step,
            )
        if step != self.open_step:
            kind = "stale" if step < self.open_step else "future"
            raise RejectedMessage(
                Code.FAILED_PRECONDITION,
                f"rank {rank} sent {kind} step {step} (bucket {chunk.bucket_index}), "
                f"expected step {self.open_step}",
                step=step,
                bucket_index=chunk.bucket_index,
            )
        bucket = chunk.bucket_index
        if bucket >= len(self._bucket_bytes):
            raise RejectedMessage(
                Code.INVALID_ARGUMENT,
                f"rank {rank} sent bucket {bucket} for step {step}, but the model has "
                f"{len(self._bucket_bytes)} buckets (0..{len(self._bucket_bytes) - 1})",
                step=step,
            )
        assert self._signature is not None
        expected_dtype = self._signature.buckets[bucket].dtype
        if chunk.dtype != expected_dtype:
            raise RejectedMessage(
                Code.INVALID_ARGUMENT,
                f"rank {rank} sent bucket {bucket} of step {step} as "
                f"{dtypes.dtype_name(chunk.dtype)}, expected {dtypes.dtype_name(expected_dtype)}",
                step=step,
                bucket_index=bucket,
            )
        if chunk.encoding != pb.ENCODING_RAW:
            raise RejectedMessage(
                Code.INVALID_ARGUMENT,
                f"rank {rank} sent bucket {bucket} of step {step} with encoding "
                f"{chunk.encoding}, this coordinator only accepts raw (0)",
                step=step,
                bucket_index=bucket,
            )
        problem = self._check_chunk(
            f"bucket {bucket} of step {step}",
            chunk.offset,
            len(payload),
            self._bucket_bytes[bucket],
            f"bucket {bucket}",
            rank=rank,
        )
        if problem is not None:
            raise RejectedMessage(problem[0], problem[1], step=step, bucket_index=bucket)
        if not self._budget.fits(len(payload)):
            raise RejectedMessage(
                Code.RESOURCE_EXHAUSTED,
                f"rank {rank} sent {len(payload)} bytes for bucket {bucket} of step "
                f"{step}, but the coordinator already buffers {self._budget.used} bytes "
                f"(limit {self._budget.limit} bytes, --max-buffered-mb)",
                step=step,
                bucket_index=bucket,
            )
        reduction = self._reductions.get(bucket)
        if reduction is None:
            reduction = self._reductions[bucket] = BucketReduction(
                self._ranks(), expected_dtype, self._bucket_bytes[bucket], self.chunk_bytes
            )
        before = reduction.buffered_bytes
        try:
            averaged = reduction.add(rank, chunk.offset, payload)
        except DuplicateContributionError:
            raise RejectedMessage(
                Code.INVALID_ARGUMENT,
                f"rank {rank} sent the chunk at offset {chunk.offset} of bucket {bucket} "
                f"twice for step {step}",
                step=step,
                bucket_index=bucket,
            ) from None
        self._budget.adjust(reduction.buffered_bytes - before)
        assert self.progress is not None
        lag = self.progress.record(rank, bucket)
        if lag is not None and self._metrics is not None:
            self._metrics.observe_bucket_arrival(rank, lag)
        return averaged

    def _check_chunk(
        self,
        what: str,
        offset: int,
        length: int,
        total: int,
        container: str,
        rank: int = 0,
    ) -> tuple[Code, str] | None:
        if length > self.chunk_bytes:
            return (
                Code.RESOURCE_EXHAUSTED,
                f"rank {rank} sent {length} bytes in one chunk of {what}; "
                f"the chunk limit is {self.chunk_bytes} bytes",
            )
        if offset % self.chunk_bytes or offset >= total:
            return (
                Code.INVALID_ARGUMENT,
                f"rank {rank} sent {what} at offset {offset}; offsets must be multiples of "
                f"{self.chunk_bytes} below {total} ({container} has {total} bytes)",
            )
        expected = chunking.expected_chunk_length(total, self.chunk_bytes, offset)
        if length != expected:
            return (
                Code.INVALID_ARGUMENT,
                f"rank {rank} sent {length} bytes for {what} at offset {offset}, "
                f"expected {expected} ({container} has {total} bytes)",
            )
        return None

    def _advance_step(self) -> None:
        self._reductions.clear()
        self._buckets_done = 0
        self.open_step += 1
        self._step_start_epoch = self.membership_epoch
        if self.progress is not None:
            self.progress.reset()

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
        return self._abort_open_step(rank, rejection)

    def reject(self, culprit: int, rejection: RejectedMessage) -> list[Action]:
        """Abort the open step because `culprit` sent an unusable message."""
        if self.state is not JobState.RUNNING:
            return [Terminate((culprit,), rejection.code, rejection.message)]
        return self._abort_open_step(culprit, rejection)

    def _abort_open_step(self, culprit: int, rejection: RejectedMessage) -> list[Action]:
        """Abandon the open step: free its buffers and tell every rank why."""
        step = self.open_step
        for reduction in self._reductions.values():
            self._budget.adjust(-reduction.buffered_bytes)
        self._aborted_steps.append(step)
        self._advance_step()
        others = tuple(r for r in self._ranks() if r != culprit)
        actions: list[Action] = [
            self._abort_message(
                (culprit,),
                step,
                rejection.code,
                rejection.message,
                rejection.bucket_index,
                pb.ABORT_REASON_MESSAGE_REJECTED,
                culprit,
            )
        ]
        if others:
            actions.append(
                self._abort_message(
                    others,
                    step,
                    Code.ABORTED,
                    f"step {step} aborted because rank {culprit}'s message was rejected: "
                    f"{rejection.message}",
                    rejection.bucket_index,
                    pb.ABORT_REASON_PEER_MESSAGE_REJECTED,
                    culprit,
                )
            )
        return actions

    @staticmethod
    def _abort_message(
        ranks: tuple[int, ...],
        step: int,
        code: Code,
        details: str,
        bucket_index: int,
        reason: int,
        culprit: int = -1,
    ) -> Send:
        return Send(
            ranks,
            pb.CoordinatorMessage(
                step_aborted=pb.StepAborted(
                    step=step,
                    code=int(code),
                    message=details,
                    culprit_rank=culprit,
                    bucket_index=bucket_index,
                    reason=reason,  # type: ignore[arg-type]
                )
            ),
        )

    # ---------------------------------------------------------------- leaving
    def detach(self, rank: int, orderly: bool, reason: str | None = None) -> list[Action]:
        """Forget `rank`'s connection; abort the open step for the others if running.

        Args:
            rank: the departing rank.
            orderly: it said goodbye (Leave) rather than vanishing.
            reason: how it was lost, for the survivors' error (default: left /
                disconnected).
        """
        if self._newcomers.pop(rank, None) is not None:
            return []
        if self.members.pop(rank, None) is None:
            return []
        if self.state is JobState.ASSEMBLING and not self.members:
            self._signature = None
            self._reference_rank = None
        elif self.state is JobState.ASSEMBLING and rank == self._reference_rank:
            first = min(self.members)
            self._signature = self.members[first].signature
            self._reference_rank = first
        if self.state is not JobState.RUNNING:
            return []
        how = reason or ("left" if orderly else "disconnected from")
        if self.on_failure == "elastic" and len(self.members) >= self.min_workers:
            return self._shrink(rank, f"rank {rank} {how} job '{self.job_id}'")
        if self.on_failure == "elastic":
            how += f" leaving {len(self.members)} ranks (--min-workers {self.min_workers}) in"
        self._broken_reason = (
            f"rank {rank} {how} job '{self.job_id}' at step {self.open_step}; "
            "no partial average is applied and the remaining ranks cannot complete "
            "further steps"
        )
        if self.progress is not None:
            self.progress.reset()
        self.state = JobState.BROKEN
        step = self.open_step
        for reduction in self._reductions.values():
            self._budget.adjust(-reduction.buffered_bytes)
        self._reductions.clear()
        self._aborted_steps.append(step)
        if not self.members:
            return []
        return [
            self._abort_message(
                self._ranks(),
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
        for reduction in self._reductions.values():
            self._budget.adjust(-reduction.buffered_bytes)
        self._reductions.clear()
        return [Terminate(self._ranks(), code, details)]

    def _ranks(self) -> tuple[int, ...]:
        return tuple(sorted(self.members))

    def joined_ranks(self) -> Sequence[int]:
        """Ranks currently connected, ascending."""
        return self._ranks()
