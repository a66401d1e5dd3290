"""Raw write access to a checkpoint store, as an attacker (or an accident) has it.

The tests of the high-water mark roll a store back behind the coordinator's back: move the
`latest` pointer, delete, damage or swap a blob, empty the store. `StoreTamper` does it for
the file store (the files themselves) and for Redis (its keys, over a plain client), so one
scenario runs on both backends.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from gradsync_server.store.checkpoint_file import FileCheckpointStore


class StoreTamper:
    """Edit the stored checkpoints of a job without going through the store's code.

    Args:
        url: the store, as given to `--checkpoint-store` (a folder or a redis:// URL).
    """

    def __init__(self, url: str) -> None:
        self.url = url
        self._redis: Any = None
        self._root: Path | None = None
        if url.startswith("redis://"):
            import redis

            self._redis = redis.Redis.from_url(url, socket_timeout=5)
        else:
            self._root = Path(url)

    def close(self) -> None:
        if self._redis is not None:
            self._redis.close()

    def _directory(self, job_id: str) -> Path:
        assert self._root is not None
        return FileCheckpointStore(self._root).job_directory(job_id)

    def _blob_path(self, job_id: str, step: int) -> Path:
        return self._directory(job_id) / f"step-{step:020d}.ckpt"

    @staticmethod
    def _key(job_id: str, suffix: int | str) -> str:
        return f"gradsync:ckpt:{job_id}:{suffix}"

    def point_latest(self, job_id: str, step: int) -> None:
        """Make the `latest` pointer name `step`."""
        if self._redis is not None:
            self._redis.set(self._key(job_id, "latest"), str(step))
        else:
            (self._directory(job_id) / "latest").write_text(f"{step}\n")

    def read_blob(self, job_id: str, step: int) -> bytes:
        if self._redis is not None:
            value = self._redis.get(self._key(job_id, step))
            assert isinstance(value, bytes), f"no blob of job {job_id!r} step {step}"
            return value
        return self._blob_path(job_id, step).read_bytes()

    def write_blob(self, job_id: str, step: int, blob: bytes) -> None:
        if self._redis is not None:
            self._redis.set(self._key(job_id, step), blob)
            self._redis.zadd(self._key(job_id, "steps"), {str(step): step})
        else:
            self._blob_path(job_id, step).write_bytes(blob)

    def delete_blob(self, job_id: str, step: int) -> None:
        """Delete the checkpoint of `step` (the blob and, in Redis, its index entry)."""
        if self._redis is not None:
            self._redis.delete(self._key(job_id, step))
            self._redis.zrem(self._key(job_id, "steps"), str(step))
        else:
            self._blob_path(job_id, step).unlink()

    def flip_byte(self, job_id: str, step: int) -> None:
        """Flip one bit in the middle of the blob of `step` (its payload or its header)."""
        blob = bytearray(self.read_blob(job_id, step))
        blob[len(blob) // 2] ^= 0x10
        self.write_blob(job_id, step, bytes(blob))

    def wipe(self, job_id: str) -> None:
        """Delete everything the store holds for the job."""
        if self._redis is not None:
            keys = list(self._redis.scan_iter(match=f"gradsync:ckpt:{job_id}:*"))
            if keys:
                self._redis.delete(*keys)
        else:
            for path in self._directory(job_id).iterdir():
                path.unlink()

    def steps(self, job_id: str) -> list[int]:
        """The steps with a stored blob, ascending (what is left after the tampering)."""
        if self._redis is not None:
            members = self._redis.zrange(self._key(job_id, "steps"), 0, -1)
            return sorted(int(member) for member in members)
        return sorted(int(path.name[5:25]) for path in self._directory(job_id).glob("step-*.ckpt"))
