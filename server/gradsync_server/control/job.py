"""One training job's lifecycle: the state machine over its owned components (pure logic).

The servicer hands every parsed message to a `Job` and carries out the
actions it returns: `Send` a message to some ranks, `Terminate` their
streams with a status code, or `Persist` a checkpoint. Keeping this free of
gRPC and asyncio lets the whole protocol be unit-tested by calling methods.

A job is a small composition, each part owning its own state:

- `Membership` (`membership.py`): members, rejoining newcomers, signature, epoch;
- `JobPlane` (`dataplane/plane.py`): the job's data plane for byte range 0: the
  open step, its reductions and aborts, following the job's control events;
- `Liveness` (`liveness.py`): when each rank was last heard from;
- `Persistence` (`persistence.py`): checkpoint uploads and the resume point;
- `Assembly` (`assembly.py`): who is missing while the job assembles;
- `StateBroadcast` (`assembly.py`): rank 0's initial state broadcast;
- `Collectives` (`collectives.py`): collectives on user tensors;
- `UnevenInputs` (`uneven.py`) and `Elastic` (`elastic.py`): DDP's join(), lost ranks.

Every change the data planes must follow is decided here and applied through
`ControlEvents` (`events.py`): to this job's own plane at once, and queued
for the shards (`take_events`).

The lifecycle::

    ASSEMBLING --(all ranks joined, signatures match)--> RUNNING
    ASSEMBLING / RUNNING --(signature mismatch, bad state broadcast)--> REFUSED
    RUNNING --(a rank leaves with nothing in flight)--> FINISHING (the others leave too)
    RUNNING --(a rank disconnects, or leaves mid-step; abort policy)--> BROKEN
    ASSEMBLING / RUNNING --(a coordinator shard was lost)--> BROKEN (every stream ends)

A sharded job also waits, complete, until every coordinator shard is
registered (`shard_map` is None until then): no worker may upload a range
that no shard aggregates.

While the job assembles, a waiting rank that goes silent or whose stream
closes is dropped (not a job failure; it may join again). Once assembled, a
rank lost before the state broadcast completes fails the others at once. A
message that breaks the rules aborts the open step (nothing is averaged),
every rank is told why in-band, and the job carries on at the next step.
"""

from __future__ import annotations

import enum
import logging
import time
from collections.abc import Callable
from typing import cast

from gradsync_proto.codec import ChunkHeader
from gradsync_proto.codes import Code
from gradsync_proto.v1 import gradsync_pb2 as pb

from gradsync_server.control import outer_resume, restart, signature as signatures
from gradsync_server.control.assembly import Assembly, StateBroadcast
from gradsync_server.control.collectives import Collectives
from gradsync_server.control.elastic import Elastic
from gradsync_server.control.events import ControlEvents
from gradsync_server.control.liveness import Liveness
from gradsync_server.control.membership import Membership
from gradsync_server.control.persistence import Persistence
from gradsync_server.control.settings import JobSettings, OnFailure
from gradsync_server.control.uneven import UnevenInputs
from gradsync_server.dataplane import rounds
from gradsync_server.dataplane.actions import Action, Member, ResumeBlob, Send, Terminate
from gradsync_server.dataplane.budget import ByteBudget
from gradsync_server.dataplane.observer import StepObserver
from gradsync_server.dataplane.plane import JobPlane
from gradsync_server.dataplane.step_aborts import abort_actions, abort_message
from gradsync_server.errors import RejectedMessage
from gradsync_server.text import quoted

log = logging.getLogger("gradsync.server")

__all__ = ["Job", "JobState"]


class JobState(enum.Enum):
    """Where a job is in its lifecycle."""

    ASSEMBLING = "assembling"
    RUNNING = "running"
    FINISHING = "finishing"
    REFUSED = "refused"
    BROKEN = "broken"


class Job:
    """Membership, validation and aggregation for one job id.

    Args:
        job_id: the job's name.
        settings: sizes and policies (`JobSettings`, from the coordinator's flags).
        budget: coordinator-wide cap on buffered gradient bytes.
        clock: monotonic time source (injectable for tests).
        metrics: where latencies go, if anywhere.
        shard_map: the coordinator's shards for Welcome ([] unsharded), None while
            some shard is missing (the job then waits, assembled, for it).
        payload_endpoint: (abstract socket name, the coordinator's host id) of the
            same-host payload path, or None when it is off: a local leader whose
            Join.host_id equals that id is told the socket in its Welcome (unsharded only).
    """

    def __init__(
        self,
        job_id: str,
        settings: JobSettings,
        budget: ByteBudget,
        clock: Callable[[], float] = time.monotonic,
        metrics: StepObserver | None = None,
        shard_map: Callable[[], list[pb.ShardAddress] | None] = list,
        payload_endpoint: tuple[str, str] | None = None,
    ) -> None:
        self.job_id = job_id
        self.settings = settings
        self.payload_endpoint = payload_endpoint
        # Every part of the job counts its bytes under this job's share of the budget.
        job_budget = budget.for_owner(job_id)
        blob_limit = settings.max_checkpoint_bytes
        blob_limit = budget.limit if blob_limit is None else blob_limit
        self.world_size = world_size = settings.world_size
        self.chunk_bytes = chunk_bytes = settings.chunk_bytes
        shard_count = settings.shard_count
        self.membership = Membership(job_id, world_size, clock, settings.screen)
        #: This job's data plane for byte range 0 (the whole bucket when unsharded).
        self.plane = JobPlane(
            job_id,
            chunk_bytes,
            shard_count,
            job_budget,
            clock,
            metrics,
            nonfinite=settings.nonfinite,
        )
        #: The open step of `plane` (read by status, liveness and the components).
        self.in_flight = self.plane.step
        self._shard_count = shard_count
        #: Applies the job's decisions to `plane` and queues them for the shards.
        self.events = ControlEvents(job_id, self.plane, shard_count)
        self.liveness = Liveness(clock)
        #: Told of restarts (the coordinator's metrics), if anyone is.
        self.observer = metrics
        self.persistence = Persistence(chunk_bytes, blob_limit, job_budget)
        self.job_budget, self.blob_limit = job_budget, blob_limit
        #: A restarted job's donor state on its way to the ranks behind (`control.restart`).
        self.relay: restart.RestartRelay | None = None
        #: How a restarted coordinator went on (continued, or rolled back and why).
        self.restart_line = ""
        #: Steps the ranks had applied beyond where a restarted job went on (summed).
        self.steps_recomputed = 0
        #: The store's outer-state records of this job, one per plane, and the leader's
        #: mark, read before it assembled; None = not read (`control.outer_resume`).
        self.outer_reading: outer_resume.OuterReading | None = None
        #: Save the outer state after every step that changed it (a store is configured).
        self.persist_outer = False
        #: How the outer state started: restored from the store or reseeded, and why.
        self.outer_state = ""
        #: Restored with the shards one step apart: the ranks upload the open step again.
        self.outer_repeat = False
        self.assembly = Assembly(job_id, world_size, clock, settings.heartbeat_interval_s)
        self.broadcast = StateBroadcast(chunk_bytes)
        self.collectives = Collectives(
            world_size, chunk_bytes, settings.max_collective_bytes, job_budget, metrics, clock
        )
        self.uneven = UnevenInputs(self.membership, self.in_flight, self.collectives, self._publish)
        self.elastic = Elastic(
            job_id,
            self.membership,
            self.in_flight,
            self._publish,
            self.collectives,
            chunk_bytes,
            blob_limit,
            self._welcome_message,
            job_budget,
        )
        self.state = JobState.ASSEMBLING
        self._broken_reason = ""
        self._shard_map = shard_map
        #: The shards this job runs over (from `shard_map` when it starts; [] unsharded).
        self.shards: list[pb.ShardAddress] = []

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

    def outcome(self) -> tuple[str, str]:
        """How the job ended (once its last rank is gone): a state word and a sentence."""
        if self.state is JobState.ASSEMBLING:
            return "abandoned", "abandoned: every waiting rank left before the job assembled"
        if self.state in (JobState.BROKEN, JobState.REFUSED):
            return self.state.value, self._broken_reason
        return "finished", f"finished after {self.steps_completed} steps"

    def _progress(self, refused: str = "") -> Send:
        """An AssemblyProgress for every waiting rank (as they join, and as they leave)."""
        ranks = self.membership.ranks()
        return Send(ranks, self.assembly.progress(ranks, refused))

    def welcome_for(self, rank: int, resume_bytes: int = 0) -> Send:
        """`rank`'s own Welcome: the job's, plus what was issued to that rank alone."""
        message = self._welcome_message(resume_bytes)
        endpoint = None if self.shards else self.payload_endpoint
        self.membership.welcome(rank, message, endpoint)
        return Send((rank,), message)

    def _welcome_message(self, resume_bytes: int = 0) -> pb.CoordinatorMessage:
        """The Welcome of this job as it stands (for assembly and for newcomers).

        Without a local group: a rank rejoining a running job aggregates flat (v1).
        """
        return pb.CoordinatorMessage(
            welcome=pb.Welcome(
                job_id=self.job_id,
                world_size=self.world_size,
                membership_epoch=self.membership_epoch,
                start_step=self.open_step,
                chunk_bytes=self.chunk_bytes,
                max_message_bytes=self.settings.max_message_bytes,
                state_bytes=self.broadcast.state_bytes,
                resume_bytes=resume_bytes,
                heartbeat_interval_s=self.settings.heartbeat_interval_s,
                checkpoint_every_steps=self.settings.checkpoint_every,
                next_collective=self.collectives.next_sequence,
                shards=self.shards,
                outer_seeded=self.in_flight.outer.active and self.in_flight.outer.seeded,
                outer_replay=self.in_flight.outer.replaying and not self.outer_repeat,
                outer_repeat=self.outer_repeat and self.in_flight.steps_completed == 0,
            )
        )

    # ------------------------------------------------------------ control events
    def take_events(self) -> list[pb.LeaderMessage]:
        """The control events decided since the last call, for the shards (`ControlEvents.take`)."""
        return self.events.take()

    def end_event(self) -> pb.LeaderMessage:
        """The ShardJobEnd of this job once it left the coordinator: its outcome as a status."""
        state, outcome = self.outcome()
        end = pb.ShardJobEnd(job_id=self.job_id, code=int(Code.OK), message=outcome)
        if state not in ("finished", "abandoned"):
            end.code = int(Code.ABORTED)
            end.message = f"job '{self.job_id}' ended at the leader ({state}): {outcome}"
        return pb.LeaderMessage(job_end=end)

    def _view(self, start_step: int | None = None) -> pb.ShardJobView:
        """The job as its data planes know it (`Membership.view`), from the open step."""
        step = self.open_step if start_step is None else start_step
        uneven, shards = self.uneven.out_of_inputs, self._shard_count
        return self.membership.view(step, uneven, self.chunk_bytes, shards)

    def _publish(self) -> list[Action]:
        """The membership changed: its planes follow (`ControlEvents.follow`)."""
        return self.events.follow(self._view())

    # ---------------------------------------------------------------------- join
    def join(self, rank: int, join: pb.Join) -> list[Action]:
        """Admit `rank`; return the Welcome broadcast once all ranks are in.

        Raises:
            RejectedMessage: this worker alone is refused (its stream ends).
        """
        self.membership.check_join(rank, join)
        if self.state is JobState.RUNNING and self.settings.on_failure is OnFailure.ELASTIC:
            self.membership.admit_newcomer(rank, join)
            self.liveness.start(rank)
            return [] if self.elastic.healing else self.elastic.request_heal()
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
            details = f"job '{self.job_id}' refused: model signatures differ: {difference}"
            refused = self._progress(refused=f"rank {rank}: {details}")
            return [refused, *self._refuse(Code.INVALID_ARGUMENT, details)]
        if not self.membership.complete():
            return [self._progress()]
        return self.start_if_ready()

    def start_if_ready(self) -> list[Action]:
        """Start an assembled job once every coordinator shard is registered."""
        if self.state is not JobState.ASSEMBLING or not self.membership.complete():
            return []
        shards = self._shard_map()
        if shards is None:
            return [self._progress()]  # complete, but a shard is missing: keep waiting
        self.shards = shards
        return self._start()

    def refused_join(self, rank: int, reason: str) -> list[Action]:
        """Tell the waiting ranks that `rank` was refused at join, and why."""
        if self.state is not JobState.ASSEMBLING or not self.members:
            return []
        return [self._progress(refused=f"rank {rank}: {reason}")]

    def assembly_report(self) -> tuple[list[Action], str] | None:
        """Every ~10 s while assembling: progress for the waiting ranks and a log line."""
        if self.state is not JobState.ASSEMBLING or not self.members:
            return None
        if not self.assembly.report_due():
            return None
        line = self.assembly.describe(self.membership.ranks())
        return [self._progress()], line

    def _start(self) -> list[Action]:
        signature = self.membership.signature
        if signature is None:
            raise RuntimeError("an assembled job always has a signature")
        refused = self.membership.form_local_groups()
        if refused is not None:
            return self._refuse(Code.FAILED_PRECONDITION, refused)
        optimizer = self.membership.resolved_outer()  # with the screen it runs under
        groups = bool(self.membership.groups.groups())
        problem = rounds.job_problem(optimizer, self.world_size, self._shard_count, groups)
        if problem is not None:
            return self._refuse(Code.FAILED_PRECONDITION, f"job '{self.job_id}' refused: {problem}")
        self.state = JobState.RUNNING
        self.collectives.start(self.job_id, self.members)
        resume = self.persistence.resume
        resume_step = resume.step if resume is not None else None
        decision = self._restart_decision(optimizer is None, resume_step)
        if isinstance(decision, restart.Continue):  # the ranks' own state stands: no broadcast
            self.broadcast.start(0, needed=False)
        else:
            needed = resume is None and self.world_size > 1
            self.broadcast.start(signatures.state_bytes(signature), needed=needed)
        if resume is not None:
            self.membership.epoch = resume.membership_epoch  # goes on in the checkpoint's epoch
            self.persistence.saved(resume.step)
        if isinstance(decision, restart.Continue):
            if self.observer is not None:
                self.observer.observe_restart(True, 0)
            return self._continue(decision)
        outer = outer_resume.decide(
            self.job_id, signature, self._shard_count, self.outer_reading, resume_step
        )
        if outer is not None and outer.refusal is not None:
            return self._refuse(Code.FAILED_PRECONDITION, outer.refusal)
        restored = outer is not None and outer.snapshot is not None
        start = outer.start_step if outer is not None and restored else resume_step or 0
        view = self._view(start)
        view.outer_restore = restored
        if outer is not None:
            view.outer_run = outer.run
        self.events.start(view)
        if outer is not None:
            self._start_outer(outer)
        ranks = self.membership.ranks()
        self.steps_recomputed = restart.steps_recomputed(decision, start)
        if decision is not None and self.observer is not None:
            self.observer.observe_restart(False, self.steps_recomputed)
        resume_bytes = len(resume.payload) if resume is not None else 0
        actions: list[Action] = [self.welcome_for(rank, resume_bytes) for rank in ranks]
        if resume is not None:
            actions.append(Send(ranks, ResumeBlob(resume.step, resume.payload, self.chunk_bytes)))
        return actions

    def _restart_decision(
        self, per_step: bool, checkpoint_step: int | None
    ) -> restart.Decision | None:
        """A restarted coordinator: continue from the ranks' positions, or fall back (logged)."""
        if not per_step:  # DiLoCo: the outer state's own records decide (`outer_resume`)
            return None
        positions = {rank: member.position for rank, member in self.members.items()}
        decision = restart.decide(self.job_id, positions, checkpoint_step)
        if decision is not None:
            self.restart_line = decision.line
            log.warning("%s", self.restart_line)
        return decision

    def _continue(self, plan: restart.Continue) -> list[Action]:
        """Go on at the ranks' step: the donor first; the others once its state is here."""
        self.events.start(self._view(plan.step))
        if not plan.behind:
            return [self._continued_welcome(rank) for rank in self.membership.ranks()]
        self.relay = restart.RestartRelay(
            self.job_id,
            plan,
            self._continued_welcome,
            self.chunk_bytes,
            self.blob_limit,
            self.job_budget,
        )
        return [self._continued_welcome(plan.donor, send_state=True)]

    def _continued_welcome(
        self, rank: int, resume_bytes: int = 0, send_state: bool = False
    ) -> Send:
        """`rank`'s Welcome into a continued job (its own state stands unless resume bytes)."""
        send = self.welcome_for(rank, resume_bytes)
        welcome = cast(pb.CoordinatorMessage, send.message).welcome
        welcome.restart = self.restart_line
        welcome.continued = resume_bytes == 0
        welcome.send_state = send_state
        return send

    def _start_outer(self, outer: outer_resume.OuterResume) -> None:
        """Restore the plane's outer state (or not), say which, and start saving it."""
        self.outer_state = outer.line
        self.outer_repeat = outer.repeat
        self.in_flight.outer.run = outer.run
        if outer.finding is not None:
            log.error("%s", outer.finding)
        if outer.snapshot is not None:
            self.in_flight.outer.restore(outer.snapshot, outer.replay)
            log.warning("job '%s': outer state %s", self.job_id, outer.line)
        else:
            log.info("job '%s': outer state %s", self.job_id, outer.line)
        self.in_flight.outer.persist = self.persist_outer

    # ------------------------------------------------------------------ liveness
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
        if chunk.heal and self.relay is not None:
            actions = self.relay.add(rank, chunk, self.members)
            if actions is None:
                return []
            self.relay = None  # the donor's state went to the ranks behind
            return actions
        if chunk.heal and self.state is JobState.RUNNING:
            return self.elastic.on_heal_chunk(rank, chunk)
        if self.state is not JobState.RUNNING or rank != 0:
            raise RejectedMessage(
                Code.FAILED_PRECONDITION if rank == 0 else Code.INVALID_ARGUMENT,
                f"rank {rank} sent a checkpoint chunk for step {chunk.step}; only rank 0 of a "
                f"running job uploads checkpoints (job is {self.state.value})",
            )
        if chunk.step > self.open_step:
            # A checkpoint names the next step to run; one ahead of what the job reached
            # would make every rank of the next start skip steps nobody trained.
            raise RejectedMessage(
                Code.INVALID_ARGUMENT,
                f"rank 0 of job '{self.job_id}' sent a checkpoint of step {chunk.step}, ahead "
                f"of step {self.open_step}, the newest step the coordinator has seen",
            )
        persist = self.persistence.on_upload_chunk(chunk)
        return [] if persist is None else [persist]

    # ----------------------------------------------------------- state broadcast
    def on_state_chunk(self, rank: int, chunk: pb.StateChunk) -> list[Action]:
        """Relay a chunk of rank 0's parameters and buffers to the other ranks."""
        joined = f" ({len(self.members)}/{self.world_size} joined)"
        self._require_running(f"rank {rank} sent state", joined)
        problem = self.broadcast.accept(rank, chunk)
        if problem is not None:
            code, details = problem
            return self._refuse(code, f"state broadcast failed: {details}")
        others = tuple(r for r in self.membership.ranks() if r != 0)
        return [Send(others, pb.CoordinatorMessage(state=chunk))] if others else []

    # ----------------------------------------------------------------- gradients
    def on_gradient(self, rank: int, chunk: ChunkHeader, payload: memoryview) -> list[Action]:
        """Fold one gradient chunk in; return averaged chunks or a step abort."""
        if self.state in (JobState.BROKEN, JobState.FINISHING):
            return self._abort_in_ended_job(chunk.step)
        if self.state is not JobState.RUNNING:
            raise RejectedMessage(
                Code.FAILED_PRECONDITION,
                f"rank {rank} sent gradients for step {chunk.step} before job "
                f"'{self.job_id}' was assembled ({len(self.members)}/{self.world_size} joined)",
            )
        completed = self.steps_completed
        try:
            actions = self.plane.accept(rank, chunk, payload)
        except RejectedMessage as rejection:
            return self.events.abort(rank, rejection)
        return actions + self.uneven.progress(completed)

    def _abort_in_ended_job(self, step: int) -> list[Action]:
        """`step` arrived after the job broke or began finishing: every rank is told, once."""
        if self.in_flight.was_aborted(step):
            return []  # the ranks were already told the step cannot finish
        self.in_flight.remember_aborted(step)
        self.events.aborted(step)
        reason = self._broken_reason
        ranks = self.membership.ranks()
        return [abort_message(ranks, step, Code.ABORTED, reason, -1, pb.ABORT_REASON_PEER_LOST)]

    def close_round_if_due(self) -> list[Action]:
        """DiLoCo partial rounds: close the open round at its deadline (the watchdog's tick)."""
        if self.state is not JobState.RUNNING:
            return []
        completed = self.steps_completed
        return self.in_flight.close_round_if_due() + self.uneven.progress(completed)

    # ------------------------------------------------------ collectives, join()
    def on_collective(self, rank: int, chunk: pb.CollectiveChunk) -> list[Action]:
        """Take one chunk of a collective's input; return the result once all are in.

        Raises:
            RejectedMessage: the chunk is malformed or disagrees (this worker's stream ends).
        """
        if self.state in (JobState.BROKEN, JobState.FINISHING):
            return [Terminate((rank,), Code.ABORTED, self._broken_reason, pb.END_REASON_PEER_LOST)]
        self._require_running(f"rank {rank} sent collective {chunk.sequence}")
        return self.collectives.accept(rank, chunk, self.in_flight.participants())

    def on_out_of_inputs(self, rank: int, message: pb.OutOfInputs) -> list[Action]:
        """`rank` ran out of inputs (join()); see `gradsync_server.control.uneven`.

        Raises:
            RejectedMessage: not at the job's open step, or twice (this worker's stream ends).
        """
        self._require_running(f"rank {rank} ran out of inputs (join())")
        return self.uneven.run_out(rank, message)

    def _require_running(self, what: str, details: str = "") -> None:
        """Refuse `what` (FAILED_PRECONDITION) unless the job is running."""
        if self.state is not JobState.RUNNING:
            message = f"{what} while job '{self.job_id}' is {self.state.value}{details}"
            raise RejectedMessage(Code.FAILED_PRECONDITION, message)

    def on_local_posted(self, rank: int, posted: pb.LocalPosted) -> list[Action]:
        """A local group's member has `posted.bucket_index` ready: its delivery, for
        lateness (`StepProgress.record_posted`). Advisory: another step is ignored. In a
        job a peer left between steps it is answered as a gradient would be (the step's
        abort naming the peer): a leader waiting for that peer's share uploads nothing;
        a notice for a step that completed (it can trail the step's average) is ignored.

        Raises:
            RejectedMessage: from a flat rank, or naming a bucket the model lacks.
        """
        self.membership.check_posted(rank, posted)
        if self.state in (JobState.BROKEN, JobState.FINISHING):
            # A step below the open one completed: the member posted into shared memory
            # before it told us, so its notice can trail its own average (and a peer's
            # orderly Leave). Aborting that step would fail a rank whose step succeeded.
            if posted.step < self.in_flight.step:
                return []
            return self._abort_in_ended_job(posted.step)
        if self.state is JobState.RUNNING and posted.step == self.in_flight.step:
            self.in_flight.record_posted(rank, posted.bucket_index)
        return []

    def on_abandon(self, rank: int, abandon: pb.AbandonStep) -> list[Action]:
        """A rank gave up on a step it started: abort it for everyone (if still open)."""
        if self.state is not JobState.RUNNING or abandon.step != self.open_step:
            return []  # already complete or aborted: nothing to undo
        reason = quoted(abandon.reason) or "no reason given"  # capped: relayed to every rank
        rejection = RejectedMessage(
            Code.ABORTED,
            f"rank {rank} abandoned step {abandon.step}: {reason}",
            step=abandon.step,
        )
        return self.events.abort(rank, rejection)

    def reject(self, culprit: int, rejection: RejectedMessage) -> list[Action]:
        """Abort the open step because `culprit` sent an unusable message."""
        if self.state is not JobState.RUNNING:
            return [Terminate((culprit,), rejection.code, rejection.message)]
        return self.events.abort(culprit, rejection)

    def reject_from_shard(self, rank: int, rejection: RejectedMessage) -> list[Action] | None:
        """A shard refused `rank`'s message for `rejection.step`: abort that step for every rank.

        The open step here may already be the next one: range 0 of the step
        completed while the shard's cannot, and the workers still wait for the
        shard's averages, so that step is aborted all the same (this plane keeps
        its own step). None when there is nothing to abort: the job is not
        running, the rank is not a member, or the step was aborted already.
        """
        step = rejection.step
        if self.state is not JobState.RUNNING or rank not in self.members or step is None:
            return None
        if step == self.open_step:
            return self.reject(rank, rejection)
        if step + 1 != self.open_step or self.in_flight.was_aborted(step):
            return None
        self.in_flight.abort_completed(step)
        self.events.aborted(step)
        return abort_actions(self.membership.ranks(), rank, step, rejection)

    # ---------------------------------------------------------------- departures
    def detach(self, rank: int, orderly: bool, reason: str | None = None) -> list[Action]:
        """Forget `rank`'s connection; abort the open step for the others if running.

        Args:
            rank: the departing rank.
            orderly: it said goodbye (Leave) rather than vanishing.
            reason: how it was lost, for the survivors' error (default: left /
                disconnected).
        """
        self.liveness.forget(rank)
        if rank == 0:
            self.persistence.abandon_upload()  # nobody finishes rank 0's checkpoint upload
        assembling = self.state is JobState.ASSEMBLING
        if not self.membership.remove(rank, assembling=assembling):
            return []
        if assembling and not self.membership.members:
            self.assembly.started_at = None  # whoever joins next starts a new wait
        if assembling:
            return [self._progress()] if self.membership.members else []
        if self.state is not JobState.RUNNING:
            return []
        how = reason or ("left" if orderly else "disconnected from")
        if self.relay is not None:
            # Half the ranks are welcomed, the others wait for a state that may never
            # come: every stream ends, and the job decides again when they reconnect.
            details, self.relay = self.relay.lost(rank, how), None
            return self.end(Code.UNAVAILABLE, details, pb.END_REASON_PEER_LOST)
        if not self.broadcast.complete:
            # The others wait for rank 0's state, not for a step: end them now.
            return self._break(
                f"rank {rank} {how} job '{self.job_id}' before rank 0's initial state "
                "broadcast completed; the job cannot start (restart every rank)",
                rank,
                abort_step=False,
            )
        quiet = not self.in_flight.has_contributions() and not self.collectives.open_sequences()
        # A local leader's followers cannot go on without it: their gradients went through it.
        followers = tuple(
            r for r in self.membership.groups.followers_of(rank) if r in self.membership.members
        )
        live = len(self.membership.members) - len(followers)
        elastic = (
            self.settings.on_failure is OnFailure.ELASTIC and live >= self.settings.min_workers
        )
        if orderly and quiet and not elastic:
            # A normal finish: nobody is told anything now; a rank that still
            # sends a step or a collective gets this reason then.
            reason = (
                f"rank {rank} left job '{self.job_id}' after step {self.in_flight.step - 1}; "
                "the remaining ranks cannot complete further steps"
            )
            self._stop(JobState.FINISHING, reason, aborted=False)
            return []
        if elastic:
            actions = self.elastic.shrink(rank, how, followers)
            for lost in (rank, *followers):
                self.liveness.forget(lost)
                actions += self.uneven.lost(lost)
            return actions
        if self.settings.on_failure is OnFailure.ELASTIC:
            left = len(self.membership.members)
            how += f" leaving {left} ranks (--min-workers {self.settings.min_workers}) in"
        return self._break(
            f"rank {rank} {how} job '{self.job_id}' at step {self.in_flight.step}; no partial "
            "average is applied and the remaining ranks cannot complete further steps",
            rank,
            abort_step=True,
        )

    def _break(self, reason: str, lost: int, abort_step: bool) -> list[Action]:
        """The job cannot go on: abort the open step in-band, end ranks that cannot hear it.

        Ranks waiting in a collective (or, without `abort_step`, for the state
        broadcast) have no step to abort: their streams end with PEER_LOST.
        """
        step = self.in_flight.step
        ranks = self.membership.ranks()
        waiting = self.collectives.waiting_ranks() if abort_step else ranks
        self._stop(JobState.BROKEN, reason)
        actions: list[Action] = []
        if abort_step and ranks:
            actions.append(
                abort_message(
                    ranks, step, Code.ABORTED, reason, -1, pb.ABORT_REASON_PEER_LOST, lost
                )
            )
            self.events.aborted(step)
        waiting = tuple(r for r in waiting if r in self.membership.members)
        if waiting:
            actions.append(Terminate(waiting, Code.ABORTED, reason, pb.END_REASON_PEER_LOST))
        return actions

    def end(
        self, code: Code, details: str, reason: pb.EndReason, state: JobState = JobState.BROKEN
    ) -> list[Action]:
        """End the job (refused, or from outside: a coordinator shard was lost); streams end now."""
        self._stop(state, details)
        ranks = sorted({*self.membership.ranks(), *self.membership.newcomers})
        return [Terminate(tuple(ranks), code, details, reason)]

    def _stop(self, state: JobState, reason: str, aborted: bool = True) -> None:
        """The job cannot go on: free what it buffers; its open step will never complete
        (and, `aborted`, the ranks were told so: a late chunk of it is not answered again)."""
        self.state = state
        self._broken_reason = reason
        self.in_flight.release()
        self.release_uploads()
        if aborted:
            self.in_flight.remember_aborted(self.in_flight.step)
        self.collectives.release()

    def end_for_shard_loss(self, index: int, address: str, why: str) -> list[Action]:
        """Shard `index` at `address` was lost: end every stream, UNAVAILABLE, SHARD_LOST.

        A range of every bucket went with it, so nothing can complete; the
        workers reconnect and the job resumes once every shard is back. How it resumes
        is the restart decision's (`control/restart.py`), made when the ranks rejoin:
        from their own state when they agree on it, else from the checkpoint. The line
        says both, not a rollback that usually does not happen.
        """
        checkpoint = self.persistence.last_checkpoint_step
        step = self.in_flight.step
        if self.state is JobState.ASSEMBLING:
            then = f"job '{self.job_id}' starts once every shard is registered again"
        else:
            fallback = (
                f"from its last checkpoint (step {checkpoint})"
                if checkpoint >= 0
                else "from the beginning (it has no checkpoint)"
            )
            then = (
                f"job '{self.job_id}' stops at step {step}; once every shard is registered "
                "again it goes on from the ranks' own state if they agree on it, else "
                f"{fallback}"
            )
        details = f"shard {index} at {address} was lost ({why}); {then}"
        return self.end(Code.UNAVAILABLE, details, pb.END_REASON_SHARD_LOST)

    def release_uploads(self) -> None:
        """Give back the bytes of unfinished checkpoint and healing uploads (idempotent)."""
        self.persistence.abandon_upload()
        self.elastic.release()
        if self.relay is not None:
            self.relay.release()
            self.relay = None

    def _refuse(self, code: Code, details: str) -> list[Action]:
        """Refuse the whole job: every connected rank's stream ends with `code`."""
        return self.end(code, details, pb.END_REASON_JOB_REFUSED, JobState.REFUSED)
