"""What a checkpoint save turns into: an acknowledgement, and under --require-checkpoint an end."""

from __future__ import annotations

import asyncio
from pathlib import Path

from gradsync_proto.codes import Code
from gradsync_proto.v1 import gradsync_pb2 as pb
from gradsync_server.config import ServerConfig
from gradsync_server.control.job import Job
from gradsync_server.control.settings import JobSettings
from gradsync_server.dataplane.actions import Persist, Send, Terminate
from gradsync_server.dataplane.budget import ByteBudget
from gradsync_server.rpc.checkpointer import Checkpointer
from gradsync_server.store.checkpoint import Checkpoint, CheckpointError, PruneGuard
from gradsync_server.store.checkpoint_file import FileCheckpointStore
from support.rawclient import signature


class BrokenStore:
    """A store whose every save fails, as Redis does once it is gone."""

    description = "redis://gone:6379/0"

    def save(self, checkpoint: Checkpoint, guard: PruneGuard | None = None) -> None:
        raise CheckpointError(f"{self.description}: connection refused")

    def load_latest(self, job_id: str) -> Checkpoint | None:
        return None

    def steps(self, job_id: str) -> list[int]:
        return []

    def close(self) -> None:
        pass


def persist(require_checkpoint: bool) -> list[object]:
    config = ServerConfig(
        world_size=2,
        checkpoint_store="redis://gone:6379/0",
        require_checkpoint=require_checkpoint,
    )
    checkpointer = Checkpointer(config, BrokenStore())
    job = Job("job", JobSettings(2, 4096, 8192), ByteBudget(1 << 20))
    actions = asyncio.run(checkpointer.persist(job, Persist(4, b"state")))
    assert checkpointer.failures == 1 and job.persistence.last_checkpoint_step == -1
    return list(actions)


def test_a_failed_save_is_acknowledged_as_not_durable() -> None:
    (ack,) = persist(require_checkpoint=False)
    assert isinstance(ack, Send) and ack.ranks == (0,)
    assert isinstance(ack.message, pb.CoordinatorMessage)
    saved = ack.message.checkpoint_saved
    assert (saved.step, saved.durable) == (4, False) and "connection refused" in saved.message


def test_a_required_checkpoint_that_fails_ends_the_job_by_cause() -> None:
    _, end = persist(require_checkpoint=True)
    assert isinstance(end, Terminate)
    # Not UNAVAILABLE: the coordinator is not going away, so workers must not reconnect.
    assert end.code is Code.FAILED_PRECONDITION
    assert end.reason == pb.END_REASON_CHECKPOINT_FAILED
    assert "--require-checkpoint is set" in end.details


def test_an_unreadable_store_refuses_the_job_instead_of_starting_it_from_scratch(
    tmp_path: Path,
) -> None:
    """A real file store whose only checkpoint is damaged: starting at step 0 would save
    over it (and prune it), so the job is refused and the blob stays where it is."""
    store = FileCheckpointStore(tmp_path / "checkpoints")
    store.save(
        Checkpoint(job_id="job", step=50, membership_epoch=0, payload=b"state" * 100, metadata={})
    )
    (blob,) = [p for p in store.job_directory("job").iterdir() if "50" in p.name]
    damaged = bytearray(blob.read_bytes())
    damaged[-10:] = bytes(10)
    blob.write_bytes(bytes(damaged))
    config = ServerConfig(world_size=2, checkpoint_store=str(tmp_path / "checkpoints"))
    resume, problem = asyncio.run(Checkpointer(config, store).load_resume("job", signature()))
    assert resume is None and problem is not None
    code, message = problem
    assert code is Code.FAILED_PRECONDITION
    assert "job 'job'" in message and "from scratch" in message and "--job-id" in message
    assert "--fresh-start" in message
    assert blob.read_bytes() == bytes(damaged)  # nothing was deleted or overwritten
