"""The Redis backend of the checkpoint store: blobs acknowledged once Redis fsync'd them.

See `gradsync_server.store.checkpoint` for the blob format and what "durable" means here.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from gradsync_server.store.checkpoint import (
    Checkpoint,
    CheckpointError,
    PruneGuard,
    StoreReading,
    _check_job_id,
    _check_keep,
    _doomed_steps,
    _parse_steps,
    _StoreLifecycle,
    _text,
    encode,
)
from gradsync_server.store.lease import LeaseError, fence_script

if TYPE_CHECKING:
    import redis

log = logging.getLogger("gradsync.server.checkpoint")  # one logger for the whole store

_WRITE_BLOB_SCRIPT = """
redis.call('SET', KEYS[1], ARGV[1])
redis.call('ZADD', KEYS[2], ARGV[2], ARGV[2])
return 1
"""

_SET_SCRIPT = "redis.call('SET', KEYS[1], ARGV[1])\nreturn 1\n"

#: Returns (lease key, this coordinator's lease value), or raises while it holds none.
FenceToken = Callable[[], tuple[str, str]]


def _key(job_id: str, suffix: int | str) -> str:
    return f"gradsync:ckpt:{job_id}:{suffix}"


class RedisCheckpointStore(_StoreLifecycle):
    """Checkpoints in Redis: blobs at `gradsync:ckpt:<job_id>:<step>`, the step number of the
    last acknowledged one at `gradsync:ckpt:<job_id>:latest`, and a sorted set of stored steps
    at `gradsync:ckpt:<job_id>:steps`.

    Job ids go into keys verbatim: every suffix (a step number, "latest", "steps") is free of
    colons, so two different jobs can never produce the same key. Keys carry no TTL.
    """

    def __init__(
        self,
        url: str,
        keep: int = 3,
        client: redis.Redis | None = None,
        socket_timeout_s: float = 5.0,
        password: str | None = None,
    ) -> None:
        """Set up the store; nothing is sent to the server before the first call.

        Args:
            url: "redis://[user:password@]host:port/db"; shown with the password hidden.
            keep: checkpoints kept per job, at least 1.
            client: a redis-py client to use instead of one built from `url` (a test seam);
                `close` leaves it open, and it must bring its own socket timeouts.
            socket_timeout_s: bound on connecting and on every reply; WAITAOF is given half
                of it, so that the server answers before the socket gives up.
            password: the server's password, given apart from the URL (which shows in the
                process list); overrides one in the URL. Never logged.

        Raises:
            ImportError: the redis package is missing (install gradsync[redis]).
        """
        self.keep = _check_keep(keep)
        if not socket_timeout_s > 0:
            raise ValueError(f"socket timeout must be positive, got {socket_timeout_s} s")
        self.socket_timeout_s = socket_timeout_s
        self.description = re.sub(r"(//[^/@]*?:)[^/@]*@", r"\1***@", url)
        try:
            import redis as redis_module
            from redis.backoff import NoBackoff
            from redis.retry import Retry
        except ModuleNotFoundError as exc:
            raise ImportError(
                f"the Redis checkpoint store ({self.description}) needs the redis package: "
                f"pip install 'gradsync[redis]'"
            ) from exc
        self._errors: tuple[type[Exception], ...] = (redis_module.RedisError, OSError, LeaseError)
        self._response_error = redis_module.ResponseError
        self._owns_client = client is None
        # No retries (redis-py retries 3 to 10 times by default): a failure is reported at
        # once, so each network wait costs at most one timeout.
        self._client: redis.Redis = (
            client
            if client is not None
            else redis_module.Redis.from_url(
                # redis-py lets a password in the URL win over the keyword: drop it.
                url if password is None else re.sub(r"(//[^/@:]*):[^/@]*@", r"\1@", url),
                **({"password": password} if password is not None else {}),
                socket_timeout=socket_timeout_s,
                socket_connect_timeout=socket_timeout_s,
                retry=Retry(NoBackoff(), 0),
            )
        )
        self._waitaof_timeout_ms = max(1, int(socket_timeout_s * 500))
        self._server_version = ""
        self._uses_waitaof: bool | None = None  # decided from the server version at first save
        #: A `--lease` coordinator's lease token: every write checks it in Redis (fencing).
        self.fence: FenceToken | None = None

    def save(self, checkpoint: Checkpoint, guard: PruneGuard | None = None) -> None:
        """See `CheckpointStore.save`."""
        self._check_open()
        job_id, step = checkpoint.job_id, checkpoint.step
        try:
            self._check_durability_support(job_id, step)
            blob_batch = self._client.pipeline(transaction=False)
            blob_keys = (_key(job_id, step), _key(job_id, "steps"))
            self._write(blob_batch, _WRITE_BLOB_SCRIPT, blob_keys, (encode(checkpoint), step))
            self._execute_durably(blob_batch, job_id, step)
            pointer_batch = self._client.pipeline(transaction=False)
            self._set(pointer_batch, _key(job_id, "latest"), step)
            self._execute_durably(pointer_batch, job_id, step)
        except self._errors as exc:
            raise self._failed("saving", job_id, step, exc) from exc
        self._prune(job_id, step, guard)

    def save_record(self, job_id: str, name: str, parts: list[bytes]) -> None:
        """SET `gradsync:ckpt:<job_id>:<name>`, proven durable (the DiLoCo outer state).

        One SET replaces the record whole: a reader sees the old one or the new one.

        Raises:
            CheckpointError: it could not be made durable.
        """
        self._check_open()
        try:
            self._check_durability_support(job_id, -1)
            batch = self._client.pipeline(transaction=False)
            self._set(batch, _key(job_id, name), b"".join(parts))
            self._execute_durably(batch, job_id, -1)
        except self._errors as exc:
            raise self._failed("saving the outer state of", job_id, None, exc) from exc

    def _write(
        self,
        batch: redis.client.Pipeline,
        script: str,
        keys: tuple[str, ...],
        args: tuple[Any, ...],
    ) -> None:
        """Queue `script`, guarded by the lease when this store is fenced (`fence`)."""
        if self.fence is None:
            batch.eval(script, len(keys), *keys, *args)
            return
        lease_key, value = self.fence()  # raises while no lease is held: nothing is sent
        # The lease key and our value go last, where `fence_script`'s guard reads them.
        batch.eval(fence_script(script), len(keys) + 1, *keys, lease_key, *args, value)

    def _set(self, batch: redis.client.Pipeline, key: str, value: Any) -> None:
        """Queue a SET, guarded by the lease when this store is fenced."""
        if self.fence is None:
            batch.set(key, value)
        else:
            self._write(batch, _SET_SCRIPT, (key,), (value,))

    def load_record(self, job_id: str, name: str) -> bytes | None:
        """The value of `gradsync:ckpt:<job_id>:<name>`, or None when there is none.

        Raises:
            CheckpointError: the server could not be read.
        """
        self._check_open()
        try:
            value = self._client.get(_key(job_id, name))
        except self._errors as exc:
            raise self._failed("reading the outer state of", job_id, None, exc) from exc
        return value if isinstance(value, bytes) or value is None else value.encode()

    def read(self, job_id: str) -> StoreReading:
        """See `CheckpointStore.read`."""
        self._check_open()
        _check_job_id(job_id)
        try:
            batch = self._client.pipeline(transaction=False)
            batch.get(_key(job_id, "latest"))
            batch.zrange(_key(job_id, "steps"), 0, -1)
            pointer_value, members = batch.execute()
        except self._errors as exc:
            raise self._failed("loading", job_id, None, exc) from exc

        def read_blob(step: int) -> bytes | None:
            try:
                value = self._client.get(_key(job_id, step))
            except self._errors as exc:
                raise self._failed("loading", job_id, step, exc) from exc
            if value is None:
                return None
            return value.encode() if isinstance(value, str) else bytes(value)

        pointer_text = None if pointer_value is None else _text(pointer_value)
        return self._read_newest(job_id, pointer_text, _parse_steps(members), read_blob)

    def steps(self, job_id: str) -> list[int]:
        """See `CheckpointStore.steps`."""
        self._check_open()
        _check_job_id(job_id)
        try:
            return _parse_steps(self._client.zrange(_key(job_id, "steps"), 0, -1))
        except self._errors as exc:
            raise self._failed("listing", job_id, None, exc) from exc

    def close(self) -> None:
        """See `CheckpointStore.close`; an injected client stays open."""
        if not self._closed and self._owns_client:
            self._client.close()
        super().close()

    def _check_durability_support(self, job_id: str, step: int) -> None:
        """At first use, pick the durability proof the server supports, or refuse to save."""
        if self._uses_waitaof is not None:
            return
        info = self._client.info("server")
        self._server_version = _text(info.get("redis_version", "unknown"))
        version = tuple(int(part) for part in re.findall(r"\d+", self._server_version)[:2])
        if version >= (7, 2):
            self._uses_waitaof = True
            return
        try:
            settings = self._client.config_get("append*")
        except self._response_error as exc:
            raise CheckpointError(
                f"{self.description}: saving job {job_id!r} step {step} failed: Redis "
                f"{self._server_version} has no WAITAOF, so durability requires appendonly yes "
                f"and appendfsync always, and CONFIG GET to check them was refused: {exc}"
            ) from exc
        self._require_fsync_always(settings, job_id, step)
        self._uses_waitaof = False

    def _execute_durably(self, batch: redis.client.Pipeline, job_id: str, step: int) -> None:
        """Run `batch` and, on its connection, prove that its writes reached the disk."""
        if self._uses_waitaof:
            # The raw command works with every redis>=5 (the `waitaof` method came later).
            waitaof = ("WAITAOF", 1, 0, self._waitaof_timeout_ms)
            batch.execute_command(*waitaof)  # type: ignore[no-untyped-call]  # unannotated upstream
        else:
            # Read back in the same batch: a CONFIG SET since the first check is caught.
            batch.config_get("append*")
        try:
            results = batch.execute()
        except self._response_error as exc:
            if "appendonly" not in str(exc):
                raise
            raise CheckpointError(
                f"{self.description}: saving job {job_id!r} step {step} failed: WAITAOF needs "
                f"the append-only file; appendonly yes is required: start the server with "
                f"`redis-server --appendonly yes` (or CONFIG SET appendonly yes) ({exc})"
            ) from exc
        if not self._uses_waitaof:
            self._require_fsync_always(results[-1], job_id, step)
            return
        local_fsyncs = int(results[-1][0])
        if local_fsyncs < 1:
            raise CheckpointError(
                f"{self.description}: saving job {job_id!r} step {step} failed: the write was "
                f"not fsync'd to the append-only file within {self._waitaof_timeout_ms} ms "
                f"(WAITAOF reported {local_fsyncs} local fsyncs); is the Redis disk stalled?"
            )

    def _require_fsync_always(self, settings: Mapping[Any, Any], job_id: str, step: int) -> None:
        values = {_text(name): _text(value) for name, value in settings.items()}
        problems = [
            f"{name} is {values.get(name, 'unset')!r}"
            for name, wanted in (("appendonly", "yes"), ("appendfsync", "always"))
            if values.get(name) != wanted
        ]
        if problems:
            raise CheckpointError(
                f"{self.description}: saving job {job_id!r} step {step} failed: Redis "
                f"{self._server_version} cannot make checkpoints durable: "
                f"{' and '.join(problems)}. Without WAITAOF (Redis < 7.2), appendonly yes and "
                f"appendfsync always are required so that each acknowledged write is fsync'd "
                f"to the append-only file; start the server with `redis-server --appendonly yes "
                f"--appendfsync always` (or set both in redis.conf), or use Redis >= 7.2"
            )

    def _prune(self, job_id: str, saved_step: int, guard: PruneGuard | None) -> None:
        """Delete superseded blobs; failures only warn (the save is already durable)."""
        try:
            stored = _parse_steps(self._client.zrange(_key(job_id, "steps"), 0, -1))
            doomed = _doomed_steps(stored, saved_step, self.keep, guard)
            if doomed:
                batch = self._client.pipeline(transaction=False)
                # Index first: a crash in between leaves an unindexed blob, never a dangling entry.
                batch.zrem(_key(job_id, "steps"), *(str(step) for step in doomed))
                batch.delete(*(_key(job_id, step) for step in doomed))
                batch.execute()
        except self._errors as exc:
            log.warning(
                "%s: could not delete old checkpoints of job %r: %s", self.description, job_id, exc
            )


# Blob and index entry in one atomic step (a script reaches the AOF as one MULTI/EXEC), so
# the index never names a blob that was not written.
