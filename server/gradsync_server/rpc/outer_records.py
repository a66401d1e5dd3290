"""The coordinator's DiLoCo outer-state records on the checkpoint store (blocking I/O, bounded).

The data plane says what to save (`PersistOuter`, after each step that changed
its `OuterState`) and the control plane decides what to restore
(`gradsync_server.control.outer_resume`); this is where the bytes meet the
store: one record per job and plane, next to the job's checkpoints (a file
`<store>/<job>/outer-state-shard<i>` written atomically and fsync'd, or the
Redis key `gradsync:ckpt:<job>:outer-state-shard<i>`, proven durable like a
checkpoint). Every call runs in a store thread of its own, bounded by
`--store-timeout`, so a hung store stalls no other job.

Cost: a save writes the plane's global parameters and momentum, 8 bytes per
parameter of its range, once per outer round (DiLoCo rounds are minutes
apart); the round's last answers wait for it (see `Delivery`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from gradsync_server.config import CoordinatorConfig
from gradsync_server.dataplane.outer_snapshot import (
    OuterSnapshot,
    encode_snapshot,
    record_name,
)
from gradsync_server.store.checkpoint import CheckpointError, CheckpointStore
from gradsync_server.store.checkpoint_file import FileCheckpointStore
from gradsync_server.store.checkpoint_redis import RedisCheckpointStore
from gradsync_server.store.stores import open_store

__all__ = ["OuterRecords", "configured_store"]

log = logging.getLogger("gradsync.server")

_RecordStore = FileCheckpointStore | RedisCheckpointStore


def configured_store(config: CoordinatorConfig) -> CheckpointStore | None:
    """The checkpoint store `--checkpoint-store` names, opened (None: none configured)."""
    if not config.checkpoint_store:
        return None
    return open_store(
        config.checkpoint_store, password=config.redis_password, timeout_s=config.store_timeout_s
    )


def _encode_and_save(store: _RecordStore, snapshot: OuterSnapshot, shard_index: int) -> None:
    """(store thread) Encoding hashes every byte: off the event loop too."""
    store.save_record(snapshot.job_id, record_name(shard_index), encode_snapshot(snapshot))


class OuterRecords:
    """Saves and loads the outer-state records of the coordinator's jobs.

    Args:
        store: the coordinator's checkpoint store (a file or Redis store; any other
            kind holds no outer state, and a restart reseeds as without a store).
        timeout_s: bound on every call (`--store-timeout`).
    """

    def __init__(self, store: CheckpointStore | None, timeout_s: float) -> None:
        self._store: _RecordStore | None = (
            store if isinstance(store, FileCheckpointStore | RedisCheckpointStore) else None
        )
        self._timeout_s = timeout_s
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="gradsync-outer-store")
        #: Saves that failed since start-up (each logged).
        self.failures = 0
        #: Records saved since start-up.
        self.saves = 0

    @property
    def enabled(self) -> bool:
        """True when outer states are saved (a file or Redis store is configured)."""
        return self._store is not None

    @property
    def description(self) -> str:
        """Where the records go, for logs."""
        return self._store.description if self._store is not None else "nowhere"

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
            await self._call(_encode_and_save, store, snapshot, shard_index)
        except (CheckpointError, OSError, TimeoutError) as exc:
            self.failures += 1
            log.error("%s: %s failed: %s", store.description, what, exc or "timed out")
            return False
        self.saves += 1
        log.debug("%s: %s (%d bytes)", store.description, what, snapshot.nbytes())
        return True

    async def load(self, job_id: str, shard_index: int) -> tuple[bytes | None, str]:
        """The stored record of (`job_id`, plane `shard_index`), or None and why not."""
        store = self._store
        if store is None:
            return None, "no file or Redis checkpoint store is configured"
        try:
            blob = await self._call(store.load_record, job_id, record_name(shard_index))
        except (CheckpointError, OSError, TimeoutError) as exc:
            return None, f"reading it from {store.description} failed: {exc or 'timed out'}"
        if blob is None:
            return None, f"{store.description} holds no outer state of job '{job_id}'"
        return blob, ""

    async def load_all(
        self, job_id: str, planes: int, fresh_start: bool = False
    ) -> list[tuple[bytes | None, str]]:
        """The records of planes 0..planes-1 of `job_id` (see `load`); none read under
        `--fresh-start`, which starts every job anew (the records stay until overwritten)."""
        if fresh_start:
            return [(None, "--fresh-start: the stored outer state is not read")] * planes
        return [await self.load(job_id, index) for index in range(planes)]

    async def _call(self, function: Callable[..., bytes | None], *args: object) -> bytes | None:
        loop = asyncio.get_running_loop()
        call = loop.run_in_executor(self._executor, function, *args)
        return await asyncio.wait_for(call, self._timeout_s)

    def close(self) -> None:
        """Stop the store thread (a call still running finishes in the background)."""
        self._executor.shutdown(wait=False, cancel_futures=True)
