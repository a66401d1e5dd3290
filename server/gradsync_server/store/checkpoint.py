"""The coordinator's durable checkpoint store: one blob format, a file backend and a Redis backend.

A restarted coordinator resumes from the last acknowledged checkpoint (architecture invariant 7),
so `save` returns only once a checkpoint is durable and complete, and `load_latest` never hands
back a torn or bit-flipped one: every blob carries checksums, is written in full before a
`latest` pointer is flipped to it, and a blob that fails verification is skipped with a loud
warning in favour of the previous complete one. `read` says what was skipped, so that the
coordinator (with a token) can refuse that fall-back instead: a store that went back behind an
acknowledged save may have been rolled back on purpose (`gradsync_server.store.high_water`).
The module knows nothing of gRPC; the coordinator calls it (from a worker thread, the calls
block) and owns what goes in the payload.

This module is the format, the store protocol and how both backends read a job's
checkpoints (`_StoreLifecycle`); the backends (`checkpoint_file`, `checkpoint_redis`) import it,
and `gradsync_server.store.stores` picks a backend from a URL, so no module imports one that
imports it back.

The `latest` pointer names the last acknowledged save, which is what `load_latest` starts from;
blobs of higher steps are leftovers of saves that never completed (or of a timeline abandoned
when a corrupt checkpoint forced a restore from an older one) and are never loaded. Only once a
save is durable does it delete older checkpoints beyond the newest `keep`, and those leftovers;
and the coordinator passes a `PruneGuard` so that no save deletes a checkpoint newer than the
one its job resumed from unless that job wrote it (a job started fresh keeps the old timeline).

What "durable" means, per backend
---------------------------------
File (`FileCheckpointStore`, `file:///path`): the blob is written to a temp file in the job's
directory, flushed, fsync'd, renamed over its final name, and the directory is fsync'd; only
then is the `latest` pointer replaced the same way. So when `save` returns:

- a crash of the coordinator process (even SIGKILL in the middle of a save) loses nothing that
  was acknowledged; an interrupted save leaves at most a stray temp file or a complete blob
  that no pointer names yet, and `load_latest` returns the last acknowledged checkpoint;
- a power loss or kernel crash loses nothing acknowledged either, because blob, pointer and
  both directory entries reached stable storage -- provided the storage honours fsync (a local
  POSIX filesystem such as ext4, xfs, btrfs or zfs; disks that acknowledge cached writes
  without power-loss protection, `cache=unsafe` virtual disks and tmpfs break this promise);
- the loss of the disk or host loses everything: there is a single copy.

Redis (`RedisCheckpointStore`, `redis://host:port/db`): the blob (and its entry in the job's
step index) is written atomically by one script, proven to be in the server's append-only file
on disk, and only then is the pointer set and proven on disk the same way. The proof depends on
the server version, which is checked at first use:

- Redis >= 7.2: `WAITAOF 1 0 <timeout>` on the same connection right after the writes must
  report that the local AOF was fsync'd past them (works with any `appendfsync` policy);
- Redis < 7.2 (Debian bookworm ships 7.0) has no WAITAOF, so the server must run with
  `appendonly yes` and `appendfsync always`: it then fsyncs the AOF before it replies to a
  write (and exits if that fsync fails). Both settings are read with CONFIG GET at first use
  and again in the same batch as every write, so a runtime CONFIG SET cannot slip past.

So when `save` returns, a crash of the coordinator, a crash of redis-server (SIGKILL) or a power
loss on the Redis host loses nothing acknowledged: Redis replays its AOF on restart. Not
covered: replicas are not waited for, so a failover to a replica that lagged can lose recent
checkpoints; the loss of the Redis host's disk loses everything; a `maxmemory-policy` of
`allkeys-*` can evict checkpoints (they then read as missing). Every network wait is bounded by
`socket_timeout_s` and nothing is retried, so an unreachable or hung server surfaces as a
`CheckpointError` instead of a hang.

Blob format (`encode` / `decode`, shared by both backends), all integers big-endian::

    8 bytes   magic b"GSCKPT\\r\\n" (the CR LF catches text-mode mangling)
    2 bytes   format version (1)
    4 bytes   length H of the JSON header
    H bytes   JSON header: job_id, step, membership_epoch, metadata, payload_length,
              payload_sha256 (hex)
    N bytes   payload
    32 bytes  SHA-256 of the fixed header and the JSON header

The trailing checksum covers the header directly and the payload through the payload's
SHA-256 and length recorded in the header, so the payload is hashed once and a truncated or
bit-flipped blob is detected wherever the damage is.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import struct
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from functools import cached_property
from types import MappingProxyType, TracebackType
from typing import Any, Protocol, Self

log = logging.getLogger("gradsync.server.checkpoint")  # one logger for the whole store

MAGIC = b"GSCKPT\r\n"
FORMAT_VERSION = 1
_FIXED_HEADER = struct.Struct(">8sHI")
_CHECKSUM_BYTES = 32
# Step numbers appear zero-padded to 20 digits in file names, enough for any unsigned 64-bit step.
MAX_STEP = 10**20 - 1
# Metadata is meant to be small; a header length beyond this means a corrupt or foreign blob.
MAX_HEADER_BYTES = 1 << 20


@dataclass(frozen=True)
class Checkpoint:
    """One saved state of a job, restored as a whole.

    Attributes:
        job_id: the job this state belongs to (any non-empty string; stores make it safe).
        step: the next step to run after restoring: training resumes at this step.
        membership_epoch: the membership epoch the state was taken under.
        payload: opaque blob produced by the client (model, optimizer state, ...).
        metadata: small string metadata, e.g. world size or a bucket layout digest.
    """

    job_id: str
    step: int
    membership_epoch: int
    payload: bytes = field(repr=False)
    metadata: Mapping[str, str]

    def __post_init__(self) -> None:
        _check_job_id(self.job_id)
        if isinstance(self.step, bool) or not isinstance(self.step, int):
            raise TypeError(f"checkpoint step must be an int, got {type(self.step).__name__}")
        if not 0 <= self.step <= MAX_STEP:
            raise ValueError(f"checkpoint step must be in 0..{MAX_STEP}, got {self.step}")
        epoch = self.membership_epoch
        if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0:
            raise ValueError(f"membership epoch must be an int >= 0, got {epoch!r}")
        if not isinstance(self.payload, bytes):
            raise TypeError(f"checkpoint payload must be bytes, got {type(self.payload).__name__}")
        if not isinstance(self.metadata, Mapping):
            raise TypeError(f"checkpoint metadata must be a mapping, got {self.metadata!r}")
        for key, value in self.metadata.items():
            if not isinstance(key, str) or not isinstance(value, str):
                raise TypeError(f"checkpoint metadata must map str to str, got {key!r}: {value!r}")
        # A read-only copy: the dataclass is frozen, its metadata should be too.
        object.__setattr__(self, "metadata", MappingProxyType(dict(self.metadata)))

    @cached_property
    def payload_sha256(self) -> str:
        """Hex SHA-256 of the payload, computed once: the blob header, the MAC and the blob
        digest all need it, and a payload can be a gigabyte."""
        return hashlib.sha256(self.payload).hexdigest()

    @property
    def header(self) -> CheckpointHeader:
        """Everything but the payload bytes (what the blob's JSON header records)."""
        return CheckpointHeader(
            self.job_id,
            self.step,
            self.membership_epoch,
            self.metadata,
            len(self.payload),
            self.payload_sha256,
        )


@dataclass(frozen=True)
class CheckpointHeader:
    """A checkpoint without its payload: what a blob's JSON header holds.

    Enough to check a MAC and to compute the blob's digest, so a loader can keep the
    headers of many blobs without holding their payloads (each up to `--max-checkpoint-mb`).
    """

    job_id: str
    step: int
    membership_epoch: int
    metadata: Mapping[str, str]
    payload_length: int
    payload_sha256: str


@dataclass(frozen=True)
class PruneGuard:
    """Which stored steps a job's save may prune: what it resumed from, and what it saved.

    A job that started from an older checkpoint than the newest stored one (a fresh start
    asked for with `--fresh-start`, or a fall-back past a damaged blob) must not have its
    first saves delete the newer checkpoints it did not write: they may be the only copy of
    the real progress (a store that was briefly unreadable). So a save deletes a step only if
    it is at or before `resumed_from`, or the job itself saved it (`written`).

    Attributes:
        resumed_from: step of the checkpoint the job resumed from (-1: none).
        written: steps this job has saved itself (acknowledged or attempted).
    """

    resumed_from: int = -1
    written: frozenset[int] = frozenset()

    def may_delete(self, step: int) -> bool:
        """True if pruning may delete the stored checkpoint of `step`."""
        return step <= self.resumed_from or step in self.written


class CheckpointError(Exception):
    """A checkpoint could not be saved or loaded; the message names backend, job, step and cause."""


class CheckpointCorruptError(CheckpointError):
    """A blob failed verification in `decode`: truncated, bit-flipped or not a checkpoint."""


class CheckpointStore(Protocol):
    """Where the coordinator keeps checkpoints; see the module docstring for durability."""

    description: str  # where the checkpoints live, for logs, e.g. "file:///var/lib/gradsync"

    def save(self, checkpoint: Checkpoint, guard: PruneGuard | None = None) -> None:
        """Store `checkpoint`; return only once it is durable and complete.

        Then prune older checkpoints beyond `keep` (only those `guard` allows, if given).

        Raises:
            CheckpointError: it could not be made durable; it must be treated as not saved.
        """

    def load_latest(self, job_id: str) -> Checkpoint | None:
        """The last acknowledged checkpoint of `job_id`, or the newest older one that verifies.

        Returns None when the job has no checkpoint at all.

        Raises:
            CheckpointError: the backend failed, or checkpoints exist but none verifies
                (starting from scratch would silently lose the job's progress).
        """

    def read(self, job_id: str) -> StoreReading:
        """What `load_latest` returns, plus what it passed over to get there.

        The checkpointer needs the rest to tell a damaged or rolled-back store from a sound
        one: the pointer, the newer candidates that failed verification, and the headers of
        verified blobs newer than the pointer (see `StoreReading`).

        Raises:
            CheckpointError: as `load_latest`.
        """

    def steps(self, job_id: str) -> list[int]:
        """Steps that have a stored blob (verified or not), ascending."""

    def close(self) -> None:
        """Release connections; later calls raise CheckpointError."""


def encode(checkpoint: Checkpoint) -> bytes:
    """The blob for `checkpoint` (see the module docstring for the layout)."""
    return b"".join(_encode_parts(checkpoint))


def _encode_parts(checkpoint: Checkpoint) -> tuple[bytes, bytes, bytes]:
    """(headers, payload, checksum): the file backend writes them without joining a copy."""
    headers = _headers(checkpoint.header)
    return headers, checkpoint.payload, hashlib.sha256(headers).digest()


def header_json(header: CheckpointHeader, metadata: Mapping[str, str]) -> bytes:
    """The canonical JSON of `header` with `metadata` in place of its own (the blob's JSON
    header, and what the checkpoint MAC signs)."""
    fields = {
        "job_id": header.job_id,
        "step": header.step,
        "membership_epoch": header.membership_epoch,
        "metadata": dict(metadata),
        "payload_length": header.payload_length,
        "payload_sha256": header.payload_sha256,
    }
    return json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()


def _headers(header: CheckpointHeader) -> bytes:
    """The fixed header and the JSON header of a blob, exactly as `encode` writes them."""
    header_bytes = header_json(header, header.metadata)
    return _FIXED_HEADER.pack(MAGIC, FORMAT_VERSION, len(header_bytes)) + header_bytes


def blob_digest(header: CheckpointHeader) -> str:
    """Hex SHA-256 naming one stored blob: its trailing checksum, over both headers.

    The JSON header holds the payload's SHA-256, so this commits to the whole blob, and it
    is computed from the header alone. `encode(decode(blob))` is `blob` (the JSON is
    canonical), so a loaded checkpoint has the digest the saved one had.
    """
    return hashlib.sha256(_headers(header)).hexdigest()


def decode(blob: bytes) -> Checkpoint:
    """Verify and parse a blob written by `encode`.

    Raises:
        CheckpointCorruptError: on any mismatch (length, magic, version, checksums, fields).
    """
    view = memoryview(blob)
    minimum = _FIXED_HEADER.size + _CHECKSUM_BYTES
    if len(view) < minimum:
        raise CheckpointCorruptError(
            f"blob is {len(view)} bytes, shorter than the {minimum}-byte minimum "
            f"(fixed header + checksum): truncated"
        )
    magic, version, header_length = _FIXED_HEADER.unpack_from(view)
    if magic != MAGIC:
        raise CheckpointCorruptError(f"bad magic {magic!r}, expected {MAGIC!r}: not a checkpoint")
    if version != FORMAT_VERSION:
        raise CheckpointCorruptError(
            f"format version {version} is not supported (this build reads {FORMAT_VERSION})"
        )
    headers_end = _FIXED_HEADER.size + header_length
    if header_length > MAX_HEADER_BYTES or headers_end + _CHECKSUM_BYTES > len(view):
        raise CheckpointCorruptError(
            f"header length {header_length} does not fit in the {len(view)}-byte blob: "
            f"truncated or corrupt"
        )
    stored = bytes(view[-_CHECKSUM_BYTES:])
    computed = hashlib.sha256(view[:headers_end]).digest()
    if stored != computed:
        raise CheckpointCorruptError(
            f"header checksum mismatch (stored {stored.hex()[:16]}..., computed "
            f"{computed.hex()[:16]}...) in a {len(view)}-byte blob: truncated or corrupt"
        )
    try:
        header = json.loads(bytes(view[_FIXED_HEADER.size : headers_end]))
        payload_length = header["payload_length"]
        payload_sha256 = header["payload_sha256"]
        fields = (header["job_id"], header["step"], header["membership_epoch"], header["metadata"])
    except (ValueError, KeyError, TypeError) as exc:
        raise CheckpointCorruptError(f"unreadable JSON header: {exc!r}") from exc
    payload = view[headers_end:-_CHECKSUM_BYTES]
    if len(payload) != payload_length:
        raise CheckpointCorruptError(
            f"payload is {len(payload)} bytes, the header says {payload_length}: truncated"
        )
    actual_sha256 = hashlib.sha256(payload).hexdigest()
    if actual_sha256 != payload_sha256:
        raise CheckpointCorruptError(
            f"payload SHA-256 mismatch (header {str(payload_sha256)[:16]}..., computed "
            f"{actual_sha256[:16]}...): the payload is corrupt"
        )
    job_id, step, membership_epoch, metadata = fields
    try:
        checkpoint = Checkpoint(job_id, step, membership_epoch, bytes(payload), metadata)
    except (ValueError, TypeError, AttributeError) as exc:
        raise CheckpointCorruptError(f"invalid header fields: {exc}") from exc
    # Just verified: the MAC check and the blob digest need not hash the payload again.
    checkpoint.__dict__["payload_sha256"] = actual_sha256
    return checkpoint


@dataclass(frozen=True)
class Skipped:
    """A candidate the loader passed over: its step, and why (missing, corrupt, foreign)."""

    step: int
    reason: str


@dataclass(frozen=True)
class StoreReading:
    """What a store holds for one job, as far as resuming it goes (`_StoreLifecycle._read_newest`).

    Falling back past a missing or damaged blob is right for an accident (a disk that lost a
    write) and wrong for an attack (someone who can write the store deletes or damages the
    newest blob to make the job resume from an older one); the two look the same from inside
    the store. So a reading also says what was skipped and why, and which verified blobs lie
    beyond the pointer (their MAC-covered headers can prove that the pointer was moved back),
    and the checkpointer decides with its token and its own high-water mark
    (`gradsync_server.store.high_water`) whether the result may be used.

    Attributes:
        job_id: the job read.
        pointer: the step the `latest` pointer names (None: no readable pointer).
        checkpoint: what `load_latest` returns: the pointed checkpoint, else the newest
            older one that verifies; None when the job has no stored blob at all.
        skipped: candidates tried before `checkpoint` and refused, newest first; empty when
            the first candidate (the pointed one, or the newest stored) verified.
        beyond_pointer: headers of the blobs newer than the pointer that verify (checksum
            and job id; the MAC is the checkpointer's to check), newest first.
    """

    job_id: str
    pointer: int | None
    checkpoint: Checkpoint | None
    skipped: tuple[Skipped, ...] = ()
    beyond_pointer: tuple[CheckpointHeader, ...] = ()


def _verified(job_id: str, step: int, blob: bytes | None) -> Checkpoint | str:
    """The checkpoint in `blob` if it is `job_id`'s at `step`, else why not."""
    if blob is None:
        return "its blob is missing"
    try:
        checkpoint = decode(blob)
    except CheckpointCorruptError as exc:
        return f"it is corrupt: {exc}"
    if (checkpoint.job_id, checkpoint.step) != (job_id, step):
        return f"its blob holds job {checkpoint.job_id!r} step {checkpoint.step}"
    return checkpoint


class _StoreLifecycle:
    """Closed-state bookkeeping, `load_latest`, reading and error wording, shared by both
    backends."""

    description: str
    _closed: bool = False

    def read(self, job_id: str) -> StoreReading:
        raise NotImplementedError  # each backend reads its own way

    def load_latest(self, job_id: str) -> Checkpoint | None:
        """See `CheckpointStore.load_latest`."""
        return self.read(job_id).checkpoint

    def _check_open(self) -> None:
        if self._closed:
            raise CheckpointError(f"{self.description}: the checkpoint store is closed")

    def _failed(
        self, action: str, job_id: str, step: int | None, exc: Exception
    ) -> CheckpointError:
        """The error of a failed `action`, naming the store, the job, the step and the cause."""
        at_step = "" if step is None else f" step {step}"
        return CheckpointError(
            f"{self.description}: {action} job {job_id!r}{at_step} failed: "
            f"{type(exc).__name__}: {exc}"
        )

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def close(self) -> None:
        self._closed = True

    def _read_newest(
        self,
        job_id: str,
        pointer_text: str | None,
        stored: list[int],
        read_blob: Callable[[int], bytes | None],
    ) -> StoreReading:
        """The pointed checkpoint, else the newest older one that verifies (both backends).

        Raises:
            CheckpointError: checkpoints exist but none verifies.
        """
        description = self.description
        pointer = None
        if pointer_text is not None and re.fullmatch(r"\d{1,20}", pointer_text.strip()):
            pointer = int(pointer_text)
        elif pointer_text is not None:
            log.warning(
                "%s: the latest pointer of job %r holds %r, not a step number; ignoring it",
                description,
                job_id,
                pointer_text[:40],
            )
        if pointer is None:
            if not stored:
                return StoreReading(job_id, None, None)
            log.warning(
                "%s: job %r has checkpoints for steps %s but no readable latest pointer (a save "
                "crashed before its first pointer flip?); trying the newest that verifies",
                description,
                job_id,
                stored,
            )
            candidates = sorted(stored, reverse=True)
            unacknowledged: list[int] = []
        else:
            unacknowledged = sorted((step for step in stored if step > pointer), reverse=True)
            if unacknowledged:
                log.warning(
                    "%s: job %r: ignoring steps %s, newer than the latest pointer (step %d): their "
                    "saves never completed",
                    description,
                    job_id,
                    sorted(unacknowledged),
                    pointer,
                )
            candidates = [
                pointer,
                *sorted((step for step in stored if step < pointer), reverse=True),
            ]
        beyond: list[CheckpointHeader] = []
        for step in unacknowledged:
            leftover = _verified(job_id, step, read_blob(step))
            if isinstance(leftover, Checkpoint):
                beyond.append(leftover.header)  # the payload is dropped here
        skipped: list[Skipped] = []
        for step in candidates:
            found = _verified(job_id, step, read_blob(step))
            if isinstance(found, Checkpoint):
                return StoreReading(job_id, pointer, found, tuple(skipped), tuple(beyond))
            skipped.append(Skipped(step, found))
            log.warning(
                "%s: skipping the checkpoint of job %r at step %d because %s; falling back to an "
                "older one",
                description,
                job_id,
                step,
                found,
            )
        raise CheckpointError(
            f"{description}: loading job {job_id!r} failed: no checkpoint verifies (tried steps "
            f"{candidates}, see the warnings above); refusing to start the job from scratch: "
            f"delete its checkpoints to do that deliberately"
        )


def _check_job_id(job_id: str) -> None:
    if not isinstance(job_id, str) or not job_id:
        raise ValueError(f"job id must be a non-empty string, got {job_id!r}")
    try:
        job_id.encode()
    except UnicodeEncodeError as exc:
        raise ValueError(f"job id {job_id!r} is not valid Unicode text: {exc}") from exc


def _check_keep(keep: int) -> int:
    if keep < 1:
        raise ValueError(f"keep must be at least 1 checkpoint per job, got {keep}")
    return keep


def _text(value: Any) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def _parse_steps(members: Iterable[Any]) -> list[int]:
    texts = (_text(member) for member in members)
    return sorted(int(text) for text in texts if text.isdigit())


def _doomed_steps(
    stored: Iterable[int], saved_step: int, keep: int, guard: PruneGuard | None = None
) -> list[int]:
    """Steps to delete once `saved_step` is acknowledged: all but the `keep` newest up to it,
    and any newer ones (a save that never completed, or a timeline abandoned by a restore from
    an older checkpoint); `load_latest` never returns those once the pointer is older.

    With a `guard`, only steps it allows are deleted: never one newer than the checkpoint the
    job resumed from unless the job saved it itself (see `PruneGuard`)."""
    stored = sorted(stored)
    kept_or_older = [step for step in stored if step <= saved_step]
    doomed = kept_or_older[:-keep] + [step for step in stored if step > saved_step]
    if guard is None:
        return doomed
    return [step for step in doomed if guard.may_delete(step)]
