"""Reading a job's checkpoints from a store: the one to resume from, and what was passed over.

Both backends find the checkpoint to resume from the same way (`read_newest`): the blob the
`latest` pointer names, else the newest older one that verifies, each skip logged. That
fall-back is right for an accident (a disk that lost a write) and wrong for an attack (someone
who can write the store deletes or damages the newest blob to make the job resume from an
older one): the two look the same from inside the store. So the answer is a `StoreReading`
that also says what was skipped and why, and which verified blobs lie beyond the pointer,
and the coordinator's checkpointer decides, with its token and its own high-water mark
(`gradsync_server.store.high_water`), whether the result may be used.

Blobs beyond the pointer are leftovers of saves that never completed (or of a timeline
abandoned by a fresh start); they are never resumed from, but their MAC-covered metadata
can prove that the pointer was moved back, so their headers are kept (never their payloads:
each may be as large as `--max-checkpoint-mb`, and a hostile store may hold many).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from gradsync_server.store.checkpoint import (
    Checkpoint,
    CheckpointCorruptError,
    CheckpointError,
    CheckpointHeader,
    decode,
)

log = logging.getLogger("gradsync.server.checkpoint")  # one logger for the whole store


@dataclass(frozen=True)
class Skipped:
    """A candidate the loader passed over: its step, and why (missing, corrupt, foreign)."""

    step: int
    reason: str


@dataclass(frozen=True)
class StoreReading:
    """What a store holds for one job, as far as resuming it goes.

    Attributes:
        job_id: the job read.
        pointer: the step the `latest` pointer names (None: no readable pointer).
        checkpoint: what `load_latest` returns: the pointed checkpoint, else the newest
            older one that verifies; None when the job has no stored blob at all.
        skipped: candidates tried before `checkpoint` and refused, newest first; empty when
            the first candidate (the pointed one, or the newest stored) verified.
        beyond_pointer: headers of the blobs newer than the pointer that verify (checksum
            and job id; the MAC is the checkpointer's to check), newest first.
    """

    job_id: str
    pointer: int | None
    checkpoint: Checkpoint | None
    skipped: tuple[Skipped, ...] = ()
    beyond_pointer: tuple[CheckpointHeader, ...] = ()


def _verified(job_id: str, step: int, blob: bytes | None) -> Checkpoint | str:
    """The checkpoint in `blob` if it is `job_id`'s at `step`, else why not."""
    if blob is None:
        return "its blob is missing"
    try:
        checkpoint = decode(blob)
    except CheckpointCorruptError as exc:
        return f"it is corrupt: {exc}"
    if (checkpoint.job_id, checkpoint.step) != (job_id, step):
        return f"its blob holds job {checkpoint.job_id!r} step {checkpoint.step}"
    return checkpoint


def read_newest(
    description: str,
    job_id: str,
    pointer: int | None,
    stored: list[int],
    read_blob: Callable[[int], bytes | None],
) -> StoreReading:
    """The pointed checkpoint, else the newest older one that verifies (both backends).

    Raises:
        CheckpointError: checkpoints exist but none verifies.
    """
    if pointer is None:
        if not stored:
            return StoreReading(job_id, None, None)
        log.warning(
            "%s: job %r has checkpoints for steps %s but no readable latest pointer (a save "
            "crashed before its first pointer flip?); trying the newest that verifies",
            description,
            job_id,
            stored,
        )
        candidates = sorted(stored, reverse=True)
        unacknowledged: list[int] = []
    else:
        unacknowledged = sorted((step for step in stored if step > pointer), reverse=True)
        if unacknowledged:
            log.warning(
                "%s: job %r: ignoring steps %s, newer than the latest pointer (step %d): their "
                "saves never completed",
                description,
                job_id,
                sorted(unacknowledged),
                pointer,
            )
        candidates = [pointer, *sorted((step for step in stored if step < pointer), reverse=True)]
    beyond: list[CheckpointHeader] = []
    for step in unacknowledged:
        leftover = _verified(job_id, step, read_blob(step))
        if isinstance(leftover, Checkpoint):
            beyond.append(leftover.header)  # the payload is dropped here
    skipped: list[Skipped] = []
    for step in candidates:
        found = _verified(job_id, step, read_blob(step))
        if isinstance(found, Checkpoint):
            return StoreReading(job_id, pointer, found, tuple(skipped), tuple(beyond))
        skipped.append(Skipped(step, found))
        log.warning(
            "%s: skipping the checkpoint of job %r at step %d because %s; falling back to an "
            "older one",
            description,
            job_id,
            step,
            found,
        )
    raise CheckpointError(
        f"{description}: loading job {job_id!r} failed: no checkpoint verifies (tried steps "
        f"{candidates}, see the warnings above); refusing to start the job from scratch: "
        f"delete its checkpoints to do that deliberately"
    )
