"""The high-water mark: which checkpoint a job last had acknowledged, so that a store rolled
back behind the coordinator's back is noticed instead of resumed from.

Whoever can write the checkpoint store can move its `latest` pointer back, delete or damage
the newest blob, or empty the store. Each checkpoint still verifies (the MAC proves the
coordinator wrote it, not that it is the newest), so the store alone would make the job
resume from an older step, or from step 0. Two records the store cannot roll back alone
say what the newest acknowledged checkpoint was:

- the coordinator's own mark (`HighWater`: step, blob digest, timeline), kept per (store,
  job) outside the store, in its state directory (`gradsync_server.store.high_water_file`),
  and rewritten after every acknowledged save;
- a chain in the MAC-covered metadata of every checkpoint (`Lineage`): the mark that was
  current when it was written (`previous_step`, `previous_sha256`) and the id of the run it
  belongs to (`timeline`: new at a job's first start or a `--fresh-start`, inherited when
  it resumes). A verified blob beyond the pointer that records a newer acknowledged step of
  the same run proves the pointer was moved back, even without the state directory.

`judge` compares what the store returned (`StoreReading`) with both, purely; the
checkpointer refuses the job on a finding when it has a token, and logs it as an error when
it has none (then nothing in the store is authenticated, and the documented fall-back for
accidents is kept). Evidence from the store may only raise the expected step: an attacker
who raises it wins a refusal, which deleting the store would win as well.
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Callable
from dataclasses import dataclass

from gradsync_server.store.checkpoint import CheckpointHeader, StoreReading, blob_digest

#: Metadata key: the id of the run (of one job) a checkpoint belongs to.
TIMELINE_KEY = "timeline"
#: Metadata keys: the mark acknowledged just before this checkpoint was written.
PREVIOUS_STEP_KEY = "previous_step"
PREVIOUS_DIGEST_KEY = "previous_sha256"


@dataclass(frozen=True)
class HighWater:
    """The newest checkpoint of a job acknowledged as durable.

    Attributes:
        step: its step.
        digest: its `blob_digest` (the blob's trailing checksum, in hex).
        timeline: the run it belongs to ("" for checkpoints older than timelines).
    """

    step: int
    digest: str
    timeline: str

    @classmethod
    def of(cls, header: CheckpointHeader) -> HighWater:
        """The mark that names the checkpoint with `header`."""
        return cls(header.step, blob_digest(header), timeline_of(header))

    def names(self, header: CheckpointHeader) -> bool:
        """True if `header` is the checkpoint this mark names (same blob)."""
        return header.step == self.step and blob_digest(header) == self.digest

    def __str__(self) -> str:
        return f"step {self.step} (sha256 {self.digest[:16]}...)"


def new_timeline() -> str:
    """A fresh run id: random, so two runs never share one by accident."""
    return secrets.token_hex(8)


def timeline_of(header: CheckpointHeader) -> str:
    """The run `header` belongs to ("" when it predates timelines)."""
    return header.metadata.get(TIMELINE_KEY, "")


def previous_of(header: CheckpointHeader) -> tuple[int, str] | None:
    """(step, digest) of the mark acknowledged before `header` was written, if it records one."""
    step = header.metadata.get(PREVIOUS_STEP_KEY, "")
    digest = header.metadata.get(PREVIOUS_DIGEST_KEY, "")
    if not re.fullmatch(r"\d{1,20}", step) or not digest:
        return None
    return int(step), digest


@dataclass(frozen=True)
class Lineage:
    """What a job's next checkpoint records about its past: its run, the mark before it."""

    timeline: str
    previous: HighWater | None = None

    def metadata(self) -> dict[str, str]:
        """The metadata entries (sealed under the MAC with the rest)."""
        entries = {TIMELINE_KEY: self.timeline}
        if self.previous is not None:
            entries[PREVIOUS_STEP_KEY] = str(self.previous.step)
            entries[PREVIOUS_DIGEST_KEY] = self.previous.digest
        return entries

    def after(self, mark: HighWater) -> Lineage:
        """The lineage once `mark` is acknowledged: same run, `mark` before the next."""
        return Lineage(self.timeline, mark)


@dataclass(frozen=True)
class Rollback:
    """Why the store's answer is older than what was acknowledged.

    Attributes:
        found_step: the step the store would resume from (None: no checkpoint at all).
        expected_step: the newest step known to have been acknowledged.
        reasons: each finding, in words naming the steps.
    """

    found_step: int | None
    expected_step: int
    reasons: tuple[str, ...]

    @property
    def found(self) -> str:
        """What resuming would start from, in words."""
        return "step 0 (no checkpoint)" if self.found_step is None else f"step {self.found_step}"


def judge(
    reading: StoreReading,
    mark: HighWater | None,
    authentic: Callable[[CheckpointHeader], bool],
) -> Rollback | None:
    """Whether resuming from `reading.checkpoint` would go back behind an acknowledged save.

    Args:
        reading: what the store holds for the job.
        mark: the coordinator's own high-water mark for (store, job), if it has one.
        authentic: whether a header's MAC verifies (always False without a token):
            only authentic blobs beyond the pointer count as evidence.

    Returns:
        None when the checkpoint found is the newest acknowledged one as far as anyone
        can tell; else the findings.
    """
    found = reading.checkpoint.header if reading.checkpoint is not None else None
    reasons: list[str] = []
    expected = -1
    for skipped in reading.skipped:
        named = " (the one the latest pointer names)" if skipped.step == reading.pointer else ""
        reasons.append(
            f"the checkpoint of step {skipped.step}{named} was passed over: {skipped.reason}"
        )
        expected = max(expected, skipped.step)
    if mark is not None and not _continues(found, mark):
        expected = max(expected, mark.step)
        reasons.append(_behind_mark(found, mark))
    if found is not None:
        found_digest = blob_digest(found)
        for header in reading.beyond_pointer:
            previous = previous_of(header)
            if previous is None or not authentic(header):
                continue
            if timeline_of(header) != timeline_of(found):
                continue  # another run's leftover (kept by a --fresh-start's pruning guard)
            step, digest = previous
            if step > found.step or (step == found.step and digest != found_digest):
                expected = max(expected, step)
                reasons.append(
                    f"the checkpoint of step {header.step}, beyond the latest pointer (step "
                    f"{reading.pointer}), records that step {step} (sha256 {digest[:16]}...) "
                    f"had been acknowledged before it was written"
                )
    if not reasons:
        return None
    return Rollback(None if found is None else found.step, expected, tuple(reasons))


def _continues(found: CheckpointHeader | None, mark: HighWater) -> bool:
    """True if `found` is the marked checkpoint or a legitimate successor of it."""
    if found is None:
        return False
    if mark.names(found):
        return True
    if previous_of(found) == (mark.step, mark.digest):
        return True  # saved right after the mark: the save that crashed before its mark
    return timeline_of(found) == mark.timeline and found.step > mark.step


def _behind_mark(found: CheckpointHeader | None, mark: HighWater) -> str:
    acknowledged = f"{mark}, the newest this coordinator had acknowledged (its high-water mark)"
    if found is None:
        return f"the store holds no checkpoint of the job, but it held {acknowledged}"
    if found.step < mark.step:
        return (
            f"the newest checkpoint it holds that verifies is step {found.step}, older than "
            f"{acknowledged}"
        )
    if found.step == mark.step:
        return (
            f"its checkpoint of step {found.step} (sha256 {blob_digest(found)[:16]}...) is not "
            f"{acknowledged}"
        )
    return (
        f"its newest checkpoint, step {found.step}, belongs to another run of the job (timeline "
        f"{timeline_of(found) or 'none'}) than {acknowledged} (timeline {mark.timeline or 'none'}):"
        " a checkpoint from before a --fresh-start?"
    )


def refusal(description: str, job_id: str, rollback: Rollback, mark_path: str | None) -> str:
    """The reason a job is refused (with a token): what was found, what was expected, what
    to do."""
    accept = ""
    if rollback.found_step is not None:
        step = rollback.found_step
        accept = (
            f" To resume from step {step} deliberately, delete the store's checkpoints newer "
            f"than step {step}, point its latest at step {step}"
            + (f" and delete the high-water mark {mark_path}" if mark_path else "")
            + "."
        )
    return (
        f"refusing to resume job '{job_id}' from {description}: "
        + "; ".join(rollback.reasons)
        + f". Resuming would start from {rollback.found} although step "
        f"{rollback.expected_step} was acknowledged: the store was rolled back, damaged or "
        "tampered with, and with a token the coordinator never falls back to an older "
        f"checkpoint on the store's word. Restore the checkpoint of step "
        f"{rollback.expected_step} (e.g. from a backup), or restart the coordinator with "
        "--fresh-start to train from step 0 (stored checkpoints are kept, the high-water "
        "mark is reset)." + accept
    )


def unauthenticated_warning(description: str, job_id: str, rollback: Rollback) -> str:
    """The error logged instead of a refusal when there is no token."""
    return (
        f"job '{job_id}' in {description}: "
        + "; ".join(rollback.reasons)
        + f". Resuming from {rollback.found} anyway, although step {rollback.expected_step} "
        "was acknowledged: without a token nothing in the store is authenticated, so a "
        "damaged store falls back to its newest checkpoint that verifies. Set a token to "
        "refuse instead; restart with --fresh-start to start over"
    )
