"""How a job loses ranks and ends: departures, breaking, refusing (part of `Job`).

`Job` (`gradsync_server.control.job`) is the state machine over a job's components;
this module holds the half of it that runs when something goes away: a rank
leaves or is lost (a normal finish, an elastic shrink, or a broken job), the
job is refused, or it is ended from outside (a coordinator shard was lost).
Every path frees what the job buffers and returns the actions that tell the
remaining ranks, in-band where they can still hear it. It is the second of
the three layers of `Job`: it reads and changes the components `JobCore`
builds, and `Job` adds the arrivals. Pure logic, no gRPC, no asyncio.
"""

from __future__ import annotations

import logging

from gradsync_proto.codes import Code
from gradsync_proto.v1 import gradsync_pb2 as pb

from gradsync_server.control.job_core import JobCore, JobState
from gradsync_server.control.settings import OnFailure
from gradsync_server.dataplane.actions import Action, Terminate
from gradsync_server.dataplane.step_aborts import abort_message

log = logging.getLogger("gradsync.server")


class JobEnding(JobCore):
    """How ranks leave a job and how it ends (the second layer of `Job`)."""

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
            return self._relay_lost(rank, how)
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
        elastic = self.on_failure is OnFailure.ELASTIC and live >= self.min_workers
        if orderly and quiet and not elastic:
            # A normal finish: nobody is told anything now; a rank that still
            # sends a step or a collective gets this reason then.
            self.state = JobState.FINISHING
            self._broken_reason = (
                f"rank {rank} left job '{self.job_id}' after step {self.in_flight.step - 1}; "
                "the remaining ranks cannot complete further steps"
            )
            self.in_flight.release()
            self.collectives.release()
            self.release_uploads()
            return []
        if elastic:
            return self._shrink(rank, how, followers)
        if self.on_failure is OnFailure.ELASTIC:
            left = len(self.membership.members)
            how += f" leaving {left} ranks (--min-workers {self.min_workers}) in"
        return self._break(
            f"rank {rank} {how} job '{self.job_id}' at step {self.in_flight.step}; no partial "
            "average is applied and the remaining ranks cannot complete further steps",
            rank,
            abort_step=True,
        )

    def _relay_lost(self, rank: int, how: str) -> list[Action]:
        """A rank was lost while a restarted job's donor state was on its way: start over.

        Half the ranks are welcomed and the others wait for a state that may
        never come, so every stream ends UNAVAILABLE: the workers reconnect
        with their positions and the job decides again (a restarted process
        without one takes a live rank's state).
        """
        relay = self.relay
        self.relay = None
        if relay is not None:
            relay.release()
        details = (
            f"rank {rank} {how} job '{self.job_id}' while the coordinator relayed rank "
            f"{relay.plan.donor if relay else '?'}'s state of step "
            f"{relay.plan.step if relay else '?'} to the ranks behind it; every rank "
            "reconnects and the job goes on from the ranks' positions"
        )
        log.warning("%s", details)
        return self.end(Code.UNAVAILABLE, details, pb.END_REASON_PEER_LOST)

    def _shrink(self, rank: int, how: str, followers: tuple[int, ...]) -> list[Action]:
        """Elastic: go on without `rank`, and without its followers if it was a local leader.

        The followers' streams end (ABORTED, PEER_LOST, naming the lost leader):
        the group's shared memory and partial sums were the leader's, so they
        restart and rejoin, flat, like any lost rank.
        """
        what = f"rank {rank} {how} job '{self.job_id}'"
        actions: list[Action] = []
        if followers:
            group = self.membership.groups.group_of(rank)
            self.membership.groups.drop_group(rank)
            for follower in followers:
                self.membership.remove(follower, assembling=False)
                self.liveness.forget(follower)
            details = (
                f"{what} at step {self.in_flight.step}; it was the local leader of ranks "
                f"{list(group)}, whose gradients went through it, so ranks {list(followers)} "
                "leave the job with it (restart them to rejoin)"
            )
            actions.append(Terminate(followers, Code.ABORTED, details, pb.END_REASON_PEER_LOST))
            what += f" with its local group {list(group)}"
        actions += self.elastic.shrink(rank, what, followers)
        for lost in (rank, *followers):
            actions += self.uneven.lost(lost)
        return actions

    def _break(self, reason: str, lost: int, abort_step: bool) -> list[Action]:
        """The job cannot go on: abort the open step in-band, end ranks that cannot hear it.

        Ranks waiting in a collective (or, without `abort_step`, for the state
        broadcast) have no step to abort: their streams end with PEER_LOST.
        """
        step = self.in_flight.step
        self._broken_reason = reason
        self.state = JobState.BROKEN
        self.in_flight.release()
        self.release_uploads()
        self.in_flight.remember_aborted(step)
        ranks = self.membership.ranks()
        waiting = self.collectives.waiting_ranks() if abort_step else ranks
        self.collectives.release()
        actions: list[Action] = []
        if abort_step and ranks:
            actions.append(
                abort_message(
                    ranks, step, Code.ABORTED, reason, -1, pb.ABORT_REASON_PEER_LOST, lost
                )
            )
            self._step_aborted(step)
        waiting = tuple(r for r in waiting if r in self.membership.members)
        if waiting:
            actions.append(Terminate(waiting, Code.ABORTED, reason, pb.END_REASON_PEER_LOST))
        return actions

    def end(
        self, code: Code, details: str, reason: pb.EndReason, state: JobState = JobState.BROKEN
    ) -> list[Action]:
        """End the job (refused, or from outside: a coordinator shard was lost); streams end now."""
        self.state = state
        self._broken_reason = details
        self.in_flight.release()
        self.release_uploads()
        self.in_flight.remember_aborted(self.in_flight.step)
        self.collectives.release()
        ranks = sorted({*self.membership.ranks(), *self.membership.newcomers})
        return [Terminate(tuple(ranks), code, details, reason)]

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
