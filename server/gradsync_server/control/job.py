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
- `StateBroadcast` (`broadcast.py`): rank 0's initial state broadcast;
- `Collectives` (`collectives.py`): collectives on user tensors;
- `UnevenInputs` (`uneven.py`) and `Elastic` (`elastic.py`): DDP's join(), lost ranks.

`Job` is written in three layers: `JobCore` (`job_core.py`) builds the parts
and owns the state and the control events, `JobEnding` (`job_ending.py`)
adds departures and endings, and this module the arrivals. The lifecycle::

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

import logging
from typing import cast

from gradsync_proto.codec import ChunkHeader
from gradsync_proto.codes import Code
from gradsync_proto.v1 import gradsync_pb2 as pb

from gradsync_server.control import outer_resume, restart, signature as signatures
from gradsync_server.control.job_core import JobState
from gradsync_server.control.job_ending import JobEnding
from gradsync_server.control.persistence import resume_messages
from gradsync_server.control.restart_relay import RestartRelay
from gradsync_server.control.settings import OnFailure
from gradsync_server.dataplane import rounds
from gradsync_server.dataplane.actions import Action, Send, Terminate
from gradsync_server.dataplane.step_aborts import abort_actions, abort_message
from gradsync_server.errors import RejectedMessage
from gradsync_server.text import quoted

log = logging.getLogger("gradsync.server")

#: `JobState` is defined with the endings that set most of them, and is part of `Job`.
__all__ = ["Job", "JobState"]


class Job(JobEnding):
    """Membership, validation and aggregation for one job id (see `JobCore` for its Args).

    The arrivals: joins, the start, checkpoints, the state broadcast,
    gradients, collectives, join() and aborts asked for by a rank.
    """

    # ---------------------------------------------------------------------- join
    def join(self, rank: int, join: pb.Join) -> list[Action]:
        """Admit `rank`; return the Welcome broadcast once all ranks are in.

        Raises:
            RejectedMessage: this worker alone is refused (its stream ends).
        """
        self.membership.check_join(rank, join)
        if self.state is JobState.RUNNING and self.on_failure is OnFailure.ELASTIC:
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
        problems = self.membership.form_local_groups()
        if problems:
            details = (
                f"job '{self.job_id}' refused: the local groups formed from Join.host_id do not "
                f"match LOCAL_WORLD_SIZE: {'; '.join(problems)} (give every process of a host "
                "the same host id, or pass hierarchical=False)"
            )
            return self._refuse(Code.FAILED_PRECONDITION, details)
        optimizer = signature.outer if signature.HasField("outer") else None
        groups = bool(self.membership.groups.groups())
        problem = rounds.job_problem(optimizer, self.world_size, self._shard_count, groups)
        if problem is not None:
            return self._refuse(Code.FAILED_PRECONDITION, f"job '{self.job_id}' refused: {problem}")
        self.state = JobState.RUNNING
        resume = self.persistence.resume
        decision = self._restart_decision(optimizer is None, resume.step if resume else None)
        if isinstance(decision, restart.Continue):
            if self.observer is not None:
                self.observer.observe_restart(True, 0)
            return self._continue(decision)
        self.broadcast.start(
            signatures.state_bytes(signature), needed=resume is None and self.world_size > 1
        )
        if resume is not None:
            self.membership.resume_epoch(resume.membership_epoch)
            self.persistence.saved(resume.step)
        outer = outer_resume.decide(
            self.job_id,
            signature,
            self._shard_count,
            self.outer_records,
            resume.step if resume is not None else None,
        )
        restored = outer.snapshot if outer is not None else None
        start = resume.step if resume else 0
        if outer is not None and restored is not None:
            start = outer.start_step
        view = self._view(start)
        view.outer_restore = restored is not None
        self.plane.start(view)
        if outer is not None:
            self._start_outer(outer)
        self._tell_shards(pb.LeaderMessage(job=view))
        ranks = self.membership.ranks()
        self.steps_recomputed = restart.steps_recomputed(decision, start)
        if decision is not None and self.observer is not None:
            self.observer.observe_restart(False, self.steps_recomputed)
        resume_bytes = len(resume.payload) if resume is not None else 0
        actions: list[Action] = [self.welcome_for(rank, resume_bytes) for rank in ranks]
        if resume is not None:
            actions += resume_messages(ranks, resume.step, resume.payload, self.chunk_bytes)
        return actions

    def _restart_decision(
        self, per_step: bool, checkpoint_step: int | None
    ) -> restart.Decision | None:
        """A restarted coordinator: continue from the ranks' positions, or fall back (logged)."""
        if not per_step:  # DiLoCo: the outer state's own records decide (`outer_resume`)
            return None
        positions = {rank: member.position for rank, member in self.members.items()}
        decision = restart.decide(self.job_id, positions, checkpoint_step)
        if decision is None:
            return None
        if isinstance(decision, restart.Fallback):
            self.restart_line = f"job '{self.job_id}' rolled back: {decision.line}"
        else:
            self.restart_line = decision.line
        log.warning("%s", self.restart_line)
        return decision

    def _continue(self, plan: restart.Continue) -> list[Action]:
        """Go on at the ranks' step: the donor first; the others once its state is here."""
        resume = self.persistence.resume
        self.broadcast.start(0, needed=False)
        if resume is not None:
            self.membership.resume_epoch(resume.membership_epoch)
            self.persistence.saved(resume.step)
        view = self._view(plan.step)
        self.plane.start(view)
        self._tell_shards(pb.LeaderMessage(job=view))
        if not plan.behind:
            return [self._continued_welcome(rank) for rank in self.membership.ranks()]
        self.relay = RestartRelay(plan, self.chunk_bytes, self.blob_limit, self.job_budget)
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

    def _on_relay_chunk(self, rank: int, chunk: pb.CheckpointChunk) -> list[Action]:
        """The donor's state for the ranks behind; once complete, welcome everyone else."""
        relay = self.relay
        if relay is None:
            raise RuntimeError("only called while a restarted job's relay is open")
        blob = relay.add(rank, chunk)
        if blob is None:
            return []
        self.relay = None
        plan = relay.plan
        actions: list[Action] = [
            self._continued_welcome(r) for r in plan.keep if r != plan.donor and r in self.members
        ]
        behind = tuple(r for r in plan.behind if r in self.members)
        actions += [self._continued_welcome(r, len(blob)) for r in behind]
        actions += resume_messages(behind, plan.step, blob, self.chunk_bytes)
        log.info(
            "job '%s': rank %d's state of step %d (%d bytes) sent to rank(s) %s",
            self.job_id,
            plan.donor,
            plan.step,
            len(blob),
            list(behind),
        )
        return actions

    def _start_outer(self, outer: outer_resume.OuterResume) -> None:
        """Restore the plane's outer state (or not), say which, and start saving it."""
        self.outer_state = outer.line
        self.outer_repeat = outer.repeat
        if outer.snapshot is not None:
            self.in_flight.outer.restore(outer.snapshot, outer.replay)
            log.warning("job '%s': outer state %s", self.job_id, outer.line)
        else:
            log.info("job '%s': outer state %s", self.job_id, outer.line)
        self.in_flight.outer.persist = self.persist_outer

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
        if chunk.heal and self.relay is not None:
            return self._on_relay_chunk(rank, chunk)
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
        if self.state is not JobState.RUNNING:
            raise RejectedMessage(
                Code.FAILED_PRECONDITION,
                f"rank {rank} sent state while job '{self.job_id}' is {self.state.value} "
                f"({len(self.members)}/{self.world_size} joined)",
            )
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
            if self.in_flight.was_aborted(chunk.step):
                return []  # this rank was already told the step cannot finish
            self.in_flight.remember_aborted(chunk.step)
            self._step_aborted(chunk.step)
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
        completed = self.steps_completed
        try:
            actions = self.plane.accept(rank, chunk, payload)
        except RejectedMessage as rejection:
            return self._abort(rank, rejection)
        return actions + self.uneven.progress(completed)

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
        if self.state is not JobState.RUNNING:
            raise RejectedMessage(
                Code.FAILED_PRECONDITION,
                f"rank {rank} sent collective {chunk.sequence} while job '{self.job_id}' is "
                f"{self.state.value}",
            )
        return self.collectives.accept(rank, chunk, self.in_flight.participants())

    def on_out_of_inputs(self, rank: int, message: pb.OutOfInputs) -> list[Action]:
        """`rank` ran out of inputs (join()); see `gradsync_server.control.uneven`.

        Raises:
            RejectedMessage: not at the job's open step, or twice (this worker's stream ends).
        """
        if self.state is not JobState.RUNNING:
            raise RejectedMessage(
                Code.FAILED_PRECONDITION,
                f"rank {rank} ran out of inputs (join()) while job '{self.job_id}' is "
                f"{self.state.value}",
            )
        return self.uneven.run_out(rank, message)

    def on_local_posted(self, rank: int, posted: pb.LocalPosted) -> list[Action]:
        """A local group's member has `posted.bucket_index` ready: its delivery, for
        lateness (`StepProgress.record_posted`). Advisory: another step is ignored. In a
        job a peer left between steps it is answered as a gradient would be (the step's
        abort naming the peer): a leader waiting for that peer's share uploads nothing;
        a notice for a step that completed (it can trail the step's average) is ignored.

        Raises:
            RejectedMessage: from a flat rank, or naming a bucket the model lacks.
        """
        signature = self.membership.signature
        buckets = len(signature.buckets) if signature is not None else 0
        if not self.membership.groups.group_of(rank) or posted.bucket_index >= buckets:
            raise RejectedMessage(
                Code.INVALID_ARGUMENT,
                f"rank {rank} reported bucket {posted.bucket_index} of step {posted.step} "
                f"posted in a local group, but it is in none or the model has {buckets} buckets",
            )
        if self.state in (JobState.BROKEN, JobState.FINISHING):
            # A step below the open one completed: the member posted into shared memory
            # before it told us, so its notice can trail its own average (and a peer's
            # orderly Leave). Aborting that step would fail a rank whose step succeeded.
            if posted.step < self.in_flight.step or self.in_flight.was_aborted(posted.step):
                return []
            self.in_flight.remember_aborted(posted.step)
            self._step_aborted(posted.step)
            return [
                abort_message(
                    self.membership.ranks(),
                    posted.step,
                    Code.ABORTED,
                    self._broken_reason,
                    -1,
                    pb.ABORT_REASON_PEER_LOST,
                )
            ]
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
        return self._abort(rank, rejection)

    def reject(self, culprit: int, rejection: RejectedMessage) -> list[Action]:
        """Abort the open step because `culprit` sent an unusable message."""
        if self.state is not JobState.RUNNING:
            return [Terminate((culprit,), rejection.code, rejection.message)]
        return self._abort(culprit, rejection)

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
        self._step_aborted(step)
        return abort_actions(self.membership.ranks(), rank, step, rejection)
