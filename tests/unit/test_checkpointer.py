"""What a checkpoint save turns into: an acknowledgement, under --require-checkpoint an end, and
a new high-water mark; and what a load makes of a store behind that mark."""

from __future__ import annotations

import asyncio
import errno
import logging
from pathlib import Path

import pytest
from gradsync_proto.codes import Code
from gradsync_proto.v1 import gradsync_pb2 as pb
from gradsync_server.config import CoordinatorConfig
from gradsync_server.control.job import Job
from gradsync_server.control.settings import JobSettings
from gradsync_server.dataplane.actions import Persist, Send, Terminate
from gradsync_server.dataplane.budget import ByteBudget
from gradsync_server.rpc.checkpointer import Checkpointer
from gradsync_server.store.checkpoint import Checkpoint, CheckpointError, PruneGuard, StoreReading
from gradsync_server.store.checkpoint_file import FileCheckpointStore
from gradsync_server.store.high_water import HighWater, previous_of
from gradsync_server.store.high_water_file import HighWaterMarks
from support.rawclient import signature


class BrokenStore:
    """A store whose every save fails, as Redis does once it is gone."""

    description = "redis://gone:6379/0"

    def save(self, checkpoint: Checkpoint, guard: PruneGuard | None = None) -> None:
        raise CheckpointError(f"{self.description}: connection refused")

    def load_latest(self, job_id: str) -> Checkpoint | None:
        return None

    def read(self, job_id: str) -> StoreReading:
        return StoreReading(job_id, None, None)

    def steps(self, job_id: str) -> list[int]:
        return []

    def close(self) -> None:
        pass


def persist(require_checkpoint: bool) -> list[object]:
    config = CoordinatorConfig(
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
    config = CoordinatorConfig(world_size=2, checkpoint_store=str(tmp_path / "checkpoints"))
    resume, problem = asyncio.run(Checkpointer(config, store).load_resume("job", signature()))
    assert resume is None and problem is not None
    code, message = problem
    assert code is Code.FAILED_PRECONDITION
    assert "job 'job'" in message and "from scratch" in message and "--job-id" in message
    assert "--fresh-start" in message
    assert blob.read_bytes() == bytes(damaged)  # nothing was deleted or overwritten


# ------------------------------------------------------------------ the high-water mark
TOKEN = "t" * 32


def marked_checkpointer(tmp_path: Path, **options: object) -> Checkpointer:
    """A checkpointer on a real file store, its marks in a state directory of its own."""
    config = CoordinatorConfig(
        world_size=2,
        checkpoint_store=str(tmp_path / "store"),
        state_dir=str(tmp_path / "state"),
        **options,  # type: ignore[arg-type]
    )
    return Checkpointer(config, FileCheckpointStore(tmp_path / "store"))


def save(checkpointer: Checkpointer, *steps: int) -> None:
    job = Job("job", JobSettings(2, 4096, 8192), ByteBudget(1 << 20))
    job.membership.signature = signature()
    for step in steps:
        (ack, *_) = asyncio.run(checkpointer.persist(job, Persist(step, f"s{step}".encode())))
        assert isinstance(ack, Send) and isinstance(ack.message, pb.CoordinatorMessage)
        assert ack.message.checkpoint_saved.durable, ack.message


def load(checkpointer: Checkpointer) -> tuple[Checkpoint | None, tuple[Code, str] | None]:
    return asyncio.run(checkpointer.load_resume("job", signature()))


def mark_of(checkpointer: Checkpointer) -> HighWater | None:
    assert checkpointer.marks is not None and checkpointer.store is not None
    return checkpointer.marks.read(checkpointer.store.description, "job")


def test_each_acknowledged_save_moves_the_mark_and_records_the_one_before(
    tmp_path: Path,
) -> None:
    checkpointer = marked_checkpointer(tmp_path, token=TOKEN)
    save(checkpointer, 1, 2)
    assert checkpointer.store is not None
    two = checkpointer.store.load_latest("job")
    assert two is not None and mark_of(checkpointer) == HighWater.of(two.header)
    one_mark = previous_of(two.header)
    assert one_mark is not None and one_mark[0] == 1
    assert two.metadata["timeline"] and len(two.metadata["timeline"]) == 16


def test_a_moved_pointer_is_refused_with_a_token_and_logged_without(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    save(marked_checkpointer(tmp_path, token=TOKEN), 1, 2, 3)
    (tmp_path / "store" / "job" / "latest").write_text("1\n")
    resume, problem = load(marked_checkpointer(tmp_path, token=TOKEN))
    assert resume is None and problem is not None and problem[0] is Code.FAILED_PRECONDITION
    assert "start from step 1 although step 3 was acknowledged" in problem[1]
    caplog.set_level(logging.ERROR, logger="gradsync.server")
    resume, problem = load(marked_checkpointer(tmp_path))  # no token: resumed, loudly
    assert problem is None and resume is not None and resume.step == 1
    assert any("Resuming from step 1 anyway" in r.getMessage() for r in caplog.records)


def test_a_save_whose_mark_was_lost_still_resumes(tmp_path: Path) -> None:
    """Acknowledged by the store, then the mark could not be written (a crash, a full disk):
    the checkpoint records the mark before it, so it is accepted as its successor."""
    checkpointer = marked_checkpointer(tmp_path, token=TOKEN)
    save(checkpointer, 1, 2)

    def disk_full(descriptor: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    checkpointer.marks = HighWaterMarks(tmp_path / "state", fsync=disk_full)
    save(checkpointer, 3)  # still acknowledged: the checkpoint itself is durable
    assert len(list((tmp_path / "state" / "high-water").iterdir())) == 1  # no temp file left
    mark = mark_of(checkpointer)
    assert mark is not None and mark.step == 2
    resume, problem = load(marked_checkpointer(tmp_path, token=TOKEN))
    assert problem is None and resume is not None and resume.step == 3


def test_saving_a_resumed_step_again_keeps_the_job_resumable(tmp_path: Path) -> None:
    save(marked_checkpointer(tmp_path, token=TOKEN), 1, 3)
    resumed = marked_checkpointer(tmp_path, token=TOKEN)
    first, problem = load(resumed)
    assert problem is None and first is not None and first.step == 3
    save(resumed, 3)  # rank 0 saved right after resuming: another blob of step 3
    again, problem = load(marked_checkpointer(tmp_path, token=TOKEN))
    assert problem is None and again is not None and again.step == 3
    assert again != first and again.metadata["timeline"] == first.metadata["timeline"]


def test_fresh_start_resets_the_mark_and_starts_a_new_run(tmp_path: Path) -> None:
    save(marked_checkpointer(tmp_path, token=TOKEN), 1, 2, 3)
    old = mark_of(marked_checkpointer(tmp_path))
    fresh = marked_checkpointer(tmp_path, token=TOKEN, fresh_start=True)
    assert load(fresh) == (None, None)
    assert mark_of(fresh) is None
    save(fresh, 1)
    new = mark_of(fresh)
    assert new is not None and old is not None and new.timeline != old.timeline
    resume, problem = load(marked_checkpointer(tmp_path, token=TOKEN))
    assert problem is None and resume is not None and resume.step == 1


def test_an_unusable_mark_refuses_with_a_token_and_is_skipped_without(tmp_path: Path) -> None:
    save(marked_checkpointer(tmp_path, token=TOKEN), 1)
    checkpointer = marked_checkpointer(tmp_path, token=TOKEN)
    assert checkpointer.marks is not None and checkpointer.store is not None
    path = checkpointer.marks.path(checkpointer.store.description, "job")
    path.write_text("{")
    _, problem = load(checkpointer)
    assert problem is not None and str(path) in problem[1] and "unusable" in problem[1]
    resume, problem = load(marked_checkpointer(tmp_path))
    assert problem is None and resume is not None and resume.step == 1


def test_following_the_refusal_resumes_from_the_older_step_deliberately(tmp_path: Path) -> None:
    """The refusal's own way out: delete the newer checkpoints, point latest at the older
    one, delete the mark; then (and only then) the job resumes from it."""
    save(marked_checkpointer(tmp_path, token=TOKEN), 1, 2, 3)
    job_dir = tmp_path / "store" / "job"
    newest = job_dir / f"step-{3:020d}.ckpt"
    blob = bytearray(newest.read_bytes())
    blob[-1] ^= 0x01  # one damaged bit: always a change (the last byte is a random checksum's)
    newest.write_bytes(bytes(blob))
    checkpointer = marked_checkpointer(tmp_path, token=TOKEN)
    _, problem = load(checkpointer)
    assert problem is not None and "point its latest at step 2" in problem[1]
    mark_path = problem[1].rsplit("delete the high-water mark ", 1)[1].rstrip(".")
    newest.unlink()
    (job_dir / "latest").write_text("2\n")
    assert load(marked_checkpointer(tmp_path, token=TOKEN))[1] is not None  # the mark remains
    Path(mark_path).unlink()
    resume, problem = load(marked_checkpointer(tmp_path, token=TOKEN))
    assert problem is None and resume is not None and resume.step == 2
