"""A restarted coordinator's choice: continue from the ranks' own state, or roll back.

A coordinator that restarts (or a standby that takes over) has lost the open
step, but the live ranks have not lost their state: each rejoins with a
`Join.position`, the steps it has applied and a SHA-256 of its parameters,
buffers and optimizer state. If the ranks furthest ahead agree on that digest,
their state *is* the job's state: the job goes on from their step and nothing
is recomputed. Ranks behind them (a rank whose last step's answer never
arrived, a restarted process with no position) take the state of the lowest of
them, relayed through the coordinator like a healing rank's. Only when the
ranks ahead disagree, or the store holds a newer checkpoint than any rank's
position, does the job fall back to its checkpoint, as before.

Why the furthest-ahead ranks are right: a rank can only have applied step s
after the coordinator completed step s over every rank's contribution, so
every rank behind it contributed to what it holds.

The relay (`RestartRelay`): the donor is welcomed first and uploads its state
as `CheckpointChunk(heal=True)` at the step the job goes on from; the job
holds the others' Welcome until the state is complete, then sends it to the
ranks behind as resume chunks, like a checkpoint. The bytes are counted in
the job's budget as they arrive (a declared size is a claim). Pure logic, no I/O.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Container, Mapping
from dataclasses import dataclass

from gradsync_proto.codes import Code
from gradsync_proto.v1 import gradsync_pb2 as pb

from gradsync_server.dataplane.actions import Action, ResumeBlob, Send
from gradsync_server.dataplane.budget import OwnerBudget
from gradsync_server.dataplane.uploads import DonorState
from gradsync_server.errors import RejectedMessage

log = logging.getLogger("gradsync.server")

#: Length of Position.digest (SHA-256).
DIGEST_BYTES = 32


@dataclass(frozen=True)
class Continue:
    """Go on at `step` with the state the ranks in `keep` hold.

    `donor` uploads its state for `behind` (empty: nobody needs it).
    """

    step: int
    keep: tuple[int, ...]
    behind: tuple[int, ...]
    donor: int
    line: str


@dataclass(frozen=True)
class Fallback:
    """Resume from the checkpoint (or from scratch), and why (`line`: for the log and status)."""

    line: str
    #: The furthest step a rank had applied (for the steps recomputed), or -1.
    top: int
    #: Each claiming rank's applied steps (for the steps recomputed).
    steps: tuple[int, ...]


Decision = Continue | Fallback


def check_position(rank: int, position: pb.Position) -> None:
    """Refuse a malformed position claim (its stream ends; the others go on).

    Raises:
        RejectedMessage: the digest is not a SHA-256.
    """
    if len(position.digest) != DIGEST_BYTES:
        raise RejectedMessage(
            Code.INVALID_ARGUMENT,
            f"rank {rank} claimed step {position.step} with a {len(position.digest)}-byte "
            f"digest; a position's digest is a {DIGEST_BYTES}-byte SHA-256",
        )


def decide(
    job_id: str,
    positions: Mapping[int, pb.Position | None],
    checkpoint_step: int | None,
) -> Decision | None:
    """The restarted job's start, from each member's position (None: it sent none).

    Returns None when no rank claims a position (a new job, or every process
    restarted): the job starts as it always did.
    """
    claims = {rank: p for rank, p in positions.items() if p is not None}
    if not claims:
        return None
    top = max(int(p.step) for p in claims.values())
    ahead = sorted(rank for rank, p in claims.items() if int(p.step) == top)
    steps = tuple(int(p.step) for _, p in sorted(claims.items()))
    digests: dict[bytes, list[int]] = {}
    for rank in ahead:
        digests.setdefault(claims[rank].digest, []).append(rank)
    why = None
    if len(digests) > 1:
        groups = "; ".join(
            f"rank(s) {ranks} hold {digest.hex()[:12]}" for digest, ranks in digests.items()
        )
        why = f"the ranks at step {top} disagree on their state ({groups})"
    elif checkpoint_step is not None and checkpoint_step > top:
        why = (
            f"the store's checkpoint of step {checkpoint_step} is ahead of every rank (the "
            f"furthest is at step {top})"
        )
    if why is not None:
        fallback = (
            "no checkpoint to fall back to, starting over from rank 0's state at step 0"
            if checkpoint_step is None
            else f"resuming from the checkpoint of step {checkpoint_step}"
        )
        return Fallback(f"job '{job_id}' rolled back: {why}: {fallback}", top, steps)
    behind = tuple(sorted(rank for rank in positions if rank not in ahead))
    donor = ahead[0]
    line = f"job '{job_id}' continued at step {top} from the ranks' own state"
    if behind:
        line += f" (rank(s) {list(behind)} behind took rank {donor}'s state)"
    else:
        line += " (every rank agreed; nothing rolled back)"
    return Continue(top, tuple(ahead), behind, donor, line)


def steps_recomputed(decision: Decision | None, resumed_at: int) -> int:
    """Steps the ranks had applied beyond where the job goes on, summed over ranks."""
    if isinstance(decision, Fallback):
        return sum(max(0, step - resumed_at) for step in decision.steps)
    return 0


class RestartRelay:
    """Collects the donor's state for `plan.behind` (one per restarted job, while it lasts).

    Args:
        job_id: the job's name (for messages).
        plan: the restarted job's decision (donor, step, ranks behind).
        welcome: a rank's Welcome into the continued job, given the resume bytes it gets.
        chunk_bytes: the job's chunk size (every chunk but the last is this long).
        max_blob_bytes: the largest state accepted (`--max-checkpoint-mb`).
        budget: where the state's bytes are counted while they arrive.
    """

    def __init__(
        self,
        job_id: str,
        plan: Continue,
        welcome: Callable[[int, int], Send],
        chunk_bytes: int,
        max_blob_bytes: int,
        budget: OwnerBudget,
    ) -> None:
        self.plan = plan
        self._job_id = job_id
        self._welcome = welcome
        self._chunk_bytes = chunk_bytes
        self._state = DonorState(plan.donor, chunk_bytes, max_blob_bytes, budget)

    def add(
        self, rank: int, chunk: pb.CheckpointChunk, members: Container[int]
    ) -> list[Action] | None:
        """Take one chunk of the donor's state; None until it is complete.

        Returns:
            Once complete: the Welcome of every member but the donor, and the state
            for the ranks behind.

        Raises:
            RejectedMessage: not the donor, not the step the job goes on from, or a
                malformed upload (the bytes held so far are given back).
        """
        plan = self.plan
        if rank != plan.donor:
            raise RejectedMessage(
                Code.FAILED_PRECONDITION,
                f"rank {rank} sent state for step {chunk.step}; only rank {plan.donor} was "
                f"asked for its state (for rank(s) {list(plan.behind)})",
            )
        if chunk.step != plan.step:
            self.release()
            raise RejectedMessage(
                Code.INVALID_ARGUMENT,
                f"rank {rank} sent its state of step {chunk.step}, but it claimed step "
                f"{plan.step} when it rejoined; the ranks behind need that step's state",
            )
        what = f"rank {rank}'s state of step {plan.step} for rank(s) {list(plan.behind)}"
        blob = self._state.add(what, chunk)
        if blob is None:
            return None
        actions: list[Action] = [
            self._welcome(r, 0) for r in plan.keep if r != plan.donor and r in members
        ]
        behind = tuple(r for r in plan.behind if r in members)
        actions += [self._welcome(r, len(blob)) for r in behind]
        actions.append(Send(behind, ResumeBlob(plan.step, blob, self._chunk_bytes)))
        log.info(
            "job '%s': rank %d's state of step %d (%d bytes) sent to rank(s) %s",
            self._job_id,
            plan.donor,
            plan.step,
            len(blob),
            list(behind),
        )
        return actions

    def lost(self, rank: int, how: str) -> str:
        """`rank` was lost while the state was on its way: the bytes go back; why (logged).

        Half the ranks are welcomed and the others wait for a state that may
        never come, so the job ends every stream UNAVAILABLE: the workers reconnect
        with their positions and the job decides again (a restarted process
        without one takes a live rank's state).
        """
        self.release()
        details = (
            f"rank {rank} {how} job '{self._job_id}' while the coordinator relayed rank "
            f"{self.plan.donor}'s state of step {self.plan.step} to the ranks behind it; every "
            "rank reconnects and the job goes on from the ranks' positions"
        )
        log.warning("%s", details)
        return details

    def release(self) -> None:
        """Give back the bytes held so far (idempotent)."""
        self._state.release()
