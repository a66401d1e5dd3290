"""Whether a DiLoCo job resumes its outer state from the store or reseeds it (pure).

A restarted coordinator knows nothing of a job until its ranks join again.
The servicer then reads the job's outer-state record (`rpc.outer_records`);
when the job assembles, this decides what becomes of it:

- restored: the record verifies and was written under this job's layout (outer
  optimizer, buckets, shard count): the plane holds its global parameters,
  momentum and round count, and the job resumes *at* the record's step, which
  it replays (`OuterState.restore`): a rank that missed that step's answer gets
  it, the others get the bytes they hold, nothing is applied twice and no rank
  recomputes an inner step;
- reseeded: no store, no record, a record that fails its checks, or another
  layout: today's path, the ranks seed the global parameters again from what
  they hold and the outer momentum starts from zero.

Either way one line says which, for the log and `gradsync status`. Only an
unsharded coordinator restores for now: shard processes have no store of their
own, and a leader that restored its range alone would mix two states.
"""

from __future__ import annotations

from dataclasses import dataclass

from gradsync_proto.v1 import gradsync_pb2 as pb

from gradsync_server.dataplane.outer_snapshot import (
    OuterSnapshot,
    OuterSnapshotError,
    decode_snapshot,
    layout_signature,
)

__all__ = ["OuterResume", "decide"]


@dataclass(frozen=True)
class OuterResume:
    """What a DiLoCo job starts from: `snapshot` (restored) or None (reseeded), and why."""

    snapshot: OuterSnapshot | None
    line: str


def decide(
    job_id: str,
    signature: pb.ModelSignature,
    shard_count: int,
    record: tuple[bytes | None, str] | None,
    checkpoint_step: int | None,
) -> OuterResume | None:
    """Restore or reseed the outer state of `job_id` (None: the job has no outer optimizer).

    Args:
        job_id: the job.
        signature: its model signature (the outer optimizer and bucket layout).
        shard_count: the coordinator's shard count.
        record: what the store held (bytes or None, and why none); None = not read.
        checkpoint_step: the step of a rank-0 checkpoint the job resumes from, if any
            (its ranks then roll back to that checkpoint: the outer state does not apply).
    """
    if not signature.HasField("outer"):
        return None
    if shard_count > 1:
        return OuterResume(
            None,
            f"reseeded (the outer state is restored unsharded only, not with {shard_count} shards)",
        )
    if checkpoint_step is not None:
        return OuterResume(
            None, f"reseeded (resuming from rank 0's checkpoint of step {checkpoint_step} instead)"
        )
    if record is None:
        return OuterResume(None, "reseeded (no checkpoint store)")
    blob, why = record
    if blob is None:
        return OuterResume(None, f"reseeded ({why})")
    try:
        snapshot = decode_snapshot(blob, job_id)
    except OuterSnapshotError as exc:
        return OuterResume(None, f"reseeded ({exc})")
    expected = layout_signature(signature.outer, signature.buckets, shard_count, 0)
    if snapshot.signature != expected:
        return OuterResume(
            None,
            f"reseeded (the stored outer state of step {snapshot.step} was written for another "
            f"model, outer optimizer or shard count: layout {snapshot.signature[:12]}, this "
            f"job's {expected[:12]})",
        )
    return OuterResume(
        snapshot,
        f"restored round {snapshot.rounds} (step {snapshot.step}) from the store; "
        f"step {snapshot.step} is replayed",
    )
