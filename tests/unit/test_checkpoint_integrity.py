"""Checkpoint integrity: sealed with the model's signature and a MAC, never pruned past what a
job resumed from, loaded off the event loop with a deadline, and session secrets per admission.

Stores here are real (files under tmp_path); the Checkpointer runs on a real event loop.
"""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import pytest
from gradsync_proto.auth import derive_key
from gradsync_proto.codes import Code
from gradsync_proto.v1 import gradsync_pb2 as pb
from gradsync_server.config import CoordinatorConfig
from gradsync_server.control.job import Job
from gradsync_server.control.membership import SESSION_BYTES, Membership
from gradsync_server.control.settings import JobSettings
from gradsync_server.dataplane.actions import Persist
from gradsync_server.dataplane.budget import ByteBudget
from gradsync_server.dataplane.plane import JobPlane
from gradsync_server.rpc.checkpointer import Checkpointer
from gradsync_server.store import checkpoint_seal
from gradsync_server.store.checkpoint import Checkpoint, PruneGuard, StoreReading, _doomed_steps
from gradsync_server.store.checkpoint_file import FileCheckpointStore
from support.rawclient import signature

TOKEN = "t" * 32
KEY = derive_key(TOKEN, checkpoint_seal.KEY_PURPOSE)
DIGEST = checkpoint_seal.signature_digest(signature())


def checkpoint(step: int = 7, payload: bytes = b"state" * 50, job_id: str = "job") -> Checkpoint:
    return Checkpoint(job_id, step, 0, payload, {"world_size": "2"})


def config(store: Path, **options: object) -> CoordinatorConfig:
    return CoordinatorConfig(world_size=2, checkpoint_store=str(store), **options)  # type: ignore[arg-type]


def load(checkpointer: Checkpointer, sig: pb.ModelSignature | None = None) -> tuple[object, object]:
    return asyncio.run(checkpointer.load_resume("job", sig or signature()))


# ------------------------------------------------------------------ the seal
def test_a_sealed_checkpoint_verifies_and_any_change_breaks_its_mac() -> None:
    sealed = checkpoint_seal.seal(checkpoint(), DIGEST, KEY)
    assert checkpoint_seal.mismatch(sealed, DIGEST, KEY) is None
    metadata = dict(sealed.metadata)
    for forged in (
        Checkpoint("job", 1000, 0, sealed.payload, metadata),  # the step moved ahead
        Checkpoint("job", 7, 0, sealed.payload + b"!", metadata),  # the payload changed
        Checkpoint("other", 7, 0, sealed.payload, metadata),  # another job's checkpoint
    ):
        problem = checkpoint_seal.mismatch(forged, DIGEST, KEY)
        assert problem is not None and "MAC does not verify" in problem
    other_key = derive_key("u" * 32, checkpoint_seal.KEY_PURPOSE)
    assert "MAC" in (checkpoint_seal.mismatch(sealed, DIGEST, other_key) or "")
    unsigned = checkpoint_seal.seal(checkpoint(), DIGEST, None)
    assert "carries no MAC" in (checkpoint_seal.mismatch(unsigned, DIGEST, KEY) or "")
    other_model = checkpoint_seal.signature_digest(signature(weight_shape=(8, 4)))
    assert "different model" in (checkpoint_seal.mismatch(unsigned, other_model, None) or "")
    # The bucket layout is not the model: another bucket cap keeps the digest.
    rebucketed = signature()
    rebucketed.buckets[0].parameter_indices[:] = [0, 1]
    assert checkpoint_seal.signature_digest(rebucketed) == DIGEST


def test_a_planted_checkpoint_refuses_the_job_naming_it_and_the_mismatch(tmp_path: Path) -> None:
    """Written straight into the store (no MAC, as anyone with store access could) or by
    another model: with a token, loading refuses the job, and the blob stays."""
    store = FileCheckpointStore(tmp_path / "store")
    store.save(checkpoint(step=1000))
    checkpointer = Checkpointer(config(tmp_path / "store", token=TOKEN), store)
    resume, problem = load(checkpointer)
    assert resume is None and problem is not None
    code, message = problem  # type: ignore[misc]
    assert code is Code.FAILED_PRECONDITION
    assert "job 'job'" in message and "step 1000" in message and store.description in message
    assert "no MAC" in message and "--fresh-start" in message
    assert store.steps("job") == [1000]
    # Sealed under another token: refused as well.
    store.save(
        checkpoint_seal.seal(checkpoint(step=1001), DIGEST, derive_key("u" * 32, "checkpoint"))
    )
    _, problem = load(checkpointer)
    assert problem is not None and "does not verify" in problem[1]  # type: ignore[index]


def test_a_sealed_checkpoint_resumes_and_another_models_is_refused(tmp_path: Path) -> None:
    store = FileCheckpointStore(tmp_path / "store")
    checkpointer = Checkpointer(config(tmp_path / "store", token=TOKEN), store)
    job = Job("job", JobSettings(2, 4096, 8192), ByteBudget(1 << 20))
    job.membership.signature = signature()
    (ack,) = asyncio.run(checkpointer.persist(job, Persist(3, b"weights" * 10)))
    assert ack.message.checkpoint_saved.durable  # type: ignore[union-attr]
    resume, problem = load(checkpointer)
    assert problem is None and isinstance(resume, Checkpoint) and resume.step == 3
    assert resume.payload == b"weights" * 10
    _, problem = load(checkpointer, signature(weight_shape=(8, 4)))
    assert problem is not None and "different model" in problem[1]  # type: ignore[index]


def test_fresh_start_reads_nothing_and_deletes_nothing_newer(tmp_path: Path) -> None:
    """An unreadable store under --fresh-start: the job starts at step 0, and its saves keep
    the newer checkpoints it did not write (pruning only its own)."""
    store = FileCheckpointStore(tmp_path / "store", keep=1)
    store.save(checkpoint(step=50))
    (blob,) = store.job_directory("job").glob("step-*.ckpt")
    blob.write_bytes(b"damaged")  # unreadable: without --fresh-start the job is refused
    refused = Checkpointer(config(tmp_path / "store"), store)
    assert load(refused)[1] is not None
    checkpointer = Checkpointer(config(tmp_path / "store", fresh_start=True), store)
    assert load(checkpointer) == (None, None)
    job = Job("job", JobSettings(2, 4096, 8192), ByteBudget(1 << 20))
    job.membership.signature = signature()
    for step in (2, 4, 6):
        asyncio.run(checkpointer.persist(job, Persist(step, b"x")))
    assert store.steps("job") == [6, 50]  # its own 2 and 4 pruned (keep=1), 50 kept
    assert blob.read_bytes() == b"damaged"
    with pytest.raises(ValueError, match="--fresh-start and --resume"):
        config(tmp_path / "store", fresh_start=True, resume=True)


def test_pruning_never_deletes_a_newer_checkpoint_the_job_did_not_write() -> None:
    stored = [10, 20, 22, 50]
    assert _doomed_steps(stored, 22, keep=1) == [10, 20, 50]  # unguarded: today's rule
    guard = PruneGuard(resumed_from=20, written=frozenset({22}))
    assert _doomed_steps(stored, 22, keep=1, guard=guard) == [10, 20]
    assert _doomed_steps([*stored, 24], 24, keep=1, guard=PruneGuard(20, frozenset({22, 24}))) == [
        10,
        20,
        22,
    ]


class HungStore:
    """A store whose load blocks until released, as a paused Redis does."""

    description = "redis://hung:6379/0"

    def __init__(self) -> None:
        self.release = threading.Event()

    def load_latest(self, job_id: str) -> Checkpoint | None:
        return self.read(job_id).checkpoint

    def read(self, job_id: str) -> StoreReading:
        self.release.wait(10)
        return StoreReading(job_id, None, None)

    def save(self, checkpoint: Checkpoint, guard: PruneGuard | None = None) -> None:
        self.release.wait(10)

    def steps(self, job_id: str) -> list[int]:
        return []

    def close(self) -> None:
        pass


def test_a_hung_store_fails_the_load_at_the_deadline_without_blocking_the_loop() -> None:
    store = HungStore()
    checkpointer = Checkpointer(
        CoordinatorConfig(
            world_size=2, checkpoint_store="redis://hung:6379/0", store_timeout_s=0.3
        ),
        store,  # type: ignore[arg-type]
    )

    async def scenario() -> tuple[object, int]:
        ticks = 0

        async def ticker() -> None:
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1

        task = asyncio.create_task(ticker())
        started = time.monotonic()
        # Two ranks of the same job share one load.
        results = await asyncio.gather(
            checkpointer.load_resume("job", signature()),
            checkpointer.load_resume("job", signature()),
        )
        assert time.monotonic() - started < 2.0
        task.cancel()
        return results, ticks

    try:
        (first, second), ticks = asyncio.run(scenario())
    finally:
        store.release.set()
    assert first == second and first[1] is not None
    assert "did not finish within --store-timeout 0.3s" in first[1][1]
    assert ticks >= 10  # the loop kept running while the store hung


# ------------------------------------------------------------------ sessions
def test_every_admission_gets_its_own_session_and_a_rejoin_a_new_one() -> None:
    membership = Membership("job", 2, time.monotonic)
    join = pb.Join(job_id="job", rank=0, world_size=2, signature=signature(), incarnation="a")
    membership.admit(0, join)
    membership.admit(1, pb.Join(job_id="job", rank=1, world_size=2, signature=signature()))
    first = membership.session_of(0)
    assert len(first) == SESSION_BYTES and first != membership.session_of(1)
    assert first.hex() not in repr(membership.members[0])
    membership.remove(0, assembling=False)
    membership.admit_newcomer(0, join)  # same incarnation string, new admission
    assert membership.session_of(0) not in (b"", first)


def test_a_shard_drops_the_old_session_when_the_leader_announces_a_new_one() -> None:
    def view(session: bytes, epoch: int) -> pb.ShardJobView:
        return pb.ShardJobView(
            job_id="job",
            world_size=1,
            membership_epoch=epoch,
            members=[pb.ShardMember(rank=0, incarnation="a", session=session)],
            buckets=[pb.BucketSpec(dtype=pb.DTYPE_FLOAT32, num_elements=4096)],
            chunk_bytes=4096,
            shard_count=2,
        )

    old, new = b"o" * SESSION_BYTES, b"n" * SESSION_BYTES
    job = JobPlane.for_shard(view(old, 0), 1, "shard 1 at b:1", ByteBudget(1 << 20), time.monotonic)
    assert job.is_current(0, "a", old) and not job.is_current(0, "a", new)
    job.apply(view(new, 1))
    assert job.is_current(0, "a", new) and not job.is_current(0, "a", old)
    problem = job.session_refused(0, "a", old)
    assert problem is not None and "rank 0 of job 'job'" in problem and old.hex() not in problem
