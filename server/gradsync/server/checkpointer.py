"""The coordinator's checkpoint store I/O: loading resume points and carrying out `Persist`.

Store calls block (fsync, a Redis round trip), so they must not run on the
event loop that serves every worker stream; and what a failed save means
(a warning, or the end of the job under `--require-checkpoint`) is policy
that the servicer should not spell out. This module owns both: it runs
saves in a worker thread and answers with the actions to carry out (the
acknowledgement to rank 0, and the streams to end), leaving delivery to the
servicer. The pure half of checkpointing (collecting uploads, the resume
point) lives in `gradsync.server.persistence`.
"""

from __future__ import annotations

import asyncio
import logging

from gradsync.protocol.codes import Code
from gradsync.server.actions import Action, Persist, Send, Terminate
from gradsync.server.checkpoint import Checkpoint, CheckpointError, CheckpointStore
from gradsync.server.config import ServerConfig
from gradsync.server.job import Job
from gradsync.v1 import gradsync_pb2 as pb

log = logging.getLogger("gradsync.server")

#: Status of the streams ended because a required checkpoint failed. Not
#: UNAVAILABLE (that means "the coordinator is going away" and sends workers
#: down the reconnect path): the job cannot go on under its own rule, which is
#: a failed precondition of training on; the StreamEnd reason says which.
CHECKPOINT_FAILED_CODE = Code.FAILED_PRECONDITION


class Checkpointer:
    """Reads and writes the checkpoints of every job of one coordinator.

    Args:
        config: the coordinator's configuration (`require_checkpoint`, `resume`).
        store: where checkpoints live; None when none is configured.
    """

    def __init__(self, config: ServerConfig, store: CheckpointStore | None) -> None:
        self.config = config
        self.store = store
        #: Saves that failed since start-up (for logs).
        self.failures = 0

    def load_resume(self, job_id: str) -> tuple[Checkpoint | None, tuple[Code, str] | None]:
        """The checkpoint a new job resumes from, or why the job must be refused."""
        if self.store is None:
            return None, None
        try:
            # Blocking, but only once per job, when its first rank joins.
            checkpoint = self.store.load_latest(job_id)
        except CheckpointError as exc:
            # Never "start fresh" here: the job's first save would be step 0's and the
            # store's pruning would then delete the newer, acknowledged checkpoints
            # that could not be read just now (a Redis outage, a damaged file).
            flags = [
                flag
                for flag, on in (
                    ("--require-checkpoint", self.config.require_checkpoint),
                    ("--resume", self.config.resume),
                )
                if on
            ]
            also = f" ({' and '.join(flags)} is set)" if flags else ""
            return None, (
                Code.FAILED_PRECONDITION,
                f"cannot read the checkpoints of job '{job_id}' from "
                f"{self.store.description}{also}: {exc}; refusing to start it from scratch, "
                "which would replace newer checkpoints with step 0's. Bring the store back "
                "(or repair it), then start the workers again; to start over on purpose, "
                "use another --job-id or --checkpoint-store",
            )
        if checkpoint is None:
            if self.config.resume:
                return None, (
                    Code.FAILED_PRECONDITION,
                    f"--resume is set but {self.store.description} holds no checkpoint of job "
                    f"'{job_id}' (was the store emptied, e.g. Redis restarted without its "
                    "append-only file?); refusing to start it from scratch",
                )
            return None, None
        log.warning(
            "job '%s' RESUMES from the checkpoint of step %d in %s (%d bytes)",
            job_id,
            checkpoint.step,
            self.store.description,
            len(checkpoint.payload),
        )
        return checkpoint, None

    async def persist(self, job: Job, action: Persist) -> list[Action]:
        """Save a checkpoint off the event loop; return the acknowledgement to rank 0.

        Under `--require-checkpoint` a failed save also ends every rank's stream
        (`CHECKPOINT_FAILED_CODE`).
        """
        if self.store is None:
            durable, message = (
                False,
                "no checkpoint store configured (gradsync serve --checkpoint-store)",
            )
        else:
            checkpoint = Checkpoint(
                job_id=job.job_id,
                step=action.step,
                membership_epoch=job.membership_epoch,
                payload=action.blob,
                metadata={"world_size": str(job.world_size)},
            )
            try:
                await asyncio.to_thread(self.store.save, checkpoint)
                durable, message = True, self.store.description
                job.persistence.saved(action.step)
                log.info(
                    "job '%s': checkpoint of step %d is durable in %s (%d bytes)",
                    job.job_id,
                    action.step,
                    message,
                    len(action.blob),
                )
            except CheckpointError as exc:
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
                    tuple(job.joined_ranks()),
                    CHECKPOINT_FAILED_CODE,
                    f"checkpoint of step {action.step} failed and --require-checkpoint is set: "
                    f"{message}",
                    pb.END_REASON_CHECKPOINT_FAILED,
                )
            )
        return actions
