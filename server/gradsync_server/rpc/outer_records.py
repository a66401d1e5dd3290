"""The coordinator's DiLoCo outer-state records on the checkpoint store (blocking I/O, bounded).

The data plane says what to save (`PersistOuter`, after each step that changed
its `OuterState`) and the control plane decides what to restore
(`gradsync_server.control.outer_resume`); this is where the bytes meet the
store: one record per job and plane, next to the job's checkpoints (a file
`<store>/<job>/outer-state-shard<i>` written atomically and fsync'd, or the
Redis key `gradsync:ckpt:<job>:outer-state-shard<i>`, proven durable like a
checkpoint). Every call runs in a store thread of its own, bounded by
`--store-timeout`, so a hung store stalls no other job.

Each record is sealed (`outer_snapshot`) under the outer-state key
(`outer_state_key`) when the coordinator has a token, and the leader marks
its own plane's record in its state directory after every acknowledged save
(`gradsync_server.store.outer_marks`), so that a restart can tell the
newest record from an older, altered or foreign one
(`gradsync_server.control.outer_resume`).

Cost: a save writes the plane's global parameters and momentum, 8 bytes per
parameter of its range, once per outer round (DiLoCo rounds are minutes
apart), hashes it twice and (leader) writes a mark of a few hundred bytes;
the round's last answers wait for it (see `Delivery`).
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from gradsync_proto.auth import derive_key
from gradsync_proto.v1 import gradsync_pb2 as pb

from gradsync_server.config import CoordinatorConfig, Role
from gradsync_server.control.outer_resume import OuterReading
from gradsync_server.dataplane.outer_snapshot import (
    OuterSnapshot,
    OuterSnapshotError,
    decode_snapshot,
    encode_snapshot,
    record_digest,
    record_name,
)
from gradsync_server.dataplane.plane import JobPlane
from gradsync_server.store.checkpoint import CheckpointError, CheckpointStore
from gradsync_server.store.checkpoint_file import FileCheckpointStore
from gradsync_server.store.checkpoint_redis import RedisCheckpointStore
from gradsync_server.store.high_water_file import HighWaterError
from gradsync_server.store.outer_marks import OuterMark, OuterMarks
from gradsync_server.store.stores import open_store

__all__ = ["KEY_PURPOSE", "OuterRecords", "ShardOuterStates", "configured_store", "outer_state_key"]

#: The `derive_key` purpose of the outer-state MAC key.
KEY_PURPOSE = "outer-state"

_Result = TypeVar("_Result")

log = logging.getLogger("gradsync.server")

_RecordStore = FileCheckpointStore | RedisCheckpointStore


def configured_store(config: CoordinatorConfig) -> CheckpointStore | None:
    """The checkpoint store `--checkpoint-store` names, opened (None: none configured)."""
    if not config.checkpoint_store:
        return None
    return open_store(
        config.checkpoint_store, password=config.redis_password, timeout_s=config.store_timeout_s
    )


def outer_state_key(config: CoordinatorConfig) -> bytes | None:
    """The key that seals and checks the outer-state records (None: no token, unsealed).

    Every plane's key is the same, so that the leader can check all of them before it
    restores any. It comes from the shard token when that is a durable secret the
    workers do not hold (a leader that waits for shards started elsewhere, and those
    shards: `--shard-token-file`), so that the workers' token alone cannot forge any
    record; else from the token (an unsharded coordinator, and `serve --shards N`,
    whose shard token is made anew at every start and would orphan the records: its
    shards are its own children, on its host and under its user).
    """
    if config.token is None:
        return None
    separate = config.shard_token is not None and (
        (config.role is Role.LEADER and not config.local_shards)
        or (config.role is Role.SHARD and config.parent_pid is None)
    )
    secret = config.shard_token if separate and config.shard_token else config.token
    return derive_key(secret, KEY_PURPOSE)


class OuterRecords:
    """Saves and loads the outer-state records of the coordinator's jobs.

    Args:
        store: the coordinator's checkpoint store (a file or Redis store; any other
            kind holds no outer state, and a restart reseeds as without a store).
        timeout_s: bound on every call (`--store-timeout`).
        key: the outer-state key (`outer_state_key`; None: records are not sealed).
        marks: where the leader keeps the mark of its own plane's record (None: a
            shard, or no state directory).
    """

    def __init__(
        self,
        store: CheckpointStore | None,
        timeout_s: float,
        key: bytes | None = None,
        marks: OuterMarks | None = None,
    ) -> None:
        self._store: _RecordStore | None = (
            store if isinstance(store, FileCheckpointStore | RedisCheckpointStore) else None
        )
        self._timeout_s = timeout_s
        self.key = key
        self._marks = marks
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="gradsync-outer-store")
        #: Saves that failed since start-up (each logged).
        self.failures = 0
        #: Records saved since start-up.
        self.saves = 0

    @property
    def enabled(self) -> bool:
        """True when outer states are saved (a file or Redis store is configured)."""
        return self._store is not None

    async def save(self, snapshot: OuterSnapshot, shard_index: int) -> bool:
        """Save `snapshot` durably; return False (logged) if that failed or timed out.

        A failed save loses nothing the job needs now; only a restart before the next
        good save finds an older state, which the ranks refuse, naming both steps.
        """
        store = self._store
        if store is None:
            return False
        what = f"saving the outer state of job '{snapshot.job_id}' step {snapshot.step}"
        try:
            await self._call(self._encode_and_save, store, snapshot, shard_index)
        except (CheckpointError, OSError, TimeoutError) as exc:
            self.failures += 1
            log.error("%s: %s failed: %s", store.description, what, exc or "timed out")
            return False
        self.saves += 1
        log.debug("%s: %s (%d bytes)", store.description, what, snapshot.nbytes())
        return True

    def _encode_and_save(
        self, store: _RecordStore, snapshot: OuterSnapshot, shard_index: int
    ) -> None:
        """(store thread) Encoding hashes every byte: off the event loop too. The leader's
        own record is marked once the store acknowledged it."""
        parts = encode_snapshot(snapshot, self.key)
        store.save_record(snapshot.job_id, record_name(shard_index), parts)
        if shard_index != 0 or self._marks is None:
            return
        mark = OuterMark(snapshot.step, snapshot.rounds, record_digest(parts), snapshot.run)
        try:
            self._marks.write_outer(store.description, snapshot.job_id, mark)
        except OSError as exc:
            log.error(
                "job '%s': could not record the outer-state mark (%s) in %s: %s; a store "
                "rolled back to an older outer state would go unnoticed (check --state-dir)",
                snapshot.job_id,
                mark,
                self._marks.directory,
                exc,
            )

    def _read_mark(self, job_id: str) -> tuple[OuterMark | None, str]:
        """(store thread) The leader's mark of the job's outer state, or why it is unusable."""
        if self._marks is None or self._store is None:
            return None, ""
        try:
            return self._marks.read_outer(self._store.description, job_id), ""
        except HighWaterError as exc:
            if self.key is None:
                log.error("job '%s': %s; going on without it (no token)", job_id, exc)
                return None, ""
            return None, str(exc)

    def _forget_mark(self, job_id: str) -> None:
        """(store thread) `--fresh-start`: the outer state is seeded anew, nothing before it."""
        if self._marks is None or self._store is None:
            return
        try:
            self._marks.forget_outer(self._store.description, job_id)
        except OSError as exc:
            log.error(
                "job '%s': could not reset the outer-state mark %s: %s; the job's first "
                "save replaces it",
                job_id,
                self._marks.location(self._store.description, job_id),
                exc,
            )

    async def _load(self, job_id: str, shard_index: int) -> tuple[bytes | None, str, bool]:
        """The stored record of (`job_id`, plane `shard_index`), or None and why not, and
        whether reading failed (rather than finding nothing)."""
        store = self._store
        if store is None:
            return None, "no file or Redis checkpoint store is configured", False
        try:
            blob = await self._call(store.load_record, job_id, record_name(shard_index))
        except (CheckpointError, OSError, TimeoutError) as exc:
            why = f"reading it from {store.description} failed: {exc or 'timed out'}"
            return None, why, True
        if blob is None:
            return None, f"{store.description} holds no outer state of job '{job_id}'", False
        return blob, "", False

    async def load_all(self, job_id: str, planes: int, fresh_start: bool = False) -> OuterReading:
        """The records of planes 0..planes-1 of `job_id` (see `_load`) and the leader's mark;
        none read under `--fresh-start`, which starts every job anew (the records stay until
        overwritten, the mark is reset)."""
        description = self._store.description if self._store is not None else "nowhere"
        run = secrets.token_hex(8)
        if fresh_start:
            try:
                await self._call(self._forget_mark, job_id)
            except TimeoutError:
                log.error("job '%s': resetting its outer-state mark timed out", job_id)
            unread = [(None, "--fresh-start: the stored outer state is not read")] * planes
            return OuterReading(unread, description, run, self.key)
        loaded = [await self._load(job_id, index) for index in range(planes)]
        records = [(blob, why) for blob, why, _ in loaded]
        failed = any(failed for _, _, failed in loaded)
        try:
            mark, problem = await self._call(self._read_mark, job_id)
        except TimeoutError:
            mark, problem = None, "reading the outer-state mark timed out"
        path = ""
        if self._marks is not None and self._store is not None:
            path = self._marks.location(self._store.description, job_id)
        return OuterReading(records, description, run, self.key, mark, path, problem, failed)

    async def _call(self, function: Callable[..., _Result], *args: object) -> _Result:
        loop = asyncio.get_running_loop()
        call = loop.run_in_executor(self._executor, function, *args)
        return await asyncio.wait_for(call, self._timeout_s)

    def close(self) -> None:
        """Stop the store thread (a call still running finishes in the background)."""
        self._executor.shutdown(wait=False, cancel_futures=True)


class ShardOuterStates:
    """Where a shard saves its outer-state records, and how it restores one.

    Each shard holds the global parameters and momentum of its byte range of
    every outer bucket, which its leader never sees; so each shard saves its own
    record (`outer-state-shard<i>`) to the store its leader gave it (`serve
    --shards` passes its `--checkpoint-store` on; a hand-started `gradsync
    shard` takes the same flag), and the leader, which reads every plane's record
    before a job assembles, restores only when all of them hold the same step
    (`gradsync_server.control.outer_resume`). It then says so in the job's first
    view (`ShardJobView.outer_restore`), and the shard restores its own record
    here, before the view's plane takes any chunk.

    The shard seals its records under the same outer-state key as its leader
    (`outer_state_key`: from the shard token when that is a secret
    of the leader and its shards alone), with the run the leader names in the
    job's first view (`ShardJobView.outer_run`), and restores only a record that
    verifies under that key and belongs to that run.

    That one read happens on the shard's loop, once per restored job and bounded
    by `--store-timeout` (the Redis socket timeout; a local file otherwise): no
    chunk may be answered before it, and a job's start is rare.

    Args:
        config: the shard's configuration (`checkpoint_store`, `store_timeout_s`,
            `redis_password`).
    """

    def __init__(self, config: CoordinatorConfig) -> None:
        self._store = configured_store(config)
        #: Saves of this shard's records (`PersistOuter` from its planes).
        self.records = OuterRecords(self._store, config.store_timeout_s, outer_state_key(config))

    def started(self, plane: JobPlane, view: pb.ShardJobView, shard_index: int) -> None:
        """A job's plane was just created from its first view: restore it if told, save it.

        A record that cannot be restored although the leader read it a moment ago
        (it changed or vanished since) is logged as an error: the plane then starts
        unseeded and the job's answers for this range are not the restored ones.
        """
        outer = plane.step.outer
        outer.persist = self.records.enabled
        outer.run = view.outer_run
        if not view.outer_restore or not outer.active:
            return
        job_id = view.job_id
        problem = ""
        try:
            blob = None
            if isinstance(self._store, _RecordStore):
                blob = self._store.load_record(job_id, record_name(shard_index))
            snapshot = decode_snapshot(blob, job_id, self.records.key) if blob else None
            if snapshot is None:
                problem = "the store holds no record of it"
            elif snapshot.run != view.outer_run:
                problem = f"the record belongs to run {snapshot.run or 'none'}, the leader "
                problem += f"restored run {view.outer_run or 'none'}"
            elif snapshot.step not in (view.start_step, view.start_step - 1):
                problem = f"the record holds step {snapshot.step}, the leader restored step "
                problem += str(view.start_step)
            else:
                replay = snapshot.step == view.start_step
                outer.restore(snapshot, replay)
                log.warning(
                    "job '%s': outer state of shard %d restored: round %d (step %d)%s",
                    job_id,
                    shard_index,
                    snapshot.rounds,
                    snapshot.step,
                    " is replayed" if replay else f"; step {view.start_step} is an outer step",
                )
                return
        except (CheckpointError, OSError, OuterSnapshotError, ValueError) as exc:
            problem = str(exc)
        log.error(
            "job '%s': shard %d cannot restore its outer state as the leader did: %s",
            job_id,
            shard_index,
            problem,
        )

    def close(self) -> None:
        """Stop the store thread and close the store."""
        self.records.close()
        if self._store is not None:
            self._store.close()
