"""A checkpoint store rolled back behind the coordinator's back is refused, not resumed from.

Issue 22: with a token, pointing `latest` at an older step, deleting the newest checkpoint,
flipping one byte of it or swapping in another job's made a restarted job resume from an
older step with only a warning. Here real `gradsync serve` processes (token on) save
checkpoints of steps 1, 2 and 3 to a real store (the file store, and a real redis-server),
the store is tampered with between two coordinators, and the second must refuse the job
with FAILED_PRECONDITION naming the store, the step it would resume from, step 3 and
`--fresh-start`, and leave the store as it found it. `--fresh-start` then starts over,
and without a token the old fall-back stays, logged as an error.

Each coordinator keeps its marks in the per-test state directory the suite's conftest
points `$GRADSYNC_STATE_DIR` at.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest
from gradsync_proto.v1 import gradsync_pb2 as pb
from support.processes import CoordinatorProcess
from support.rawclient import CHUNK, RawWorker, assembled_job, run, run_step
from support.tamper import StoreTamper

TOKEN = "store-rollback-test-token-0123456789"
AUTH = (("authorization", f"Bearer {TOKEN}"),)
#: The raw test worker's chunk size, as --chunk-mb.
CHUNK_MB = str(CHUNK / (1 << 20))

Serve = Callable[..., CoordinatorProcess]


def _delete_newest_and_move_latest_back(store: StoreTamper) -> None:
    store.delete_blob("job", 3)
    store.point_latest("job", 2)


#: attack name -> (what it does to job "job", the step the store would now resume it from)
ATTACKS: dict[str, tuple[Callable[[StoreTamper], None], str]] = {
    "latest points at an older step": (lambda store: store.point_latest("job", 1), "step 1"),
    "the newest checkpoint deleted": (lambda store: store.delete_blob("job", 3), "step 2"),
    "one byte of the newest flipped": (lambda store: store.flip_byte("job", 3), "step 2"),
    "the newest is another job's": (
        lambda store: store.write_blob("job", 3, store.read_blob("other", 3)),
        "step 2",
    ),
    # Consistent within the store: only the coordinator's own high-water mark shows these.
    "the newest deleted and latest moved back": (
        _delete_newest_and_move_latest_back,
        "step 2",
    ),
    "the store emptied": (lambda store: store.wipe("job"), "step 0 (no checkpoint)"),
}


@pytest.fixture(params=["file", "redis"])
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "file":
        return str(tmp_path / "store")
    return str(request.getfixturevalue("redis_server").url)


@pytest.fixture
def tamper(store_url: str) -> Iterator[StoreTamper]:
    store = StoreTamper(store_url)
    yield store
    store.close()


@pytest.fixture
def with_token(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GRADSYNC_TOKEN_FILE", raising=False)
    monkeypatch.setenv("GRADSYNC_TOKEN", TOKEN)


def serve(factory: Serve, store_url: str, *extra: str) -> CoordinatorProcess:
    return factory(
        1, "--checkpoint-store", store_url, "--chunk-mb", CHUNK_MB, "--store-timeout", "5", *extra
    )


def description(store_url: str) -> str:
    """How the coordinator names the store in its messages."""
    return store_url if "://" in store_url else Path(store_url).absolute().as_uri()


def save_steps(address: str, job_id: str, last: int, metadata: tuple[tuple[str, str], ...]) -> None:
    """Train `job_id` (one rank) from where it starts, saving a checkpoint after every step."""

    async def scenario() -> None:
        channel = grpc.aio.insecure_channel(address)
        try:
            [worker] = await assembled_job(channel, job_id, world_size=1, metadata=metadata)
            for step in range(last):
                await run_step([worker], step)
                blob = f"{job_id} state before step {step + 1};".encode() * 20
                chunk = pb.CheckpointChunk(
                    step=step + 1, offset=0, total_bytes=len(blob), payload=blob
                )
                await worker.send(pb.WorkerMessage(checkpoint=chunk))
                saved = (await worker.expect_kind("checkpoint_saved")).checkpoint_saved
                assert saved.durable, saved.message
            await worker.leave()
        finally:
            await channel.close()

    run(scenario, timeout_s=30)


def first_answer(
    address: str, job_id: str, metadata: tuple[tuple[str, str], ...]
) -> tuple[str, object]:
    """Join `job_id` as its only rank: ("resumed", start step) or ("refused", (code, details))."""
    answer: list[tuple[str, object]] = []

    async def scenario() -> None:
        channel = grpc.aio.insecure_channel(address)
        try:
            worker = RawWorker(channel, metadata)
            await worker.join(0, world_size=1, job_id=job_id)
            message = await worker.recv(timeout=15)
            if message.WhichOneof("kind") == "stream_end":  # then the same status
                answer.append(("refused", (await worker.call.code(), await worker.call.details())))
                return
            assert message.WhichOneof("kind") == "welcome", message
            answer.append(("resumed", message.welcome.start_step))
        finally:
            await channel.close()

    run(scenario, timeout_s=30)
    return answer[0]


def saved_then_restarted(
    coordinator_factory: Serve, store_url: str, metadata: tuple[tuple[str, str], ...] = AUTH
) -> None:
    """Jobs "job" and "other" saved checkpoints of steps 1, 2, 3; the coordinator is gone."""
    first = serve(coordinator_factory, store_url)
    save_steps(first.address, "job", 3, metadata)
    save_steps(first.address, "other", 3, metadata)
    code, _ = first.stop()
    assert code == 0


@pytest.mark.timeout(90)
@pytest.mark.usefixtures("with_token")
@pytest.mark.parametrize("attack", list(ATTACKS))
def test_a_rolled_back_store_refuses_the_job_with_a_token(
    attack: str, store_url: str, tamper: StoreTamper, coordinator_factory: Serve
) -> None:
    saved_then_restarted(coordinator_factory, store_url)
    damage, found = ATTACKS[attack]
    damage(tamper)
    left = tamper.steps("job")
    second = serve(coordinator_factory, store_url)
    kind, outcome = first_answer(second.address, "job", AUTH)
    assert kind == "refused", f"{attack}: the job resumed from step {outcome} instead of 3"
    code, details = outcome  # type: ignore[misc]
    assert code == grpc.StatusCode.FAILED_PRECONDITION, (code, details)
    for words in (
        "refusing to resume job 'job'",
        description(store_url),
        f"Resuming would start from {found} although step 3 was acknowledged",
        "--fresh-start",
    ):
        assert words in details, f"{attack}: {words!r} not in {details!r}"
    assert tamper.steps("job") == left  # the refusal deleted and wrote nothing
    # The store's other job was not touched: it still resumes from its step 3.
    assert first_answer(second.address, "other", AUTH) == ("resumed", 3)


@pytest.mark.timeout(60)
@pytest.mark.usefixtures("with_token")
def test_an_untouched_store_resumes_from_its_newest_checkpoint(
    store_url: str, coordinator_factory: Serve
) -> None:
    saved_then_restarted(coordinator_factory, store_url)
    second = serve(coordinator_factory, store_url)
    assert first_answer(second.address, "job", AUTH) == ("resumed", 3)


@pytest.mark.timeout(60)
@pytest.mark.usefixtures("with_token")
def test_without_its_state_dir_the_chain_in_the_checkpoints_still_catches_a_moved_pointer(
    tmp_path: Path, coordinator_factory: Serve
) -> None:
    """A coordinator on another host (an empty state directory) restarts the job: the
    checkpoint of step 3, beyond the pointer, records that step 2 had been acknowledged."""
    store_url = str(tmp_path / "store")
    saved_then_restarted(coordinator_factory, store_url)
    tamper = StoreTamper(store_url)
    tamper.point_latest("job", 1)
    elsewhere = serve(coordinator_factory, store_url, "--state-dir", str(tmp_path / "elsewhere"))
    kind, outcome = first_answer(elsewhere.address, "job", AUTH)
    assert kind == "refused", f"the job resumed from step {outcome}"
    _, details = outcome  # type: ignore[misc]
    assert "records that step 2" in details and "although step 2 was acknowledged" in details


@pytest.mark.timeout(90)
@pytest.mark.usefixtures("with_token")
def test_fresh_start_starts_over_and_resets_the_mark(
    tmp_path: Path, coordinator_factory: Serve
) -> None:
    """After a refusal the operator starts over with --fresh-start: the job starts at step 0,
    its saves become the new mark, and the next normal start resumes them; the abandoned
    run's checkpoints (kept, beyond the new pointer) are no evidence against the new run."""
    store_url = str(tmp_path / "store")
    saved_then_restarted(coordinator_factory, store_url)
    tamper = StoreTamper(store_url)
    tamper.point_latest("job", 1)
    refused = serve(coordinator_factory, store_url)
    assert first_answer(refused.address, "job", AUTH)[0] == "refused"
    refused.stop()
    fresh = serve(coordinator_factory, store_url, "--fresh-start")
    save_steps(fresh.address, "job", 1, AUTH)
    fresh.stop()
    assert tamper.steps("job") == [1, 2, 3]  # the old run's 2 and 3 are kept
    again = serve(coordinator_factory, store_url)
    assert first_answer(again.address, "job", AUTH) == ("resumed", 1)


@pytest.mark.timeout(60)
def test_without_a_token_a_damaged_store_falls_back_with_an_error(
    tmp_path: Path, coordinator_factory: Serve, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No token, nothing authenticated: the documented fall-back to the newest checkpoint
    that verifies stays, but the coordinator logs an error naming both steps."""
    monkeypatch.delenv("GRADSYNC_TOKEN", raising=False)
    monkeypatch.delenv("GRADSYNC_TOKEN_FILE", raising=False)
    store_url = str(tmp_path / "store")
    saved_then_restarted(coordinator_factory, store_url, metadata=())
    StoreTamper(store_url).flip_byte("job", 3)
    second = serve(coordinator_factory, store_url)
    assert first_answer(second.address, "job", ()) == ("resumed", 2)
    _, log = second.stop()
    assert "ERROR" in log and "Resuming from step 2 anyway, although step 3" in log, log
    assert "Set a token to refuse instead" in log
