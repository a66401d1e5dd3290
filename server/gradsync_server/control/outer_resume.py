"""Whether a DiLoCo job resumes its outer state from the store, reseeds it, or is refused (pure).

A restarted coordinator knows nothing of a job until its ranks join again.
The servicer then reads the job's outer-state records and the leader's mark
(`rpc.outer_records`, an `OuterReading`); when the job assembles, this decides
what becomes of it:

- restored: every plane's record verifies (with a token: under its MAC), was
  written under this job's layout (outer optimizer, buckets, shard count), by
  one run, and the leader's is the one its high-water mark names or a later
  one of that run (`store.outer_marks`): the plane holds its global
  parameters, momentum and round count, and the job resumes *at* the record's
  step, which it replays (`OuterState.restore`): a rank that missed that
  step's answer gets it, the others get the bytes they hold, nothing is
  applied twice and no rank recomputes an inner step;
- reseeded: no store, no record and no mark (a first start: the store
  answered, and held none), `--fresh-start`, or a checkpoint to resume from
  instead; without a token also a record that fails its checks or another
  layout: the ranks seed the global parameters again from what they hold and
  the outer momentum starts from zero;
- refused, with a token, in every other case: a store that cannot be read, a
  record that is missing under a mark, fails its MAC, is another job's, run's
  or layout's, is older than the mark, or disagrees with another plane's. A
  token means nothing in the store is taken on its word: the job ends with
  FAILED_PRECONDITION naming the store, the job, both rounds and
  `--fresh-start`, and is never reseeded silently. Without a token the same
  findings against the mark are logged as an ERROR and the job goes on as
  above (nothing in the store is authenticated, so an accident cannot be told
  from an attack; SECURITY.md).

One line says which, for the log and `gradsync status`. With S shards each
plane saves its own range (a shard process writes to the store its leader gave
it) and the leader reads every plane's record: it restores only if all S
verify and hold the same step (or two consecutive ones), and tells the shards
to restore theirs (`ShardJobView.outer_restore`, with the run in
`ShardJobView.outer_run`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from gradsync_proto.v1 import gradsync_pb2 as pb

from gradsync_server.dataplane.outer_snapshot import (
    OuterSnapshot,
    OuterSnapshotError,
    decode_snapshot,
    layout_signature,
)
from gradsync_server.store.outer_marks import OuterMark, judge

__all__ = ["OuterReading", "OuterResume", "decide"]


@dataclass(frozen=True)
class OuterReading:
    """What the store and the state directory held for a DiLoCo job when it was created.

    Attributes:
        records: each plane's record (bytes, or None and why none).
        store: the store's description, for messages.
        run: a new run id: the job's if its outer state is seeded anew.
        key: the outer-state MAC key (None: no token, nothing is authenticated).
        mark: the leader's high-water mark of the job's outer state, if one was kept.
        mark_path: where that mark lives ("" without a state directory).
        mark_problem: the mark exists but could not be read (why).
        read_failed: a record could not be read (the store failed, rather than holding
            none): not a first start, whatever the records say.
    """

    records: Sequence[tuple[bytes | None, str]]
    store: str
    run: str
    key: bytes | None = field(default=None, repr=False)
    mark: OuterMark | None = None
    mark_path: str = ""
    mark_problem: str = ""
    read_failed: bool = False


@dataclass(frozen=True)
class OuterResume:
    """What a DiLoCo job starts from: `snapshot` (restored) or None (reseeded), and why.

    Attributes:
        snapshot: the leader's record (None: reseeded).
        line: what happened, for the log and status.
        start_step: the step the job resumes at (the newest record's).
        repeat: the planes' records are one step apart (sharded): the ranks upload
            their round at `start_step` again instead of a replay's parameters.
        run: the run the job's outer state belongs to from now on (every plane's records
            carry it).
        refusal: the job must be refused (FAILED_PRECONDITION) for this reason.
        finding: an ERROR to log (no token: the job goes on as `line` says).
    """

    snapshot: OuterSnapshot | None
    line: str
    start_step: int = 0
    repeat: bool = False
    run: str = ""
    refusal: str | None = None
    finding: str | None = None

    @property
    def replay(self) -> bool:
        """The leader's own plane replays `start_step` (its record holds that step)."""
        return self.snapshot is not None and self.snapshot.step == self.start_step


def decide(
    job_id: str,
    signature: pb.ModelSignature,
    shard_count: int,
    reading: OuterReading | None,
    checkpoint_step: int | None,
) -> OuterResume | None:
    """Restore, reseed or refuse the outer state of `job_id` (None: no outer optimizer).

    Args:
        job_id: the job.
        signature: its model signature (the outer optimizer and bucket layout).
        shard_count: the coordinator's shard count.
        reading: what the store held for each plane 0..shard_count-1, and the mark;
            None = not read (no store).
        checkpoint_step: the step of a rank-0 checkpoint the job resumes from, if any
            (its ranks then roll back to that checkpoint: the outer state does not apply).

    Returns:
        The leader's snapshot (restored) or None (reseeded or refused), with the line
        saying why. Restored only if every plane's record verifies and fits that plane's
        layout, all belong to one run, and the records hold one step or two consecutive
        ones (planes killed between their saves of a step: none released that step's
        last answers, so no rank has it and every rank uploads it again; the planes that
        saved it replay it).
    """
    if not signature.HasField("outer"):
        return None
    run = reading.run if reading is not None else ""
    if checkpoint_step is not None:
        return OuterResume(
            None,
            f"reseeded (resuming from rank 0's checkpoint of step {checkpoint_step} instead)",
            run=run,
        )
    if reading is None:
        return OuterResume(None, "reseeded (no checkpoint store)")
    if reading.mark_problem and reading.key is not None:
        return _refused(job_id, reading, reading.mark_problem, None)
    verdict = _read_planes(job_id, signature, shard_count, reading)
    if isinstance(verdict, str):
        return _failed(job_id, reading, verdict)
    snapshots = verdict
    leader = snapshots[0]
    finding = judge(leader.step, leader.rounds, leader.digest, leader.run, reading.mark)
    if finding is not None:
        if reading.key is not None:
            return _refused(job_id, reading, finding, leader)
        finding = _unauthenticated(job_id, reading, finding, f"restoring round {leader.rounds}")
    steps = sorted({snapshot.step for snapshot in snapshots})
    newest = steps[-1]
    planes = "" if shard_count == 1 else f" ({shard_count} planes)"
    restored = f"restored round {leader.rounds} (step {leader.step}) from the store{planes}"
    repeat = len(steps) == 2  # killed between two planes' saves of `newest`: nobody has its answer
    then = f"the shards saved steps {steps}: step {newest} is uploaded again"
    then = then if repeat else f"step {leader.step} is replayed"
    line = f"{restored}; {then}"
    return OuterResume(leader, line, newest, repeat=repeat, run=leader.run, finding=finding)


def _read_planes(
    job_id: str, signature: pb.ModelSignature, shard_count: int, reading: OuterReading
) -> list[OuterSnapshot] | str:
    """Every plane's verified snapshot, or why not (the first problem, in words)."""
    records = reading.records
    if len(records) != shard_count:
        return f"{len(records)} records for {shard_count} planes"
    snapshots: list[OuterSnapshot] = []
    for index, (blob, why) in enumerate(records):
        plane = "" if shard_count == 1 else f"shard {index}: "
        if blob is None:
            return f"{plane}{why}"
        try:
            snapshot = decode_snapshot(blob, job_id, reading.key)
        except OuterSnapshotError as exc:
            return f"{plane}{exc}"
        expected = layout_signature(signature.outer, signature.buckets, shard_count, index)
        if snapshot.signature != expected:
            return (
                f"{plane}the stored outer state of round {snapshot.rounds} (step "
                f"{snapshot.step}) was written for another model, outer optimizer or shard "
                f"count: layout {snapshot.signature[:12]}, this job's {expected[:12]}"
            )
        snapshots.append(snapshot)
    steps = sorted({snapshot.step for snapshot in snapshots})
    if len(steps) > 2 or steps[-1] - steps[0] > 1:
        return f"the shards' records hold steps {steps}"
    runs = sorted({snapshot.run for snapshot in snapshots})
    if len(runs) > 1:
        return f"the shards' records belong to {len(runs)} runs of the job: {runs}"
    return snapshots


def _failed(job_id: str, reading: OuterReading, why: str) -> OuterResume:
    """No record can be restored (`why`): reseed when nothing was acknowledged or without a
    token (an ERROR if something was), refuse with one."""
    first_start = all(blob is None for blob, _ in reading.records) and not reading.read_failed
    if reading.mark is None and first_start:
        return OuterResume(None, f"reseeded ({why})", run=reading.run)
    if reading.key is not None:
        return _refused(job_id, reading, why, None)
    finding = None
    if reading.mark is not None:
        finding = _unauthenticated(job_id, reading, why, "reseeding it from the ranks")
    return OuterResume(None, f"reseeded ({why})", run=reading.run, finding=finding)


def _acknowledged(reading: OuterReading) -> str:
    if reading.mark is None:
        return "no round recorded (no high-water mark of it is kept)"
    where = f" (high-water mark {reading.mark_path})" if reading.mark_path else ""
    return f"{reading.mark}{where}"


def _refused(
    job_id: str, reading: OuterReading, why: str, found: OuterSnapshot | None
) -> OuterResume:
    """The job is refused (a token is set): what was found, what was acknowledged, what to do."""
    held = "no usable record" if found is None else f"round {found.rounds} (step {found.step})"
    return OuterResume(
        None,
        f"refused ({why})",
        refusal=(
            f"refusing to resume the outer state of job '{job_id}' from {reading.store}: "
            f"{why}. The store offers {held}; this coordinator acknowledged "
            f"{_acknowledged(reading)}. With a token the global parameters and outer momentum "
            "are never taken from an unauthenticated, older or foreign record, nor reseeded "
            "in place of an acknowledged one. Restore the record (e.g. from a backup) or "
            "restart the coordinator with --fresh-start to seed the outer state anew from the "
            "ranks' parameters (the outer momentum restarts from zero; the mark is reset)"
        ),
    )


def _unauthenticated(job_id: str, reading: OuterReading, why: str, going_on: str) -> str:
    """The ERROR logged instead of a refusal when there is no token."""
    return (
        f"job '{job_id}' in {reading.store}: the outer state does not match what this "
        f"coordinator acknowledged: {why}; acknowledged {_acknowledged(reading)}. "
        f"{going_on[0].upper()}{going_on[1:]} anyway: without a token nothing in the store "
        "is authenticated. Set a token to refuse instead; restart with --fresh-start to "
        "start the outer state over"
    )
