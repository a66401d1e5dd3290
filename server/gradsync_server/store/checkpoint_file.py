"""The file backend of the checkpoint store: fsync'd blobs and an atomically flipped pointer.

See `gradsync_server.store.checkpoint` for the blob format and what "durable" means here.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import tempfile
import threading
from collections.abc import Callable, Iterable
from pathlib import Path

from gradsync_server.store.checkpoint import (
    Checkpoint,
    CheckpointError,
    PruneGuard,
    StoreReading,
    _check_job_id,
    _check_keep,
    _doomed_steps,
    _encode_parts,
    _StoreLifecycle,
)

log = logging.getLogger("gradsync.server.checkpoint")  # one logger for the whole store

_BLOB_NAME = re.compile(r"step-(\d{20})\.ckpt")
# Letters are case-folded away so that names stay distinct on case-insensitive filesystems.
_SAFE_NAME_CHARACTERS = frozenset("abcdefghijklmnopqrstuvwxyz0123456789_-")
_MAX_NAME_BYTES = 255


def _blob_name(step: int) -> str:
    return f"step-{step:020d}.ckpt"


def _job_directory_name(job_id: str) -> str:
    """Percent-encode everything but [a-z0-9_-]: no "/", no leading ".", one name per job."""
    _check_job_id(job_id)
    name = "".join(
        character
        if character in _SAFE_NAME_CHARACTERS
        else "".join(f"%{byte:02X}" for byte in character.encode())
        for character in job_id
    )
    if len(name) > _MAX_NAME_BYTES:
        raise ValueError(
            f"job id {job_id[:40]!r}... encodes to a {len(name)}-character directory name, "
            f"over the {_MAX_NAME_BYTES}-byte filesystem limit; use a shorter job id"
        )
    return name


class FileCheckpointStore(_StoreLifecycle):
    """Checkpoints as files: `<directory>/<encoded job id>/step-<20 digits>.ckpt` plus `latest`.

    One process writes a given job at a time (the coordinator that owns it); saves within this
    object are serialized by a lock.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        keep: int = 3,
        *,
        fsync: Callable[[int], None] = os.fsync,
    ) -> None:
        """Set up the store; nothing is created on disk before the first save.

        Args:
            directory: root folder; created (with its parents) at the first save.
            keep: checkpoints kept per job, at least 1.
            fsync: flushes a file descriptor to stable storage; a seam for tests that check
                the order of writes and syncs.
        """
        self.keep = _check_keep(keep)
        self.directory = Path(directory).absolute()
        self.description = self.directory.as_uri()
        self._fsync = fsync
        self._lock = threading.Lock()

    def job_directory(self, job_id: str) -> Path:
        """The folder holding `job_id`'s checkpoints (its name is injective and traversal-free)."""
        return self.directory / _job_directory_name(job_id)

    def save(self, checkpoint: Checkpoint, guard: PruneGuard | None = None) -> None:
        """See `CheckpointStore.save`."""
        self._check_open()
        job_dir = self.job_directory(checkpoint.job_id)
        with self._lock:
            try:
                self._make_directory(job_dir)
                parts = _encode_parts(checkpoint)
                write_atomically(job_dir, _blob_name(checkpoint.step), parts, self._fsync)
                latest = (f"{checkpoint.step}\n".encode(),)
                write_atomically(job_dir, "latest", latest, self._fsync)
            except OSError as exc:
                raise self._failed("saving", checkpoint.job_id, checkpoint.step, exc) from exc
            self._prune(job_dir, checkpoint.job_id, checkpoint.step, guard)

    def read(self, job_id: str) -> StoreReading:
        """See `CheckpointStore.read`."""
        stored = self.steps(job_id)
        job_dir = self.job_directory(job_id)
        try:
            pointer_text: str | None = (job_dir / "latest").read_text("utf-8", "replace")
        except FileNotFoundError:
            pointer_text = None
        except OSError as exc:
            raise self._failed("loading", job_id, None, exc) from exc

        def read_blob(step: int) -> bytes | None:
            try:
                return (job_dir / _blob_name(step)).read_bytes()
            except FileNotFoundError:
                return None
            except OSError as exc:
                raise self._failed("loading", job_id, step, exc) from exc

        return self._read_newest(job_id, pointer_text, stored, read_blob)

    def steps(self, job_id: str) -> list[int]:
        """See `CheckpointStore.steps`."""
        self._check_open()
        try:
            names = os.listdir(self.job_directory(job_id))
        except FileNotFoundError:
            return []
        except OSError as exc:
            raise self._failed("listing", job_id, None, exc) from exc
        return sorted(int(match[1]) for name in names if (match := _BLOB_NAME.fullmatch(name)))

    def save_record(self, job_id: str, name: str, parts: Iterable[bytes]) -> None:
        """Write `<job dir>/<name>` atomically and durably (the DiLoCo outer state).

        Raises:
            OSError: it could not be made durable (the old record, if any, stays).
        """
        self._check_open()
        job_dir = self.job_directory(job_id)
        with self._lock:
            self._make_directory(job_dir)
            write_atomically(job_dir, name, parts, self._fsync)

    def load_record(self, job_id: str, name: str) -> bytes | None:
        """The bytes of `<job dir>/<name>`, or None when there is none."""
        self._check_open()
        try:
            return (self.job_directory(job_id) / name).read_bytes()
        except FileNotFoundError:
            return None

    def _make_directory(self, path: Path) -> None:
        """mkdir -p, fsyncing each parent whose entries changed so the new folders persist."""
        if path.is_dir():
            return
        self._make_directory(path.parent)
        with contextlib.suppress(FileExistsError):
            path.mkdir()
        sync_directory(path.parent, self._fsync)

    def _prune(self, job_dir: Path, job_id: str, saved_step: int, guard: PruneGuard | None) -> None:
        """Delete superseded blobs and stray temp files; failures only warn (the save is done)."""
        try:
            doomed_steps = _doomed_steps(self.steps(job_id), saved_step, self.keep, guard)
            # Leftovers of saves that crashed before their rename; one writer per job, so no
            # temp file here belongs to a save in progress.
            stray = [path for path in job_dir.glob(".*.tmp") if path.is_file()]
        except (CheckpointError, OSError) as exc:
            log.warning("%s: could not list old files of job %r: %s", self.description, job_id, exc)
            return
        doomed = [job_dir / _blob_name(step) for step in doomed_steps] + stray
        for path in doomed:
            try:
                path.unlink()
            except FileNotFoundError:
                pass
            except OSError as exc:
                log.warning("%s: could not delete old file %s: %s", self.description, path, exc)


def write_atomically(
    directory: Path, name: str, parts: Iterable[bytes], fsync: Callable[[int], None]
) -> None:
    """temp file (mode 0600) -> write -> flush -> fsync -> rename -> fsync(directory).

    A reader sees the old file or the new one, never a torn one, and the new one
    survives a crash once this returns.
    """
    descriptor, temp_name = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(descriptor, "wb") as file:
            for part in parts:
                file.write(part)
            file.flush()
            fsync(file.fileno())
        os.replace(temp_name, directory / name)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temp_name)
        raise
    sync_directory(directory, fsync)


def sync_directory(path: Path, fsync: Callable[[int], None]) -> None:
    """fsync a directory, so that the entries just renamed or removed in it persist."""
    descriptor = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        fsync(descriptor)
    finally:
        os.close(descriptor)
