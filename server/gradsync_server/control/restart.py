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
every rank behind it contributed to what it holds. Pure logic, no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from gradsync_proto.codes import Code
from gradsync_proto.v1 import gradsync_pb2 as pb

from gradsync_server.errors import RejectedMessage

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
    """Resume from the checkpoint (or from scratch), and why, for the log and status."""

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
    if len(digests) > 1:
        groups = "; ".join(
            f"rank(s) {ranks} hold {digest.hex()[:12]}" for digest, ranks in digests.items()
        )
        return Fallback(
            f"the ranks at step {top} disagree on their state ({groups}): "
            f"{_fallback(checkpoint_step)}",
            top,
            steps,
        )
    if checkpoint_step is not None and checkpoint_step > top:
        return Fallback(
            f"the store's checkpoint of step {checkpoint_step} is ahead of every rank "
            f"(the furthest is at step {top}): {_fallback(checkpoint_step)}",
            top,
            steps,
        )
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


def _fallback(checkpoint_step: int | None) -> str:
    if checkpoint_step is None:
        return "no checkpoint to fall back to, starting over from rank 0's state at step 0"
    return f"resuming from the checkpoint of step {checkpoint_step}"
