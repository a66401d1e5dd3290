"""Checkpoint store: the blob format, then one behaviour suite run on the file and Redis backends,
then what only one backend can show (fsync order, stray temp files, a real redis-server that is
misconfigured, stopped, hung, or killed and restarted)."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import signal
import stat
import struct
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from gradsync_server.store.checkpoint import (
    MAGIC,
    Checkpoint,
    CheckpointCorruptError,
    CheckpointError,
    CheckpointStore,
    decode,
    encode,
)
from gradsync_server.store.checkpoint_file import FileCheckpointStore
from gradsync_server.store.checkpoint_redis import RedisCheckpointStore
from gradsync_server.store.stores import open_store
from support.redisserver import RedisServer

LOGGER = "gradsync.server.checkpoint"
ODD_JOB_IDS = ["a/b", "../x", "..", ".", "a", "A", "a%2Fb", "a:1", "x y", "über", "-rf"]


def make_checkpoint(step: int, job_id: str = "job", payload: bytes | None = None) -> Checkpoint:
    if payload is None:
        payload = f"{job_id} state before step {step};".encode() * 20
    return Checkpoint(job_id, step, 3, payload, {"world_size": "2", "layout": "abc123"})


@dataclass
class Backend:
    """One backend plus raw access to its stored blobs, for damaging them behind its back."""

    name: str
    open: Callable[..., CheckpointStore]
    read_blob: Callable[[str, int], bytes]
    write_blob: Callable[[str, int, bytes], None]
    delete_blob: Callable[[str, int], None]


@pytest.fixture(params=["file", "redis"])
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Backend]:
    opened: list[CheckpointStore] = []
    closers: list[Callable[[], None]] = []
    if request.param == "file":
        root = tmp_path / "checkpoints"

        def open_file(keep: int = 3) -> CheckpointStore:
            opened.append(FileCheckpointStore(root, keep=keep))
            return opened[-1]

        def path(job_id: str, step: int) -> Path:
            return FileCheckpointStore(root).job_directory(job_id) / f"step-{step:020d}.ckpt"

        yield Backend(
            "file",
            open_file,
            lambda job_id, step: path(job_id, step).read_bytes(),
            lambda job_id, step, blob: path(job_id, step).write_bytes(blob),
            lambda job_id, step: path(job_id, step).unlink(),
        )
    else:
        import redis

        server: RedisServer = request.getfixturevalue("redis_server")
        raw = redis.Redis.from_url(server.url, socket_timeout=5)
        closers.append(raw.close)

        def open_redis(keep: int = 3) -> CheckpointStore:
            opened.append(RedisCheckpointStore(server.url, keep=keep))
            return opened[-1]

        def key(job_id: str, step: int) -> str:
            return f"gradsync:ckpt:{job_id}:{step}"

        def read(job_id: str, step: int) -> bytes:
            value = raw.get(key(job_id, step))
            assert isinstance(value, bytes)
            return value

        yield Backend(
            "redis",
            open_redis,
            read,
            lambda job_id, step, blob: raw.set(key(job_id, step), blob),
            lambda job_id, step: raw.delete(key(job_id, step)),
        )
    for store in opened:
        store.close()
    for close in closers:
        close()


# --- the blob format -------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_blob_round_trip_and_layout() -> None:
    checkpoint = make_checkpoint(17, payload=bytes(range(256)) * 4)
    blob = encode(checkpoint)
    assert decode(blob) == checkpoint
    magic, version, header_length = struct.unpack_from(">8sHI", blob)
    assert (magic, version) == (MAGIC, 1)
    header = json.loads(blob[14 : 14 + header_length])
    assert header == {
        "job_id": "job",
        "step": 17,
        "membership_epoch": 3,
        "metadata": {"world_size": "2", "layout": "abc123"},
        "payload_length": 1024,
        "payload_sha256": hashlib.sha256(checkpoint.payload).hexdigest(),
    }
    assert blob[-32:] == hashlib.sha256(blob[: 14 + header_length]).digest()


@pytest.mark.timeout(60)
def test_every_flipped_bit_and_every_truncation_is_detected() -> None:
    blob = encode(make_checkpoint(5, payload=b"weights" * 8))
    for index in range(len(blob)):
        for bit in (0x01, 0x80):
            damaged = bytearray(blob)
            damaged[index] ^= bit
            with pytest.raises(CheckpointCorruptError):
                decode(bytes(damaged))
    for length in range(len(blob)):
        with pytest.raises(CheckpointCorruptError):
            decode(blob[:length])
    with pytest.raises(CheckpointCorruptError, match="not a checkpoint"):
        decode(b"\x89PNG\r\n\x1a\n" + blob[8:])


@pytest.mark.timeout(60)
def test_checkpoint_rejects_bad_fields() -> None:
    with pytest.raises(ValueError, match="non-empty"):
        Checkpoint("", 1, 0, b"", {})
    with pytest.raises(ValueError, match="got -1"):
        Checkpoint("job", -1, 0, b"", {})
    with pytest.raises(TypeError, match="bytes"):
        Checkpoint("job", 1, 0, "text", {})  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="str to str"):
        Checkpoint("job", 1, 0, b"", {"world_size": 2})  # type: ignore[dict-item]
    metadata = {"k": "v"}
    checkpoint = Checkpoint("job", 1, 0, b"", metadata)
    metadata["k"] = "changed"
    assert checkpoint.metadata == {"k": "v"}


# --- open_store ------------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_open_store_urls(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    for url, directory in [
        (f"file://{tmp_path}/a%20b", tmp_path / "a b"),
        ("file:relative/dir", tmp_path / "relative" / "dir"),
        (str(tmp_path / "plain"), tmp_path / "plain"),
        ("plain-relative", tmp_path / "plain-relative"),
    ]:
        store = open_store(url, keep=2)
        assert isinstance(store, FileCheckpointStore)
        assert (store.directory, store.keep) == (directory, 2)
        assert store.description == directory.as_uri()
    for bad in ["s3://bucket/x", "", "file://otherhost/x", "http://example/x"]:
        with pytest.raises(ValueError, match="checkpoint"):
            open_store(bad)
    # A Redis address without its scheme was once a relative directory: now it is refused.
    for address in ["10.213.0.3:6379/0", "redis:6379/0", "localhost:6379", "[::1]:6379/2"]:
        with pytest.raises(ValueError, match=r"looks like a network address.*redis://"):
            open_store(address)
    assert not list(tmp_path.glob("*:*")), "a refused URL still created a directory"
    with pytest.raises(ValueError, match="keep must be at least 1"):
        open_store(str(tmp_path), keep=0)


@pytest.mark.timeout(60)
def test_open_store_redis_hides_the_password() -> None:
    pytest.importorskip("redis", reason="the redis package is not installed: gradsync[redis]")
    # No connection is made until the first call, so no server is needed here.
    with open_store("redis://user:s3cret@127.0.0.1:1/2") as store:
        assert isinstance(store, RedisCheckpointStore)
        assert store.description == "redis://user:***@127.0.0.1:1/2"


# --- the same behaviour on both backends -----------------------------------------------------


@pytest.mark.timeout(60)
def test_round_trip_survives_reopening(backend: Backend) -> None:
    checkpoint = make_checkpoint(7, payload=os.urandom(300_000))
    backend.open().save(checkpoint)
    assert backend.open().load_latest("job") == checkpoint


@pytest.mark.timeout(60)
def test_load_latest_returns_the_newest(backend: Backend) -> None:
    store = backend.open()
    for step in (1, 2, 3):
        store.save(make_checkpoint(step))
    latest = store.load_latest("job")
    assert latest == make_checkpoint(3)


@pytest.mark.timeout(60)
def test_steps_and_retention(backend: Backend) -> None:
    store = backend.open(keep=2)
    assert store.steps("job") == []
    store.save(make_checkpoint(10))
    assert store.steps("job") == [10]
    for step in (20, 30, 40):
        store.save(make_checkpoint(step))
    assert store.steps("job") == [30, 40]
    assert store.load_latest("job") == make_checkpoint(40)


@pytest.mark.timeout(60)
def test_unknown_job_has_no_checkpoint(backend: Backend) -> None:
    store = backend.open()
    store.save(make_checkpoint(1, job_id="other"))
    assert store.load_latest("unknown") is None
    assert store.steps("unknown") == []


@pytest.mark.timeout(60)
def test_odd_job_ids_are_isolated(backend: Backend) -> None:
    store = backend.open()
    for number, job_id in enumerate(ODD_JOB_IDS):
        store.save(make_checkpoint(100 + number, job_id=job_id))
    for number, job_id in enumerate(ODD_JOB_IDS):
        assert store.steps(job_id) == [100 + number]
        assert store.load_latest(job_id) == make_checkpoint(100 + number, job_id=job_id)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("damage", ["flip a byte", "truncate"])
def test_corrupt_newest_falls_back_with_a_warning(
    backend: Backend, damage: str, caplog: pytest.LogCaptureFixture
) -> None:
    store = backend.open()
    for step in (1, 2, 3):
        store.save(make_checkpoint(step))
    blob = backend.read_blob("job", 3)
    if damage == "flip a byte":
        middle = len(blob) // 2
        blob = blob[:middle] + bytes([blob[middle] ^ 0x10]) + blob[middle + 1 :]
    else:
        blob = blob[: len(blob) // 2]
    backend.write_blob("job", 3, blob)
    caplog.set_level(logging.WARNING, logger=LOGGER)
    assert store.load_latest("job") == make_checkpoint(2)
    [warning] = [record for record in caplog.records if record.name == LOGGER]
    assert warning.levelno == logging.WARNING
    assert "step 3" in warning.getMessage()
    assert "corrupt" in warning.getMessage()


@pytest.mark.timeout(60)
def test_missing_newest_falls_back_with_a_warning(
    backend: Backend, caplog: pytest.LogCaptureFixture
) -> None:
    store = backend.open()
    for step in (1, 2, 3):
        store.save(make_checkpoint(step))
    backend.delete_blob("job", 3)
    caplog.set_level(logging.WARNING, logger=LOGGER)
    assert store.load_latest("job") == make_checkpoint(2)
    [warning] = [record for record in caplog.records if record.name == LOGGER]
    assert "step 3" in warning.getMessage()
    assert "missing" in warning.getMessage()


@pytest.mark.timeout(60)
def test_saving_after_a_fallback_rolls_the_job_back(
    backend: Backend, caplog: pytest.LogCaptureFixture
) -> None:
    """The coordinator resumed from step 2 because 3 was corrupt; its next save (3 again, or 2
    again) is the new latest, and the abandoned blob is gone rather than shadowing it."""
    store = backend.open()
    for step in (1, 2, 3):
        store.save(make_checkpoint(step))
    backend.write_blob("job", 3, b"garbage")
    caplog.set_level(logging.WARNING, logger=LOGGER)
    assert store.load_latest("job") == make_checkpoint(2)
    store.save(make_checkpoint(2, payload=b"redone"))
    assert store.steps("job") == [1, 2]
    assert store.load_latest("job") == make_checkpoint(2, payload=b"redone")


@pytest.mark.timeout(60)
def test_no_verifying_checkpoint_is_an_error_not_a_fresh_start(backend: Backend) -> None:
    store = backend.open()
    store.save(make_checkpoint(1))
    backend.write_blob("job", 1, b"garbage")
    with pytest.raises(CheckpointError, match=r"job 'job' failed: no checkpoint verifies"):
        store.load_latest("job")


@pytest.mark.timeout(60)
def test_closed_store_refuses_calls(backend: Backend) -> None:
    store = backend.open()
    store.close()
    with pytest.raises(CheckpointError, match="closed"):
        store.save(make_checkpoint(1))
    with pytest.raises(CheckpointError, match="closed"):
        store.load_latest("job")


# --- file backend only -----------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_file_job_directories_stay_inside_the_root(tmp_path: Path) -> None:
    root = tmp_path / "checkpoints"
    store = FileCheckpointStore(root)
    for job_id in ODD_JOB_IDS:
        store.save(make_checkpoint(1, job_id=job_id))
    names = [path.name for path in root.iterdir()]
    assert len(names) == len(ODD_JOB_IDS)
    # Distinct even on a case-insensitive filesystem; never hidden, never a path.
    assert len({name.lower() for name in names}) == len(names)
    assert all("/" not in name and not name.startswith(".") for name in names)
    assert sorted(path.name for path in tmp_path.iterdir()) == ["checkpoints"]
    for path in root.rglob("*"):
        assert path.resolve().is_relative_to(root.resolve())


@pytest.mark.timeout(60)
def test_file_blob_is_durable_before_the_pointer_flips(tmp_path: Path) -> None:
    """fsync(blob temp) -> rename -> fsync(dir) -> fsync(pointer temp) -> rename -> fsync(dir)."""
    observed: list[tuple[str, str, bool]] = []
    root = tmp_path / "checkpoints"
    job_dir = FileCheckpointStore(root).job_directory("job")

    def recording_fsync(descriptor: int) -> None:
        os.fsync(descriptor)
        kind = "dir" if stat.S_ISDIR(os.fstat(descriptor).st_mode) else "file"
        pointer = (job_dir / "latest").read_text().strip() if (job_dir / "latest").exists() else ""
        observed.append((kind, pointer, (job_dir / f"step-{2:020d}.ckpt").exists()))

    store = FileCheckpointStore(root, fsync=recording_fsync)
    store.save(make_checkpoint(1))
    observed.clear()
    store.save(make_checkpoint(2))
    assert observed == [
        ("file", "1", False),  # the blob's temp file is on disk, not yet renamed
        ("dir", "1", True),  # the rename is on disk; the pointer still names step 1
        ("file", "1", True),  # the pointer's temp file is on disk
        ("dir", "2", True),  # the pointer flip is on disk
    ]


@pytest.mark.timeout(60)
def test_file_crash_leftovers_do_not_confuse_load_latest(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store = FileCheckpointStore(tmp_path)
    store.save(make_checkpoint(1))
    store.save(make_checkpoint(2))
    job_dir = store.job_directory("job")
    # Crash between write and rename: a partial temp file for step 3.
    stray = job_dir / f".step-{3:020d}.ckpt.k2j4x9.tmp"
    stray.write_bytes(encode(make_checkpoint(3))[:100])
    caplog.set_level(logging.WARNING, logger=LOGGER)
    assert store.steps("job") == [1, 2]
    assert store.load_latest("job") == make_checkpoint(2)
    assert caplog.records == []
    # Crash between the blob's rename and the pointer flip: step 3 was never acknowledged.
    (job_dir / f"step-{3:020d}.ckpt").write_bytes(encode(make_checkpoint(3)))
    assert store.load_latest("job") == make_checkpoint(2)
    assert "never completed" in caplog.records[-1].getMessage()
    # The next save cleans both up.
    store.save(make_checkpoint(3, payload=b"redone"))
    assert not stray.exists()
    assert store.load_latest("job") == make_checkpoint(3, payload=b"redone")


@pytest.mark.timeout(60)
def test_file_save_failure_is_a_checkpoint_error(tmp_path: Path) -> None:
    (tmp_path / "not-a-directory").write_text("")
    store = FileCheckpointStore(tmp_path / "not-a-directory")
    with pytest.raises(CheckpointError, match=r"saving job 'job' step 4 failed: .*Error"):
        store.save(make_checkpoint(4))


# --- Redis backend only ----------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_redis_keys_follow_the_documented_layout(redis_server: RedisServer) -> None:
    import redis

    with (
        RedisCheckpointStore(redis_server.url) as store,
        redis.Redis.from_url(redis_server.url) as raw,
    ):
        store.save(make_checkpoint(7, job_id="j"))
        assert raw.get("gradsync:ckpt:j:latest") == b"7"
        assert raw.zrange("gradsync:ckpt:j:steps", 0, -1) == [b"7"]
        blob = raw.get("gradsync:ckpt:j:7")
        assert isinstance(blob, bytes)
        assert decode(blob) == make_checkpoint(7, job_id="j")
        assert raw.ttl("gradsync:ckpt:j:7") == -1


@pytest.mark.timeout(60)
def test_redis_without_appendonly_refuses_to_save(
    redis_server_factory: Callable[..., RedisServer],
) -> None:
    server = redis_server_factory("no-aof", "--appendonly", "no")
    with RedisCheckpointStore(server.url) as store:
        with pytest.raises(CheckpointError) as raised:
            store.save(make_checkpoint(1))
        message = str(raised.value)
        assert "appendonly yes" in message and "required" in message
        assert "appendonly is 'no'" in message and "redis-server --appendonly yes" in message
        assert server.url in message and "job 'job' step 1" in message
        assert store.load_latest("job") is None


@pytest.mark.timeout(60)
def test_redis_weakened_fsync_policy_is_caught_on_the_next_save(redis_server: RedisServer) -> None:
    import redis

    with (
        RedisCheckpointStore(redis_server.url) as store,
        redis.Redis.from_url(redis_server.url) as raw,
    ):
        store.save(make_checkpoint(1))
        version = tuple(int(part) for part in str(raw.info()["redis_version"]).split(".")[:2])
        raw.config_set("appendfsync", "everysec")
        if version >= (7, 2):
            store.save(make_checkpoint(2))  # WAITAOF proves the fsync under any policy
            assert store.load_latest("job") == make_checkpoint(2)
        else:
            with pytest.raises(CheckpointError, match="appendfsync is 'everysec'"):
                store.save(make_checkpoint(2))
            assert store.load_latest("job") == make_checkpoint(1)


@pytest.mark.timeout(60)
def test_redis_stopped_server_fails_fast(redis_server: RedisServer) -> None:
    with RedisCheckpointStore(redis_server.url, socket_timeout_s=1.0) as store:
        store.save(make_checkpoint(1))
        redis_server.stop(signal.SIGKILL)
        started = time.monotonic()
        with pytest.raises(CheckpointError) as raised:
            store.save(make_checkpoint(2))
        assert time.monotonic() - started < 5
        assert redis_server.url in str(raised.value)
        assert "job 'job' step 2" in str(raised.value)
        with pytest.raises(CheckpointError, match="loading job 'job'"):
            store.load_latest("job")


@pytest.mark.timeout(60)
def test_redis_hung_server_times_out(redis_server: RedisServer) -> None:
    assert redis_server.process is not None
    with RedisCheckpointStore(redis_server.url, socket_timeout_s=0.5) as store:
        store.save(make_checkpoint(1))
        redis_server.process.send_signal(signal.SIGSTOP)  # accepts connections, never answers
        try:
            started = time.monotonic()
            with pytest.raises(CheckpointError, match="Timeout"):
                store.save(make_checkpoint(2))
            assert time.monotonic() - started < 5
        finally:
            redis_server.process.send_signal(signal.SIGCONT)


@pytest.mark.timeout(60)
def test_redis_checkpoint_survives_sigkill_and_restart(redis_server: RedisServer) -> None:
    with RedisCheckpointStore(redis_server.url) as store:
        store.save(make_checkpoint(1))
        store.save(make_checkpoint(2, payload=os.urandom(100_000)))
        saved = store.load_latest("job")
    redis_server.stop(signal.SIGKILL)  # no shutdown hook: only what was fsync'd survives
    redis_server.start()  # same directory, AOF on, a fresh port
    with RedisCheckpointStore(redis_server.url) as store:
        assert store.steps("job") == [1, 2]
        assert store.load_latest("job") == saved


class PretendRedis72:
    """A real client of the local (Debian 7.0) server that claims to be Redis 7.2 and answers
    WAITAOF with a scripted reply, to drive the WAITAOF branch without a 7.2 server."""

    def __init__(self, url: str, waitaof_reply: str) -> None:
        import redis

        self.client = redis.Redis.from_url(url, socket_timeout=5)
        self.waitaof_reply = waitaof_reply  # a Lua expression evaluated in place of WAITAOF
        self.waitaof_calls: list[tuple[Any, ...]] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.client, name)

    def info(self, section: str | None = None) -> dict[str, Any]:
        info: dict[str, Any] = self.client.info(section)
        return {**info, "redis_version": "7.2.4"}

    def pipeline(self, transaction: bool = True) -> Any:
        batch = self.client.pipeline(transaction)
        queue = batch.execute_command

        def execute_command(*args: Any, **options: Any) -> Any:
            if args[0] == "WAITAOF":
                self.waitaof_calls.append(args)
                return queue("EVAL", f"return {self.waitaof_reply}", 0)
            return queue(*args, **options)

        batch.execute_command = execute_command
        return batch


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("waitaof_reply", "error"),
    [
        ("{1, 0}", None),
        ("{0, 0}", "not fsync'd to the append-only file within 500 ms"),
        (
            "redis.error_reply('ERR WAITAOF cannot be used when numlocal is set but appendonly "
            "is disabled.')",
            "appendonly yes is required",
        ),
    ],
)
def test_redis_waitaof_branch(redis_server: RedisServer, waitaof_reply: str, error: str) -> None:
    client = PretendRedis72(redis_server.url, waitaof_reply)
    try:
        store = RedisCheckpointStore(
            redis_server.url,
            client=client,  # type: ignore[arg-type]
            socket_timeout_s=1.0,
        )
        if error is None:
            store.save(make_checkpoint(1))
            assert store.load_latest("job") == make_checkpoint(1)
            assert client.waitaof_calls == [("WAITAOF", 1, 0, 500)] * 2  # blob, then pointer
        else:
            with pytest.raises(CheckpointError, match=error):
                store.save(make_checkpoint(1))
            assert client.client.get("gradsync:ckpt:job:latest") is None  # never flipped
        store.close()
    finally:
        client.client.close()
