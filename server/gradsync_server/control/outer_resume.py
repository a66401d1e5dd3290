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

Either way one line says which, for the log and `gradsync status`. With S
shards each plane saves its own range (a shard process writes to the store its
leader gave it) and the leader reads every plane's record: it restores only if
all S verify and hold the same step, and tells the shards to restore theirs
(`ShardJobView.outer_restore`); a missing or older record anywhere reseeds.
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
    """What a DiLoCo job starts from: `snapshot` (restored) or None (reseeded), and why.

    Attributes:
        snapshot: the leader's record (None: reseeded).
        line: what happened, for the log and status.
        start_step: the step the job resumes at (the newest record's).
        repeat: the planes' records are one step apart (sharded): the ranks upload
            their round at `start_step` again instead of a replay's parameters.
    """

    snapshot: OuterSnapshot | None
    line: str
    start_step: int = 0
    repeat: bool = False

    @property
    def replay(self) -> bool:
        """The leader's own plane replays `start_step` (its record holds that step)."""
        return self.snapshot is not None and self.snapshot.step == self.start_step


def decide(
    job_id: str,
    signature: pb.ModelSignature,
    shard_count: int,
    records: list[tuple[bytes | None, str]] | None,
    checkpoint_step: int | None,
) -> OuterResume | None:
    """Restore or reseed the outer state of `job_id` (None: the job has no outer optimizer).

    Args:
        job_id: the job.
        signature: its model signature (the outer optimizer and bucket layout).
        shard_count: the coordinator's shard count.
        records: what the store held for each plane 0..shard_count-1 (bytes or None, and
            why none); None = not read (no store).
        checkpoint_step: the step of a rank-0 checkpoint the job resumes from, if any
            (its ranks then roll back to that checkpoint: the outer state does not apply).

    Returns:
        The leader's snapshot (restored) or None (reseeded), with the line saying why.
        Restored only if every plane's record verifies and fits that plane's layout,
        and the records hold one step or two consecutive ones (planes killed between
        their saves of a step: none released that step's last answers, so no rank has
        it and every rank uploads it again; the planes that saved it replay it).
    """
    if not signature.HasField("outer"):
        return None
    if checkpoint_step is not None:
        return OuterResume(
            None, f"reseeded (resuming from rank 0's checkpoint of step {checkpoint_step} instead)"
        )
    if records is None:
        return OuterResume(None, "reseeded (no checkpoint store)")
    if len(records) != shard_count:
        return OuterResume(None, f"reseeded ({len(records)} records for {shard_count} planes)")
    snapshots: list[OuterSnapshot] = []
    for index, (blob, why) in enumerate(records):
        plane = "" if shard_count == 1 else f"shard {index}: "
        if blob is None:
            return OuterResume(None, f"reseeded ({plane}{why})")
        try:
            snapshot = decode_snapshot(blob, job_id)
        except OuterSnapshotError as exc:
            return OuterResume(None, f"reseeded ({plane}{exc})")
        expected = layout_signature(signature.outer, signature.buckets, shard_count, index)
        if snapshot.signature != expected:
            return OuterResume(
                None,
                f"reseeded ({plane}the stored outer state of step {snapshot.step} was written "
                f"for another model, outer optimizer or shard count: layout "
                f"{snapshot.signature[:12]}, this job's {expected[:12]})",
            )
        snapshots.append(snapshot)
    steps = sorted({snapshot.step for snapshot in snapshots})
    if len(steps) > 2 or steps[-1] - steps[0] > 1:
        return OuterResume(None, f"reseeded (the shards' records hold steps {steps})")
    leader, newest = snapshots[0], steps[-1]
    planes = "" if shard_count == 1 else f" ({shard_count} planes)"
    if len(steps) == 2:  # killed between two planes' saves of `newest`: nobody has its answer
        return OuterResume(
            leader,
            f"restored round {leader.rounds} (step {leader.step}) from the store{planes}; "
            f"the shards saved steps {steps}: step {newest} is uploaded again",
            newest,
            repeat=True,
        )
    return OuterResume(
        leader,
        f"restored round {leader.rounds} (step {leader.step}) from the store{planes}; "
        f"step {leader.step} is replayed",
        newest,
    )
