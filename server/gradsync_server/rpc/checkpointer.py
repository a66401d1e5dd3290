"""The coordinator's checkpoint store I/O: loading resume points and carrying out `Persist`.

Store calls block (fsync, a Redis round trip), and a hung store (a paused
Redis, a stuck NFS mount) can block for as long as it likes; on the event loop
that serves every worker stream that would freeze every job. So every store
call here (the load at a job's first Join, each save) runs in a small pool of
store threads and is awaited with a deadline (`store_timeout_s`): past it the
call counts as failed (the job is refused, or the save reported not durable)
while the thread finishes or times out on its own. What a failed call means (a
warning, or the end of the job under `--require-checkpoint`) is policy the
servicer should not spell out; this module answers with the actions to carry
out and leaves delivery to the servicer. The pure half of checkpointing
(collecting uploads, the resume point) lives in `gradsync_server.control.persistence`;
what binds a checkpoint to its job and model (signature digest, MAC) in
`gradsync_server.store.checkpoint_seal`.

Loading never falls back to a fresh start by itself: a store that cannot be read,
or a checkpoint that is not this model's or does not verify under the token,
refuses the job (FAILED_PRECONDITION) with a message naming the job, the step,
the store and the mismatch. `--fresh-start` is the explicit way to start at step
0; the checkpoints already stored are kept (see `PruneGuard`).

Nor does it go back behind an acknowledged save on the store's word: each save
records the job's lineage in the sealed metadata and then its high-water mark in
the state directory (`gradsync_server.store.high_water`), and with a token a
store whose answer is older than either (its pointer moved back, its newest blob
deleted, damaged or another job's, or the store emptied) refuses the job, naming
both steps. Without a token the finding is logged as an error and the job
resumes from what the store holds, as it always did: nothing there is
authenticated, so accidents and attacks cannot be told apart.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TypeVar

from gradsync_proto.auth import derive_key
from gradsync_proto.codes import Code
from gradsync_proto.v1 import gradsync_pb2 as pb

from gradsync_server.config import CoordinatorConfig
from gradsync_server.control.job import Job
from gradsync_server.dataplane.actions import Action, Persist, Send, Terminate
from gradsync_server.rpc.outer_records import OuterRecords, outer_state_key
from gradsync_server.store import checkpoint_seal, high_water
from gradsync_server.store.checkpoint import (
    Checkpoint,
    CheckpointError,
    CheckpointStore,
    PruneGuard,
)
from gradsync_server.store.high_water import HighWater, Lineage, Rollback
from gradsync_server.store.high_water_file import HighWaterError, HighWaterMarks
from gradsync_server.store.outer_marks import OuterMarks

log = logging.getLogger("gradsync.server")

#: Status of the streams ended because a required checkpoint failed. Not
#: UNAVAILABLE (that means "the coordinator is going away" and sends workers
#: down the reconnect path): the job cannot go on under its own rule, which is
#: a failed precondition of training on; the StreamEnd reason says which.
CHECKPOINT_FAILED_CODE = Code.FAILED_PRECONDITION

#: Threads for store calls. A few, so that one hung call does not hold up the
#: others, and apart from the default executor so store trouble starves nothing else.
STORE_THREADS = 4

_Result = TypeVar("_Result")
#: The outcome of loading a job's resume point: the checkpoint, or why the job is refused.
LoadResult = tuple[Checkpoint | None, tuple[Code, str] | None]


@dataclass(frozen=True)
class _Loaded:
    """(store thread) What a load found, before the policy turns it into a `LoadResult`."""

    checkpoint: Checkpoint | None
    mismatch: str | None = None  # why this model may not resume it (signature, MAC)
    rollback: Rollback | None = None  # why it is behind an acknowledged save


class Checkpointer:
    """Reads and writes the checkpoints of every job of one coordinator.

    Args:
        config: the coordinator's configuration (`require_checkpoint`, `resume`,
            `fresh_start`, `store_timeout_s`, and `token` for the checkpoint MAC).
        store: where checkpoints live; None when none is configured.
    """

    def __init__(self, config: CoordinatorConfig, store: CheckpointStore | None) -> None:
        self.config = config
        self.store = store
        #: Saves that failed since start-up (for logs).
        self.failures = 0
        self._key = derive_key(config.token, checkpoint_seal.KEY_PURPOSE) if config.token else None
        self._executor = ThreadPoolExecutor(STORE_THREADS, thread_name_prefix="gradsync-store")
        #: DiLoCo outer-state records, next to the checkpoints (`outer_records`).
        self.outer = OuterRecords(
            store,
            config.store_timeout_s,
            outer_state_key(config),
            OuterMarks(config.state_dir) if config.state_dir and store is not None else None,
        )
        #: Loads in progress, by (job id, signature digest): ranks joining meanwhile share one.
        self._loads: dict[tuple[str, str], asyncio.Task[LoadResult]] = {}
        #: Where the high-water marks live (None: no state directory configured).
        self.marks = (
            HighWaterMarks(config.state_dir)
            if config.state_dir is not None and store is not None
            else None
        )
        #: Per job id: what its next checkpoint records (store threads read and replace it).
        self._lineages: dict[str, Lineage] = {}
        #: Per job id: held across a save and its mark, so that two saves of one job cannot
        #: interleave and leave the mark naming another checkpoint than the pointer.
        self._job_locks: dict[str, threading.Lock] = {}
        self._locks_lock = threading.Lock()

    def close(self) -> None:
        """Stop the store threads (a call still running finishes in the background)."""
        self.outer.close()
        self._executor.shutdown(wait=False, cancel_futures=True)

    async def _call(self, what: str, function: Callable[..., _Result], *args: object) -> _Result:
        """Run a blocking store call in a store thread, bounded by `store_timeout_s`.

        Raises:
            CheckpointError: the call failed, or did not finish in time.
        """
        loop = asyncio.get_running_loop()
        timeout_s = self.config.store_timeout_s
        try:
            return await asyncio.wait_for(
                loop.run_in_executor(self._executor, function, *args), timeout_s
            )
        except TimeoutError as exc:
            where = self.store.description if self.store is not None else "the store"
            raise CheckpointError(
                f"{where}: {what} did not finish within --store-timeout {timeout_s:g}s "
                "(is the store hung or unreachable?)"
            ) from exc

    async def load_resume(self, job_id: str, signature: pb.ModelSignature) -> LoadResult:
        """The checkpoint a new job resumes from, or why the job must be refused.

        Runs in a store thread with a deadline; Joins of the same job (and model)
        that arrive meanwhile wait for the same load.

        Args:
            job_id: the job about to be created.
            signature: the joining rank's model signature (the checkpoint must match it).
        """
        if self.store is None:
            return None, None
        if self.config.fresh_start:
            log.warning(
                "job '%s' starts at step 0 (--fresh-start): its checkpoints in %s are not read, "
                "none newer than what this run saves is deleted, and its high-water mark is "
                "reset",
                job_id,
                self.store.description,
            )
            try:
                await self._call(f"resetting the mark of job {job_id!r}", self._start_over, job_id)
            except CheckpointError as exc:
                log.error("job '%s': %s", job_id, exc)
            return None, None
        digest = checkpoint_seal.signature_digest(signature)
        key = (job_id, digest)
        task = self._loads.get(key)
        if task is None:
            task = asyncio.create_task(self._load(job_id, digest))
            self._loads[key] = task
            task.add_done_callback(lambda _: self._loads.pop(key, None))
        # Shielded: a joining stream that goes away must not cancel the others' load.
        return await asyncio.shield(task)

    async def _load(self, job_id: str, digest: str) -> LoadResult:
        store = self.store
        if store is None:
            return None, None
        try:
            loaded = await self._call(
                f"loading the checkpoints of job {job_id!r}", self._load_and_verify, job_id, digest
            )
        except (CheckpointError, ValueError) as exc:  # ValueError: a job id the store refuses
            # Never "start fresh" here: the job's first save would be step 0's, and this
            # store's newer, acknowledged checkpoints (unreadable just now: a Redis
            # outage, a damaged file) must not be replaced by it.
            return None, (
                Code.FAILED_PRECONDITION,
                f"cannot read the checkpoints of job '{job_id}' from "
                f"{store.description}{self._flags()}: {exc}; refusing to start it from "
                "scratch, which would replace newer checkpoints with step 0's. Bring the "
                "store back (or repair it), then start the workers again; to train from "
                "step 0 on purpose, restart the coordinator with --fresh-start (stored "
                "checkpoints are kept) or use another --job-id",
            )
        checkpoint, mismatch, rollback = loaded.checkpoint, loaded.mismatch, loaded.rollback
        if rollback is not None:
            if self._key is not None:
                mark_path = self.marks.path(store.description, job_id) if self.marks else None
                return None, (
                    Code.FAILED_PRECONDITION,
                    high_water.refusal(
                        store.description,
                        job_id,
                        rollback,
                        None if mark_path is None else str(mark_path),
                    ),
                )
            log.error("%s", high_water.unauthenticated_warning(store.description, job_id, rollback))
        if checkpoint is None:
            if self.config.resume:
                return None, (
                    Code.FAILED_PRECONDITION,
                    f"--resume is set but {store.description} holds no checkpoint of job "
                    f"'{job_id}' (was the store emptied, e.g. Redis restarted without its "
                    "append-only file?); refusing to start it from scratch",
                )
            return None, None
        if mismatch is not None:
            return None, (
                Code.FAILED_PRECONDITION,
                f"refusing to resume job '{job_id}' from its checkpoint of step "
                f"{checkpoint.step} in {store.description}: {mismatch}. Remove that "
                "checkpoint, use another --job-id, or restart the coordinator with "
                "--fresh-start to train from step 0 (stored checkpoints are kept)",
            )
        if checkpoint_seal.SIGNATURE_KEY not in checkpoint.metadata:
            log.warning(
                "job '%s': the checkpoint of step %d in %s predates model signatures in "
                "checkpoints; resuming without checking that it is this model's",
                job_id,
                checkpoint.step,
                store.description,
            )
        elif self._key is None and checkpoint_seal.MAC_KEY in checkpoint.metadata:
            log.warning(
                "job '%s': the checkpoint of step %d in %s carries a MAC but this coordinator "
                "has no token to verify it with; resuming unauthenticated",
                job_id,
                checkpoint.step,
                store.description,
            )
        log.warning(
            "job '%s' RESUMES from the checkpoint of step %d in %s (%d bytes)",
            job_id,
            checkpoint.step,
            store.description,
            len(checkpoint.payload),
        )
        return checkpoint, None

    def _load_and_verify(self, job_id: str, digest: str) -> _Loaded:
        """(store thread) The newest checkpoint of `job_id` and, if unusable, why.

        A checkpoint resumed from becomes the job's lineage, and its mark if none was kept
        (a new state directory starts guarding at once, not at the first save).
        """
        if self.store is None:
            return _Loaded(None)
        description = self.store.description
        reading = self.store.read(job_id)
        checkpoint = reading.checkpoint
        if checkpoint is not None:
            mismatch = checkpoint_seal.mismatch(checkpoint, digest, self._key)
            if mismatch is not None:
                return _Loaded(checkpoint, mismatch)
        mark = self._read_mark(job_id)
        key = self._key
        rollback = high_water.judge(
            reading, mark, lambda header: checkpoint_seal.authentic(header, key)
        )
        if rollback is not None and key is not None:
            return _Loaded(checkpoint, rollback=rollback)  # refused: nothing changes
        if checkpoint is None:
            self._set_lineage(job_id, Lineage(high_water.new_timeline(), mark))
            return _Loaded(None, rollback=rollback)
        resumed = HighWater.of(checkpoint.header)
        timeline = high_water.timeline_of(checkpoint.header) or high_water.new_timeline()
        self._set_lineage(job_id, Lineage(timeline, resumed))
        if mark is None and self.marks is not None:
            self._write_mark(job_id, resumed)
        log.debug("job '%s': resuming %s in %s", job_id, resumed, description)
        return _Loaded(checkpoint, rollback=rollback)

    def _read_mark(self, job_id: str) -> HighWater | None:
        """(store thread) The job's mark; an unusable one refuses the job only with a token."""
        if self.marks is None or self.store is None:
            return None
        try:
            return self.marks.read(self.store.description, job_id)
        except HighWaterError as exc:
            if self._key is not None:
                raise
            log.error("job '%s': %s; going on without it (no token)", job_id, exc)
            return None

    def _write_mark(self, job_id: str, mark: HighWater) -> None:
        """(store thread) Record `mark`; a failure only weakens the guard, so it only logs."""
        if self.marks is None or self.store is None:
            return
        try:
            self.marks.write(self.store.description, job_id, mark)
        except OSError as exc:
            log.error(
                "job '%s': could not record the high-water mark (%s) in %s: %s; a store "
                "rolled back to an older checkpoint would go unnoticed (check --state-dir)",
                job_id,
                mark,
                self.marks.directory,
                exc,
            )

    def _start_over(self, job_id: str) -> None:
        """(store thread) `--fresh-start`: a new run, with no mark before it."""
        self._set_lineage(job_id, Lineage(high_water.new_timeline()))
        if self.marks is None or self.store is None:
            return
        path = self.marks.path(self.store.description, job_id)
        try:
            self.marks.forget(self.store.description, job_id)
        except OSError as exc:
            raise CheckpointError(
                f"could not reset the high-water mark {path}: {exc}; the job's first save "
                "replaces it"
            ) from exc

    def _set_lineage(self, job_id: str, lineage: Lineage) -> None:
        with self._locks_lock:
            self._lineages[job_id] = lineage

    def _job_lock(self, job_id: str) -> threading.Lock:
        with self._locks_lock:
            return self._job_locks.setdefault(job_id, threading.Lock())

    def _flags(self) -> str:
        flags = [
            flag
            for flag, on in (
                ("--require-checkpoint", self.config.require_checkpoint),
                ("--resume", self.config.resume),
            )
            if on
        ]
        return f" ({' and '.join(flags)} is set)" if flags else ""

    async def persist(self, job: Job, action: Persist) -> list[Action]:
        """Seal and save a checkpoint off the event loop; return the acknowledgement to rank 0.

        Under `--require-checkpoint` a failed save also ends every rank's stream
        (`CHECKPOINT_FAILED_CODE`).
        """
        if self.store is None:
            durable = False
            message = "no checkpoint store configured (gradsync serve --checkpoint-store)"
        else:
            signature = job.membership.signature or pb.ModelSignature()
            checkpoint = Checkpoint(
                job_id=job.job_id,
                step=action.step,
                membership_epoch=job.membership_epoch,
                payload=action.blob,
                metadata={"world_size": str(job.world_size)},
            )
            # Counted before the save: a save that fails half-way may leave its blob,
            # which this job's later saves may then prune.
            job.persistence.wrote(action.step)
            guard = job.persistence.prune_guard()
            digest = checkpoint_seal.signature_digest(signature)
            try:
                await self._call(
                    f"saving job {job.job_id!r} step {action.step}",
                    self._seal_and_save,
                    checkpoint,
                    digest,
                    guard,
                )
                durable, message = True, self.store.description
                job.persistence.saved(action.step)
                log.info(
                    "job '%s': checkpoint of step %d is durable in %s (%d bytes)",
                    job.job_id,
                    action.step,
                    message,
                    len(action.blob),
                )
            except (CheckpointError, ValueError) as exc:
                self.failures += 1
                durable, message = False, str(exc)
                log.error(
                    "job '%s': checkpoint of step %d FAILED (%d failures so far): %s",
                    job.job_id,
                    action.step,
                    self.failures,
                    exc,
                )
        reply = pb.CoordinatorMessage(
            checkpoint_saved=pb.CheckpointSaved(step=action.step, durable=durable, message=message)
        )
        actions: list[Action] = [Send((0,), reply)]
        if not durable and self.config.require_checkpoint:
            actions.append(
                Terminate(
                    tuple(job.membership.ranks()),
                    CHECKPOINT_FAILED_CODE,
                    f"checkpoint of step {action.step} failed and --require-checkpoint is set: "
                    f"{message}",
                    pb.END_REASON_CHECKPOINT_FAILED,
                )
            )
        return actions

    def _seal_and_save(self, checkpoint: Checkpoint, digest: str, guard: PruneGuard) -> None:
        """(store thread) Seal `checkpoint` with its lineage, save it, then move the mark.

        The mark moves only once the store acknowledged the save: a save that failed
        leaves the mark (and the lineage) at the last acknowledged checkpoint.
        """
        if self.store is None:
            return
        job_id = checkpoint.job_id
        with self._job_lock(job_id):
            with self._locks_lock:
                lineage = self._lineages.get(job_id) or Lineage(high_water.new_timeline())
            metadata = {**checkpoint.metadata, **lineage.metadata()}
            with_lineage = Checkpoint(
                job_id, checkpoint.step, checkpoint.membership_epoch, checkpoint.payload, metadata
            )
            sealed = checkpoint_seal.seal(with_lineage, digest, self._key)
            self.store.save(sealed, guard)
            mark = HighWater.of(sealed.header)
            self._set_lineage(job_id, lineage.after(mark))
            self._write_mark(job_id, mark)
