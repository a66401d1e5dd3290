"""A job's parts, its state and its control events: what both halves of `Job` share.

`Job` (`gradsync_server.control.job`) is the state machine over a job's
components. It is written in three layers, each a module: this one builds
the components and owns what every transition touches (the lifecycle
state, the job's data plane for byte range 0, the control events for the
shards); `JobEnding` (`job_ending`) adds how ranks leave and jobs end; `Job`
adds the arrivals (joins, gradients, checkpoints, collectives). Pure logic,
no gRPC, no asyncio.

Control events: every change the data planes must follow (the job started,
its membership changed, a step was aborted) is decided here, applied to
this job's own plane at once, and queued for the shards (`take_events`) in
the order decided. A shard applies the same events to its plane
(`gradsync_server.dataplane.plane`), so no process ever compares states.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable, Sequence

from gradsync_proto.codes import Code
from gradsync_proto.v1 import gradsync_pb2 as pb

from gradsync_server.control.assembly import Assembly
from gradsync_server.control.broadcast import StateBroadcast
from gradsync_server.control.collectives import Collectives
from gradsync_server.control.elastic import Elastic
from gradsync_server.control.liveness import Liveness
from gradsync_server.control.membership import Membership
from gradsync_server.control.persistence import Persistence
from gradsync_server.control.restart_relay import RestartRelay
from gradsync_server.control.settings import JobSettings
from gradsync_server.control.uneven import UnevenInputs
from gradsync_server.dataplane.actions import Action, Member, Send
from gradsync_server.dataplane.budget import ByteBudget
from gradsync_server.dataplane.observer import StepObserver
from gradsync_server.dataplane.plane import JobPlane
from gradsync_server.dataplane.progress import StepProgress
from gradsync_server.errors import RejectedMessage
from gradsync_server.store.checkpoint import Checkpoint

__all__ = ["JobCore", "JobState"]


class JobState(enum.Enum):
    """Where a job is in its lifecycle."""

    ASSEMBLING = "assembling"
    RUNNING = "running"
    FINISHING = "finishing"
    REFUSED = "refused"
    BROKEN = "broken"


class JobCore:
    """One job's components and state (see `Job`, which adds the transitions).

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
        self.max_message_bytes = settings.max_message_bytes
        self.heartbeat_interval_s = heartbeat_interval_s = settings.heartbeat_interval_s
        self.checkpoint_every = settings.checkpoint_every
        self.on_failure = settings.on_failure
        self.min_workers = settings.min_workers
        shard_count = settings.shard_count
        self.membership = Membership(job_id, world_size, clock)
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
        #: Control events not yet taken by the shards (`take_events`), in decision order.
        self._events: list[pb.LeaderMessage] = []
        self._last_abort_event = -1
        self.liveness = Liveness(clock)
        #: Told of restarts (the coordinator's metrics), if anyone is.
        self.observer = metrics
        self.persistence = Persistence(chunk_bytes, blob_limit, job_budget)
        self.job_budget, self.blob_limit = job_budget, blob_limit
        #: A restarted job's donor state on its way to the ranks behind (`control.restart`).
        self.relay: RestartRelay | None = None
        #: How a restarted coordinator went on (continued, or rolled back and why).
        self.restart_line = ""
        #: Steps the ranks had applied beyond where a restarted job went on (summed).
        self.steps_recomputed = 0
        #: The store's outer-state records of this job, one per plane, read before it
        #: assembled: (bytes or None, why none); None = not read (`control.outer_resume`).
        self.outer_records: list[tuple[bytes | None, str]] | None = None
        #: Save the outer state after every step that changed it (a store is configured).
        self.persist_outer = False
        #: How the outer state started: restored from the store or reseeded, and why.
        self.outer_state = ""
        #: Restored with the shards one step apart: the ranks upload the open step again.
        self.outer_repeat = False
        self.assembly = Assembly(job_id, world_size, clock, heartbeat_interval_s)
        self.broadcast = StateBroadcast(chunk_bytes)
        self.collectives = Collectives(
            world_size, chunk_bytes, settings.max_collective_bytes, job_budget
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

    @property
    def progress(self) -> StepProgress | None:
        """Delivery bookkeeping of the open step (None before assembly)."""
        return self.in_flight.progress

    def joined_ranks(self) -> Sequence[int]:
        """Ranks currently connected, ascending."""
        return self.membership.ranks()

    def outcome(self) -> tuple[str, str]:
        """How the job ended (once its last rank is gone): a state word and a sentence."""
        if self.state is JobState.ASSEMBLING:
            return "abandoned", "abandoned: every waiting rank left before the job assembled"
        if self.state in (JobState.BROKEN, JobState.REFUSED):
            return self.state.value, self._broken_reason
        return "finished", f"finished after {self.steps_completed} steps"

    def set_peer(self, rank: int, peer: str) -> None:
        """Remember the network address of `rank`, for status."""
        self.membership.set_peer(rank, peer)

    def resume_from(self, checkpoint: Checkpoint | None) -> None:
        """Resume from `checkpoint` once assembled (loaded before the first rank joins)."""
        self.persistence.resume_from(checkpoint)

    def _progress(self, refused: str = "") -> Send:
        """An AssemblyProgress for every waiting rank (as they join, and as they leave)."""
        ranks = self.membership.ranks()
        return Send(ranks, self.assembly.progress(ranks, refused))

    def welcome_for(self, rank: int, resume_bytes: int = 0) -> Send:
        """`rank`'s own Welcome: the job's, plus the session secret issued to that rank."""
        message = self._welcome_message(resume_bytes)
        message.welcome.session = self.membership.session_of(rank)
        local_ranks, local_secret = self.membership.local_group_of(rank)
        message.welcome.local_ranks.extend(local_ranks)
        message.welcome.local_secret = local_secret
        message.welcome.payload_socket = self._payload_socket_for(rank, local_ranks)
        return Send((rank,), message)

    def _payload_socket_for(self, rank: int, local_ranks: Sequence[int]) -> str:
        """The payload socket for a same-host local leader of an unsharded job, else "".

        Only a leader uploads (and gets averages), and only an unsharded
        coordinator holds whole buckets to read from one segment.
        """
        if self.payload_endpoint is None or self.shards or not local_ranks:
            return ""
        name, coordinator_host = self.payload_endpoint
        member = self.members.get(rank)
        if local_ranks[0] != rank or member is None or member.host_id != coordinator_host:
            return ""
        return name

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
                max_message_bytes=self.max_message_bytes,
                state_bytes=self.broadcast.state_bytes,
                resume_bytes=resume_bytes,
                heartbeat_interval_s=self.heartbeat_interval_s,
                checkpoint_every_steps=self.checkpoint_every,
                next_collective=self.collectives.next_sequence,
                shards=self.shards,
                outer_seeded=self.in_flight.outer.active and self.in_flight.outer.seeded,
                outer_replay=self.in_flight.outer.replaying and not self.outer_repeat,
                outer_repeat=self.outer_repeat and self.in_flight.steps_completed == 0,
            )
        )

    # ------------------------------------------------------------ control events
    def take_events(self) -> list[pb.LeaderMessage]:
        """The control events decided since the last call, for the shards, in order.

        Each was already applied to this job's own plane; the shards apply the
        same (`gradsync_server.dataplane.plane`). Always empty when unsharded.
        """
        if not self._events:
            return []  # the common case, on every batch of actions
        events, self._events = self._events, []
        return events

    def end_event(self) -> pb.LeaderMessage:
        """The ShardJobEnd of this job once it left the coordinator: its outcome as a status."""
        state, outcome = self.outcome()
        code, message = Code.OK, outcome
        if state not in ("finished", "abandoned"):
            code, message = (
                Code.ABORTED,
                f"job '{self.job_id}' ended at the leader ({state}): {outcome}",
            )
        end = pb.ShardJobEnd(job_id=self.job_id, code=int(code), message=message)
        return pb.LeaderMessage(job_end=end)

    def _tell_shards(self, event: pb.LeaderMessage) -> None:
        if self._shard_count > 1:
            self._events.append(event)

    def _step_aborted(self, step: int) -> None:
        """Every rank is told `step` is aborted: the shards drop it too (once per step)."""
        if step != self._last_abort_event:
            self._last_abort_event = step
            self._tell_shards(pb.LeaderMessage(abort=pb.ShardAbort(job_id=self.job_id, step=step)))

    def _abort(self, culprit: int, rejection: RejectedMessage) -> list[Action]:
        """Abort the open step for every rank because of `culprit`'s message."""
        step = self.open_step
        actions = self.in_flight.abort(culprit, rejection)
        self._step_aborted(step)
        return actions

    def _view(self, start_step: int | None = None) -> pb.ShardJobView:
        """The job as its data planes know it: the whole (small) membership, the layout."""
        signature = self.membership.signature
        return pb.ShardJobView(
            job_id=self.job_id,
            world_size=self.world_size,
            membership_epoch=self.membership_epoch,
            members=[
                pb.ShardMember(rank=rank, incarnation=member.incarnation, session=member.session)
                for rank, member in sorted(self.members.items())
            ],
            out_of_inputs=sorted(r for r in self.uneven.out_of_inputs if r in self.members),
            start_step=self.open_step if start_step is None else start_step,
            buckets=list(signature.buckets) if signature is not None else [],
            outer=signature.outer
            if signature is not None and signature.HasField("outer")
            else None,
            chunk_bytes=self.chunk_bytes,
            shard_count=self._shard_count,
            local_groups=[pb.LocalGroup(ranks=g) for g in self.membership.groups.groups()],
        )

    def _publish(self) -> list[Action]:
        """The membership changed: apply it to this job's plane now, and tell the shards.

        Returns the averages a dropped rank or a rank out of inputs completed
        here, or the step's abort when a rejoining rank cannot be summed in rank
        order (the shards then drop that step before they follow the view).
        """
        view = self._view()
        followed = self.plane.follow(view)
        actions = followed.actions
        if followed.refused is not None:
            rank, rejection = followed.refused
            actions += self._abort(rank, rejection)
        self._tell_shards(pb.LeaderMessage(job=view))
        return actions
