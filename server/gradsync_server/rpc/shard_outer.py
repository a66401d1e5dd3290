"""A coordinator shard's range of the DiLoCo outer state on the checkpoint store.

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
(`outer_records.outer_state_key`: from the shard token when that is a secret
of the leader and its shards alone), with the run the leader names in the
job's first view (`ShardJobView.outer_run`), and restores only a record that
verifies under that key and belongs to that run.

That one read happens on the shard's loop, once per restored job and bounded
by `--store-timeout` (the Redis socket timeout; a local file otherwise): no
chunk may be answered before it, and a job's start is rare.
"""

from __future__ import annotations

import logging

from gradsync_proto.v1 import gradsync_pb2 as pb

from gradsync_server.config import CoordinatorConfig
from gradsync_server.dataplane.outer_snapshot import (
    OuterSnapshotError,
    decode_snapshot,
    record_name,
)
from gradsync_server.dataplane.plane import JobPlane
from gradsync_server.rpc.outer_records import OuterRecords, configured_store, outer_state_key
from gradsync_server.store.checkpoint import CheckpointError
from gradsync_server.store.checkpoint_file import FileCheckpointStore
from gradsync_server.store.checkpoint_redis import RedisCheckpointStore

__all__ = ["ShardOuterStates"]

log = logging.getLogger("gradsync.server")


class ShardOuterStates:
    """Where a shard saves its outer-state records, and how it restores one.

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
            blob = self._load(job_id, shard_index)
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

    def _load(self, job_id: str, shard_index: int) -> bytes | None:
        store = self._store
        if isinstance(store, FileCheckpointStore | RedisCheckpointStore):
            return store.load_record(job_id, record_name(shard_index))
        return None

    def close(self) -> None:
        """Stop the store thread and close the store."""
        self.records.close()
        if self._store is not None:
            self._store.close()
