"""Where the coordinator keeps its high-water marks: one small file per (store, job).

The mark (`gradsync_server.store.high_water`) is only worth something where the checkpoint
store cannot roll it back, so it lives in the coordinator's own state directory
(`--state-dir`, default `$GRADSYNC_STATE_DIR`, else `$XDG_STATE_HOME/gradsync`, else
`~/.local/state/gradsync`), never in the store: `CoordinatorConfig` refuses a state directory
inside a file store's folder. Whoever can write the state directory is the coordinator's
own user (out of scope in SECURITY.md), so the files carry no MAC.

Each file is `<state dir>/high-water/<sha256 of (store, job)>.json`, mode 0600 in a 0700
folder, replaced atomically (temp file, fsync, rename, fsync of the folder) after the
store acknowledged a save, so a crash leaves the old mark or the new one. A crash between
the store's acknowledgement and the rename leaves the old mark; the checkpoint then
records it as its `previous` mark, which `judge` accepts as a successor.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

from gradsync_server.store.checkpoint import CheckpointError
from gradsync_server.store.checkpoint_file import sync_directory, write_atomically
from gradsync_server.store.high_water import HighWater

T = TypeVar("T")

#: Environment variable naming the state directory (the `--state-dir` default).
ENV_STATE_DIR = "GRADSYNC_STATE_DIR"
_FORMAT = 1
#: A mark file is a few hundred bytes; anything much larger is not one.
_MAX_BYTES = 1 << 16


def _high_water(record: dict[str, Any]) -> HighWater:
    mark = HighWater(int(record["step"]), str(record["sha256"]), str(record["timeline"]))
    if mark.step < 0 or not mark.digest:
        raise ValueError(f"step {mark.step}, digest {mark.digest!r}")
    return mark


class HighWaterError(CheckpointError):
    """A mark file exists but cannot be read or trusted; the message names it."""


def default_state_dir(environ: Mapping[str, str], home: str | None = None) -> str:
    """The state directory when `--state-dir` is not given (XDG Base Directory rules).

    Args:
        environ: the environment (`$GRADSYNC_STATE_DIR`, `$XDG_STATE_HOME`, `$HOME`).
        home: the home directory when `$HOME` is unset (default: `Path.home()`).
    """
    explicit = environ.get(ENV_STATE_DIR)
    if explicit:
        return explicit
    xdg = environ.get("XDG_STATE_HOME")
    if xdg and os.path.isabs(xdg):  # the spec says a relative value is to be ignored
        return os.path.join(xdg, "gradsync")
    base = environ.get("HOME") or home or str(Path.home())
    return os.path.join(base, ".local", "state", "gradsync")


class HighWaterMarks:
    """The marks of every (store, job) this coordinator saved to, in one folder.

    Args:
        directory: the state directory (created, mode 0700, at the first write).
        fsync: flushes a file descriptor to stable storage (a seam for tests).
    """

    def __init__(
        self, directory: str | os.PathLike[str], *, fsync: Callable[[int], None] = os.fsync
    ) -> None:
        self.directory = Path(directory).absolute() / "high-water"
        self._fsync = fsync

    def path(self, description: str, job_id: str) -> Path:
        """The file of the mark of `job_id` in the store described by `description`."""
        name = hashlib.sha256(json.dumps([description, job_id]).encode()).hexdigest()[:40]
        return self.directory / f"{name}.json"

    def read(self, description: str, job_id: str) -> HighWater | None:
        """The mark, or None when this coordinator never saved that job to that store.

        Raises:
            HighWaterError: the file exists but is unreadable, malformed or another's.
        """
        return self.read_record(
            self.path(description, job_id), description, job_id, "high-water mark", _high_water
        )

    def write(self, description: str, job_id: str, mark: HighWater) -> None:
        """Replace the mark atomically and durably.

        Raises:
            OSError: it could not be written (the old mark, if any, stays).
        """
        fields = {"step": mark.step, "sha256": mark.digest, "timeline": mark.timeline}
        self.write_record(self.path(description, job_id), description, job_id, fields)

    def read_record(
        self,
        path: Path,
        description: str,
        job_id: str,
        what: str,
        parse: Callable[[dict[str, Any]], T],
    ) -> T | None:
        """The mark file at `path` as `parse` reads its fields, or None when there is none.

        The file must be one of ours (format, store and job); `parse` raises ValueError,
        KeyError or TypeError on fields it cannot trust.

        Raises:
            HighWaterError: the file exists but is unreadable, malformed or another's,
                named as `what` ("high-water mark").
        """
        try:
            with open(path, "rb") as file:
                raw = file.read(_MAX_BYTES + 1)
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise HighWaterError(f"cannot read the {what} {path}: {exc}") from exc
        try:
            if len(raw) > _MAX_BYTES:
                raise ValueError(f"over {_MAX_BYTES} bytes")
            record = json.loads(raw)
            if record["format"] != _FORMAT:
                raise ValueError(f"format {record['format']!r}, this build reads {_FORMAT}")
            if record["store"] != description or record["job_id"] != job_id:
                raise ValueError(f"it belongs to job {record['job_id']!r} in {record['store']}")
            return parse(record)
        except (ValueError, KeyError, TypeError) as exc:
            raise HighWaterError(
                f"the {what} {path} is unusable ({exc}); delete it to accept what the "
                f"store {description} holds for job {job_id!r}"
            ) from exc

    def write_record(
        self, path: Path, description: str, job_id: str, fields: Mapping[str, object]
    ) -> None:
        """Replace the mark file at `path` atomically and durably with `fields`.

        Raises:
            OSError: it could not be written (the old mark, if any, stays).
        """
        record = {"format": _FORMAT, "store": description, "job_id": job_id, **fields}
        self._make_directories()
        # The temp file is created 0600: no other user reads or replaces a mark.
        line = json.dumps(record, sort_keys=True).encode() + b"\n"
        write_atomically(self.directory, path.name, [line], self._fsync)

    def forget(self, description: str, job_id: str) -> None:
        """Delete the mark (`--fresh-start`: the job starts over, from nothing acknowledged).

        Raises:
            OSError: it could not be deleted.
        """
        try:
            os.unlink(self.path(description, job_id))
        except FileNotFoundError:
            return
        sync_directory(self.directory, self._fsync)

    def _make_directories(self) -> None:
        if self.directory.is_dir():
            return
        for folder in (self.directory.parent, self.directory):
            with contextlib.suppress(FileExistsError):
                folder.parent.mkdir(parents=True, exist_ok=True)
                folder.mkdir(mode=0o700)
                sync_directory(folder.parent, self._fsync)
