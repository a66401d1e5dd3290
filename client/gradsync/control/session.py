"""A worker's membership in a job: join, start equal, checkpoint, heal, resume.

Everything here happens between steps, at the pace of the training loop, and
none of it touches autograd: joining with the model's signature, making every
rank start from rank 0's parameters (or from the checkpoint a restarted job
resumes from), uploading checkpoints and a rejoining rank's state, and
reconnecting with backoff when the coordinator is lost. Keeping it apart from
`gradsync.ddp` leaves that module to the nn.Module wrapper and the per-step
hot path, and gives the reconnect rules one reader-sized home.

The session owns the link to the coordinator because reconnecting replaces
it: the wrapper always reaches the current session link through
`Session.link` and the current gradient path through `Session.path` (the
link itself, or a local group's path around it).
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Sequence
from typing import Any

import torch
from gradsync_proto.host import host_id
from gradsync_proto.net.addresses import PER_ADDRESS_JOIN_S, AddressRotation
from gradsync_proto.v1 import gradsync_pb2 as pb
from torch import nn

from gradsync import __version__
from gradsync.config import ClientConfig
from gradsync.control.joining import load_lazy_modules
from gradsync.control.link import CoordinatorLink, LinkFactory, SessionLink
from gradsync.control.state_load import (
    DirectHealError,
    HealDonor,
    broadcast_start_state,
    live_state,
    load_module_state,
    load_optimizer_state,
    position,
    torch_blob,
)
from gradsync.errors import (
    CheckpointFailedError,
    CoordinatorRestartedError,
    CoordinatorUnavailableError,
    GradSyncError,
    SyncTimeoutError,
)
from gradsync.local.hierarchy import LocalGroupPath
from gradsync.local.local_group import LocalGroup
from gradsync.path.gradient_path import BucketEventHandler, GradientPath

log = logging.getLogger("gradsync.client")

#: How long a failed link gets to say goodbye before it is replaced or dropped.
_ABANDON_LINK_TIMEOUT_S = 2.0
#: Reconnect backoff: first pause, and the cap it doubles up to.
_FIRST_RETRY_DELAY_S = 0.25
_MAX_RETRY_DELAY_S = 5.0
#: With several addresses (a standby among them) the pause stays at most this for the
#: first _STANDBY_WATCH_S of reconnecting: a standby takes over within its lease's ttl
#: (3 s by default) and answers at once until then, so ranks that poll it slowly would
#: keep the job waiting up to a whole pause after the takeover.
_STANDBY_RETRY_DELAY_S = 0.25
_STANDBY_WATCH_S = 15.0


class Session:
    """One rank's session with the coordinator, across reconnects.

    Args:
        config: the worker's resolved settings.
        module: the wrapped model (its state dict goes into checkpoints).
        tensors: parameters then buffers, in signature order: what rank 0 broadcasts.
        signature: the model signature sent in Join.
        bucket_bytes: the size of each bucket.
        link_factory: builds a link from (coordinator address, rank).
        on_bucket_event: observer given to every link (metrics, trace).
        reconnect_timeout_s: how long to keep reconnecting; 0 = never.
    """

    def __init__(
        self,
        config: ClientConfig,
        module: nn.Module,
        tensors: Sequence[torch.Tensor],
        signature: pb.ModelSignature,
        bucket_bytes: list[int],
        link_factory: LinkFactory,
        on_bucket_event: BucketEventHandler | None,
        reconnect_timeout_s: float,
    ) -> None:
        self.config = config
        self.module = module
        self._tensors = list(tensors)
        self._signature = signature
        self._bucket_bytes = list(bucket_bytes)
        self._link_factory = link_factory
        #: The coordinator addresses, tried in turn.
        self._addresses = AddressRotation(config.coordinator)
        self._on_bucket_event = on_bucket_event
        self.reconnect_timeout_s = reconnect_timeout_s
        self._optimizer: torch.optim.Optimizer | None = None
        self._pending_optimizer_state: dict[str, Any] | None = None
        #: Rank 0 checkpoints every this many steps (from Welcome; 0 = never).
        self.checkpoint_every = 0
        #: The coordinator's latest Welcome (None before joining).
        self.welcome: pb.Welcome | None = None
        #: Rejoin a restarted coordinator that has no checkpoint (gradsync.DiLoCo: the
        #: ranks hold the global parameters and seed it again; nothing rolls back).
        self.resume_without_checkpoint = False
        self._last_checkpoint_step = -1
        self._resumed_from_checkpoint = False
        #: Where this rank stands, claimed in Join when it rejoins a restarted coordinator.
        self._position: pb.Position | None = None
        #: The last reconnect kept this rank's state (`Welcome.continued`), and how it went on.
        self.continued, self.restart_line = False, ""
        #: The local group's path around the link (hierarchical aggregation), or None.
        self._local: LocalGroupPath | None = None
        #: This rank's state offered to ranks it heals (`heal_channel`), while served.
        self.donor = HealDonor()
        #: A live rank's direct offer of its state could not be read: rejoin asking for it
        #: through the coordinator (`Join.heal_relayed`).
        self._heal_relayed = False
        self._link = self._new_link()

    @property
    def link(self) -> SessionLink:
        """The current session link to the coordinator (replaced by each reconnect)."""
        return self._link

    @property
    def path(self) -> GradientPath:
        """The current gradient path: the local group's, else the link's own."""
        return self._local if self._local is not None else self._link

    @property
    def local_group(self) -> LocalGroup | None:
        """This rank's local group (hierarchical aggregation), or None when flat."""
        return self._local.group if self._local is not None else None

    def start(self) -> int:
        """Join the job and start equal; return the step training starts at.

        Raises:
            GradSyncError: joining failed; the link is closed.
        """
        load_lazy_modules(self.config.rank)  # (why: in `joining`)
        try:
            return self._join_healed()
        except CoordinatorUnavailableError:
            if not self._addresses.several:
                self._release(timeout_s=5.0)
                raise
        except BaseException:
            self._release(timeout_s=5.0)
            raise
        return self._start_elsewhere()

    def _join_healed(self) -> int:
        """Join; a rejoining rank that could not read the donor's direct offer of its state
        (the donor's socket held, refused or too slow) rejoins once, asking for the state
        through the coordinator, instead of failing."""
        try:
            return self._join_and_broadcast()
        except DirectHealError as exc:
            if self._heal_relayed:
                raise
            log.warning(
                "rank %d: %s; rejoining to be healed through the coordinator instead",
                self.config.rank,
                exc,
            )
        self._release(timeout_s=_ABANDON_LINK_TIMEOUT_S)
        self._local = None
        self._heal_relayed = True
        self._link = self._new_link()
        return self._join_and_broadcast()

    def _start_elsewhere(self) -> int:
        """The first address did not serve: try each other one once (one may be a standby)."""
        addresses = self._addresses
        for _ in range(addresses.count - 1):
            self._release(timeout_s=_ABANDON_LINK_TIMEOUT_S)
            log.info("rank %d: trying %s", self.config.rank, addresses.advance())
            self._link = self._new_link()
            try:
                return self._join_and_broadcast()
            except CoordinatorUnavailableError:
                continue
            except BaseException:
                self._release(timeout_s=5.0)
                raise
        self._release(timeout_s=5.0)
        raise CoordinatorUnavailableError(
            f"no coordinator of {self.config.coordinator} serves job '{self.config.job_id}' "
            "(each answered UNAVAILABLE: down, or a standby)",
            rank=self.config.rank,
        )

    def close(self) -> None:
        """Leave the job."""
        self._release()

    def _release(self, timeout_s: float = 10.0) -> None:
        """Close the local group (if any), then the link. Idempotent."""
        try:
            if self._local is not None:
                self._local.close()
            self.donor.close()
        finally:
            self._link.close(timeout_s)

    # ------------------------------------------------------------ step boundaries
    def at_step_boundary(self, step: int) -> None:
        """Run what must happen between steps, before the forward pass of `step`.

        Here the optimizer has applied the previous step, so parameters and
        optimizer state are consistent: the moment to hand state to a
        rejoining rank, and (rank 0) to take a due periodic checkpoint.
        """
        self.donor.release()  # done at the end of the step's backward, unless none ran
        if self._link.take_heal_request():
            # Before this rank's buffer broadcast and gradients of the step: the newcomer
            # takes part in both (its Welcome says from which collective number). The
            # joiner reads while this rank computes; `donor.release` waits for it.
            self._send_heal(step, settle=False, relay=self._link.heal_relay_requested())
            await_heal_answer(self._link, self.config, step)  # (why: its docstring)
        every = self.checkpoint_every
        if (
            every
            and self.config.rank == 0
            and step % every == 0
            and step > self._last_checkpoint_step
        ):
            self.save_checkpoint(step, wait=False, timeout_s=self.config.timeout_s)

    def register_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Include `optimizer`'s state in checkpoints; restore a pending one into it."""
        self._optimizer = optimizer
        if self._pending_optimizer_state is not None:  # a mismatch names job and step
            config, step = self.config, self._last_checkpoint_step
            state = self._pending_optimizer_state
            load_optimizer_state(optimizer, state, config.job_id, config.rank, step)
            self._pending_optimizer_state = None

    def save_checkpoint(self, step: int, wait: bool, timeout_s: float) -> int:
        """Upload rank 0's state as the checkpoint of `step`; see the wrapper's method."""
        if self.config.rank != 0:
            return step
        self._last_checkpoint_step = step
        state = live_state(self.module, self._optimizer, step, self.config.world_size)
        self._link.send_checkpoint(step, torch_blob(state))
        if wait:
            saved = self._link.wait_checkpoint(step, timeout_s)
            if not saved.durable:
                raise CheckpointFailedError(
                    f"checkpoint of step {step} was not saved: {saved.message}",
                    rank=self.config.rank,
                    step=step,
                )
        return step

    def _send_heal(self, step: int, settle: bool = True, relay: bool = False) -> None:
        """Upload this rank's state (or an offer of it) for the ranks it heals."""
        args = (self._link, self.config, self.module, self._optimizer, step)
        self.donor.send(*args, settle=settle, relay=relay)

    # ------------------------------------------------------------ reconnecting
    def reconnect(self, cause: GradSyncError, step: int) -> int:
        """Reconnect to a restarted coordinator (bounded backoff); return the resumed step.

        Only a lost coordinator (`CoordinatorUnavailableError`) is worth this:
        a coordinator that declared this rank dead or refused it is alive and
        would not take it back.

        Args:
            cause: the error that lost the coordinator (chained to any failure).
            step: the step this rank was at (named if the job cannot resume).

        Raises:
            CoordinatorUnavailableError: no coordinator within the reconnect timeout, or
                one that cannot resume this job from a checkpoint.
        """
        started = time.monotonic()
        deadline = started + self.reconnect_timeout_s
        delay = _FIRST_RETRY_DELAY_S
        log.warning(
            "rank %d: lost the coordinator (%s); reconnecting for up to %gs",
            self.config.rank,
            cause,
            self.reconnect_timeout_s,
        )
        self._resumed_from_checkpoint = False
        self.continued = False
        if not self.resume_without_checkpoint:  # DiLoCo: its outer state's records decide
            self._position = position(self.module, self._optimizer, step)
        while True:
            self._release(timeout_s=_ABANDON_LINK_TIMEOUT_S)
            self._local = None
            self._link = self._new_link()
            remaining = deadline - time.monotonic()
            try:
                start = self._join_and_broadcast(join_timeout_s=max(1.0, remaining))
                break
            except (CoordinatorUnavailableError, SyncTimeoutError) as exc:
                if self._addresses.several:
                    # A standby (or a dead host) answered: the active one is elsewhere.
                    log.info("rank %d: %s", self.config.rank, self._addresses.move_on(exc))
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise CoordinatorUnavailableError(
                        f"gave up reconnecting to {self.config.coordinator} after "
                        f"{self.reconnect_timeout_s:g}s: {exc}",
                        rank=self.config.rank,
                    ) from cause
                if self._addresses.several and time.monotonic() - started < _STANDBY_WATCH_S:
                    delay = min(delay, _STANDBY_RETRY_DELAY_S)
                time.sleep(min(delay, remaining))
                delay = min(delay * 2, _MAX_RETRY_DELAY_S)
        self._position = None
        if (
            not self._resumed_from_checkpoint
            and not self.resume_without_checkpoint
            and not self.continued
        ):
            raise CoordinatorUnavailableError(
                f"the restarted coordinator has no checkpoint of job '{self.config.job_id}' "
                f"(it would restart at step {start}, this rank is at step {step}); "
                "start it with the same --checkpoint-store to resume",
                rank=self.config.rank,
            ) from cause
        return start

    def recover(
        self, exc: CoordinatorUnavailableError, step: int, during: str
    ) -> tuple[int, CoordinatorRestartedError | None]:
        """Reconnect to a restarted coordinator; return the resumed step and the error to raise.

        Only a lost coordinator is worth reconnecting to; every other error
        (declared dead, refused, checkpoint failed) propagates as it is, and so
        does `exc` when reconnecting is off. The caller moves its own step.
        The error is None when the job went on at `step` with this rank's own
        state: the caller retries what it was doing (nothing was lost).

        Args:
            exc: the error that lost the coordinator.
            step: the step this rank was at.
            during: what was running, for the message ("a forward pass").
        """
        if self.reconnect_timeout_s <= 0:
            raise exc
        resumed_at = self.reconnect(exc, step)
        self._link.current_step = resumed_at
        if self.continued and resumed_at == step:
            log.warning(
                "rank %d: lost the coordinator during %s (%s); %s: retrying step %d",
                self.config.rank,
                during,
                exc,
                self.restart_line,
                step,
            )
            return resumed_at, None
        if self.continued:
            source = f"taken from a rank ahead at step {resumed_at} ({self.restart_line})"
        else:
            source = f"restored from the checkpoint of step {resumed_at}"
            if self.restart_line:
                source += f" ({self.restart_line})"
        # The cause is named: a lost shard says which one and where.
        restarted = CoordinatorRestartedError(
            f"lost the coordinator during {during} ({exc}) and reconnected; state {source}. "
            "Nothing was applied: skip optimizer.step() and continue at model.step",
            rank=self.config.rank,
            step=resumed_at,
        )
        return resumed_at, restarted

    # ------------------------------------------------------------ joining
    def _new_link(self) -> CoordinatorLink:
        link = self._link_factory(self._addresses.current(), self.config.rank)
        link.on_bucket_event = self._on_bucket_event
        return link

    def _join_and_broadcast(self, join_timeout_s: float | None = None) -> int:
        """Join the job, then make every rank start from rank 0's state (or a checkpoint)."""
        config = self.config
        timeout_s = join_timeout_s or config.join_timeout_s
        link = self._link
        link.configure_buckets(self._bucket_bytes)
        join = pb.Join(
            job_id=config.job_id,
            rank=config.rank,
            world_size=config.world_size,
            signature=self._signature,
            incarnation=uuid.uuid4().hex,
            client_version=__version__,
            # Empty: flat. The coordinator groups the ranks that send the same id.
            host_id=host_id() if config.hierarchical else "",
            local_world_size=config.local_world_size,
            position=self._position,
            heal_relayed=self._heal_relayed,
        )
        log.info(
            "rank %d: joining job '%s' at %s (world size %d, %d buckets)",
            config.rank,
            config.job_id,
            config.coordinator,
            config.world_size,
            len(self._bucket_bytes),
        )
        link.open(join)
        several = self._addresses.several
        welcome = self.welcome = link.wait_welcome(
            timeout_s, PER_ADDRESS_JOIN_S if several else None
        )
        if several:
            log.info("rank %d: joined at %s", config.rank, self._addresses.current())
        if len(welcome.local_ranks) >= 2:
            self._local = self._form_local_group(link, welcome, timeout_s)
        # The coordinator numbers collectives: 0 for a new job (or a restarted
        # coordinator), where the live ranks stand for a healed newcomer.
        link.set_collective_sequence(int(welcome.next_collective))
        self.checkpoint_every = int(welcome.checkpoint_every_steps)
        start = int(welcome.start_step)
        self.restart_line = welcome.restart
        if welcome.continued:
            self._continue(welcome, start)
        elif welcome.resume_bytes:
            self._restore(link.receive_resume(welcome.resume_bytes, timeout_s), start)
            self.continued = bool(welcome.restart) and self._position is not None
        else:
            # Rank 0 sends its parameters and buffers; every other rank overwrites its own.
            broadcast_start_state(link, config.rank, self._tensors, welcome, timeout_s)
            log.info(
                "rank %d: job '%s' assembled; starting at step %d",
                config.rank,
                config.job_id,
                start,
            )
        link.current_step = start
        return start

    def _continue(self, welcome: pb.Welcome, start: int) -> None:
        """A restarted coordinator kept this rank's state; send it on if asked (a donor)."""
        claimed = self._position
        if claimed is None or int(claimed.step) != start:  # only a claimant of `start` may
            raise CoordinatorUnavailableError(
                f"the coordinator told rank {self.config.rank} to keep its own state at step "
                f"{start}, but it claimed {claimed.step if claimed else 'no position'}",
                rank=self.config.rank,
                step=start,
            )
        self.continued = True
        if welcome.send_state:
            self._send_heal(start)
        log.warning("rank %d: %s", self.config.rank, welcome.restart)

    def _form_local_group(
        self, link: CoordinatorLink, welcome: pb.Welcome, timeout_s: float
    ) -> LocalGroupPath:
        """Meet the other ranks of this host (bounded); route `link`'s gradients through them."""
        config = self.config
        ranks = [int(r) for r in welcome.local_ranks]
        group = LocalGroup.form(
            job_id=config.job_id,
            rank=config.rank,
            ranks=ranks,
            secret=welcome.local_secret,
            bucket_bytes=self._bucket_bytes,
            timeout_s=timeout_s,
            heartbeat_interval_s=welcome.heartbeat_interval_s,
        )
        if config.local_rank is not None and config.local_rank != group.slot:
            log.warning(
                "rank %d: LOCAL_RANK is %d but this rank is number %d of its local group %s",
                config.rank,
                config.local_rank,
                group.slot,
                ranks,
            )
        log.info(
            "rank %d: local group %s formed (%s); gradients are summed on this host first",
            config.rank,
            ranks,
            "leader" if group.is_leader else f"leader rank {ranks[0]}",
        )
        path = LocalGroupPath(link, link, group, self._bucket_bytes, welcome, self._on_bucket_event)
        if self._on_bucket_event is not None:
            self._on_bucket_event("local_group", len(ranks), -1)
        return path

    def _restore(self, blob: bytes | bytearray, start_step: int) -> None:
        """Load a checkpoint or a live rank's state (optimizer state waits for its optimizer).

        Raises:
            CheckpointMismatchError: not a gradsync checkpoint, or not this model's.
        """
        config = self.config
        self._pending_optimizer_state = load_module_state(
            blob, self.module, config.job_id, config.rank, start_step, config.join_timeout_s
        )
        self._resumed_from_checkpoint = True
        self._last_checkpoint_step = start_step
        if self._optimizer is not None:  # reconnecting mid-run: the optimizer already exists
            self.register_optimizer(self._optimizer)
        log.warning(
            "rank %d: job '%s' resumed from the checkpoint of step %d",
            self.config.rank,
            self.config.job_id,
            start_step,
        )


def await_heal_answer(link: SessionLink, config: ClientConfig, step: int) -> None:
    """Block (bounded) until the coordinator used the state this rank just sent.

    Under the elastic policy the lowest live rank donates its state at a step
    boundary, and the coordinator adds the rejoining ranks to the open step the
    moment the state is complete. That is only right while no chunk of that step
    has summed anyone yet: every chunk is summed in ascending rank order, and
    nothing can be summed before the donor (the lowest rank) contributes.

    On a single coordinator the stream keeps that order by itself: the donor's
    gradient chunks travel behind its state. A sharded coordinator's other shards
    get the donor's chunks on their own streams, and hear of the new membership
    from the leader, on another connection; a shard that had summed the donor
    before could not add the newcomer in rank order, and the step was aborted for
    every rank (or, worse, completed at the shard without the newcomer while the
    leader counted it in). So the donor uploads nothing of the step until the
    leader's MembershipChanged has reached it: its chunks then carry the new
    epoch, and a shard holds a chunk of an epoch it has not heard of until the
    leader's view of that epoch arrives (`JobPlane.awaits_leader`), which adds
    the newcomers first. The newcomer cannot take part in the step before that
    anyway: it waits for the same state.

    What the donor cannot tell apart: a membership change for another reason (a
    rank lost while the state is in transit) ends the wait early too; a shard may
    then sum the donor before the newcomer's view, and aborts the step (safe,
    every rank skips it; rare).

    An abort of `step` ends the wait too: the coordinator uses no state taken
    for an aborted step (it asks again at a later boundary if newcomers still
    wait). Bounded by half the step timeout, so that the ranks waiting for this
    rank's gradients of `step` still get them in time when no answer comes. A
    failed stream is not raised here: it stays recorded and surfaces at the
    step's next wait, where the model wrapper handles it.
    """
    timeout_s = config.timeout_s / 2
    try:
        answered = link.wait_heal_answer(step, timeout_s)
    except GradSyncError as exc:
        log.warning("rank %d: stopped waiting for its state to be used: %s", config.rank, exc)
        return
    if not answered:
        log.warning(
            "rank %d: the coordinator admitted nobody with its state of step %d within %gs; "
            "training on (a sharded coordinator may abort this step)",
            config.rank,
            step,
            timeout_s,
        )
