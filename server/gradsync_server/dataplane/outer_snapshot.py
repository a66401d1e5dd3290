"""The durable form of a plane's DiLoCo outer state: encode, decode, verify (pure).

A coordinator that restarts must resume the outer optimizer where it stood:
the global parameters alone are not enough (every rank holds those), the
Nesterov momentum lives only at the coordinator. So after every committed
step the plane's `OuterState` (`gradsync_server.dataplane.outer`) is written
to the checkpoint store as one record per plane (leader and each shard, each
for its byte range), and read back when the job assembles again.

A record is verified before it is trusted: a magic, a length-prefixed JSON
header (job, layout signature, step, rounds, the run it belongs to, whether
it is sealed, the element count of each bucket range), the float32 arrays, a
SHA-256 of everything before it (a torn write), and, when the coordinator has
a token, an HMAC-SHA256 of everything before that under the outer-state key
(`gradsync_server.rpc.outer_records.outer_state_key`): a record written or
altered by someone without the key fails it, however its SHA-256 was
recomputed. The MAC covers the header too, so the job, the step, the rounds
and the run cannot be moved to another record. The layout signature hashes
what makes the arrays meaningful (the outer optimizer, the outer buckets'
sizes and dtypes, the shard count and index): a job restarted with another
model, optimizer or shard count gets no state that does not fit it. No I/O
here.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
from gradsync_proto.v1 import gradsync_pb2 as pb

__all__ = [
    "OuterSnapshot",
    "OuterSnapshotError",
    "decode_snapshot",
    "encode_snapshot",
    "layout_signature",
    "record_digest",
    "record_name",
]

Floats = npt.NDArray[np.float32]

_MAGIC = b"GSOUTER2"
_LENGTH = struct.Struct("<I")
_DIGEST_BYTES = 32
#: A header is a few hundred bytes; anything far larger is not ours.
_MAX_HEADER_BYTES = 1 << 20


class OuterSnapshotError(ValueError):
    """A stored record is not a verifiable outer state of this job (named in the message)."""


@dataclass(frozen=True)
class OuterSnapshot:
    """One plane's outer state after a committed step.

    Attributes:
        job_id: the job it belongs to.
        signature: `layout_signature` of the plane that wrote it.
        step: the step whose answer `parameters` are (the last committed one).
        rounds: outer steps applied so far (the seed not counted).
        parameters: the plane's range of each outer bucket's global parameters.
        momenta: the outer momentum, same shapes.
        run: the id of the run of the job that wrote it (new when the outer state is
            seeded, inherited when it is restored): a record of another run (from before
            a `--fresh-start`) is told apart from this run's.
        sealed: decoded only: the record carried a MAC that verified.
        digest: decoded only: the hex SHA-256 of the whole record (what a high-water
            mark names).
    """

    job_id: str
    signature: str
    step: int
    rounds: int
    parameters: dict[int, Floats]
    momenta: dict[int, Floats]
    run: str = ""
    sealed: bool = False
    digest: str = ""

    def nbytes(self) -> int:
        """Bytes of arrays it carries (what a save writes, and what a restore holds)."""
        arrays = [*self.parameters.values(), *self.momenta.values()]
        return sum(array.nbytes for array in arrays)


def record_name(shard_index: int) -> str:
    """The store's name for plane `shard_index`'s record of a job (no ':' or '/')."""
    return f"outer-state-shard{shard_index}"


def layout_signature(
    outer: pb.OuterOptimizer | None,
    buckets: Sequence[pb.BucketSpec],
    shard_count: int,
    shard_index: int,
) -> str:
    """What a record must match to be restored into a plane (a hex SHA-256).

    The optimizer's settings, every bucket's size, dtype and outer flag, and the
    plane's place among the shards: a record written under any other layout
    would put numbers in the wrong places.
    """
    digest = hashlib.sha256()
    outer_bytes = b"" if outer is None else outer.SerializeToString(deterministic=True)
    digest.update(_LENGTH.pack(len(outer_bytes)) + outer_bytes)
    for bucket in buckets:
        digest.update(struct.pack("<QI?", bucket.num_elements, bucket.dtype, bucket.outer))
    digest.update(struct.pack("<II", shard_count, shard_index))
    return digest.hexdigest()


def encode_snapshot(snapshot: OuterSnapshot, key: bytes | None = None) -> list[bytes]:
    """The record's bytes, as parts to write in order: the body, its SHA-256 and, given
    `key`, the HMAC-SHA256 of both under it (the header says which)."""
    indices = sorted(snapshot.parameters)
    header = json.dumps(
        {
            "job_id": snapshot.job_id,
            "signature": snapshot.signature,
            "step": snapshot.step,
            "rounds": snapshot.rounds,
            "run": snapshot.run,
            "sealed": key is not None,
            "buckets": [[index, len(snapshot.parameters[index])] for index in indices],
        },
        sort_keys=True,
    ).encode()
    parts = [_MAGIC, _LENGTH.pack(len(header)), header]
    for index in indices:
        parts.append(snapshot.parameters[index].astype("<f4", copy=False).tobytes())
        parts.append(snapshot.momenta[index].astype("<f4", copy=False).tobytes())
    parts.append(_sha256(parts))
    if key is not None:
        mac = hmac.new(key, b"", hashlib.sha256)
        for part in parts:
            mac.update(part)
        parts.append(mac.digest())
    return parts


def record_digest(parts: Sequence[bytes]) -> str:
    """The hex SHA-256 of a whole record given as parts (what a high-water mark names)."""
    return _sha256(parts).hex()


def _sha256(parts: Sequence[bytes]) -> bytes:
    digest = hashlib.sha256()
    for part in parts:
        digest.update(part)
    return digest.digest()


def decode_snapshot(blob: bytes, job_id: str, key: bytes | None = None) -> OuterSnapshot:
    """Verify and decode a record of `job_id`.

    Args:
        blob: the stored record.
        job_id: the job it must belong to.
        key: the outer-state key (None: no token, nothing can be authenticated; a
            sealed record is then read without checking its MAC).

    Raises:
        OuterSnapshotError: not a record, torn or altered (digest), another job's,
            its header and arrays disagree, or (with `key`) it carries no MAC or one
            that does not verify; the message names the job and why.
    """
    where = f"the stored outer state of job '{job_id}'"
    if len(blob) < len(_MAGIC) + _LENGTH.size + _DIGEST_BYTES or not blob.startswith(_MAGIC):
        raise OuterSnapshotError(f"{where} is not an outer-state record ({len(blob)} bytes)")
    (header_bytes,) = _LENGTH.unpack_from(blob, len(_MAGIC))
    start = len(_MAGIC) + _LENGTH.size
    if header_bytes > min(_MAX_HEADER_BYTES, len(blob) - start - _DIGEST_BYTES):
        raise OuterSnapshotError(
            f"{where} declares a {header_bytes}-byte header in {len(blob)} bytes: torn?"
        )
    try:
        header = json.loads(blob[start : start + header_bytes])
        stored_job, signature = str(header["job_id"]), str(header["signature"])
        step, rounds = int(header["step"]), int(header["rounds"])
        run, sealed = str(header["run"]), header["sealed"] is True
        buckets = [(int(index), int(count)) for index, count in header["buckets"]]
    except (ValueError, KeyError, TypeError) as exc:
        raise OuterSnapshotError(f"{where} has an unreadable header: {exc}") from exc
    trailer = _DIGEST_BYTES * (2 if sealed else 1)
    body, digest = blob[: len(blob) - trailer], blob[len(blob) - trailer :][:_DIGEST_BYTES]
    if len(blob) < start + header_bytes + trailer:
        raise OuterSnapshotError(f"{where} is cut short ({len(blob)} bytes): torn?")
    if hashlib.sha256(body).digest() != digest:
        raise OuterSnapshotError(f"{where} fails its SHA-256 check ({len(blob)} bytes): torn?")
    if key is not None:
        if not sealed:
            raise OuterSnapshotError(
                f"{where} carries no MAC, but this coordinator has a token: it was written "
                "without one, or by someone who cannot sign"
            )
        expected = hmac.new(key, blob[:-_DIGEST_BYTES], hashlib.sha256).digest()
        if not hmac.compare_digest(expected, blob[-_DIGEST_BYTES:]):
            raise OuterSnapshotError(
                f"{where} (step {step}, round {rounds}) fails its MAC under this "
                "coordinator's outer-state key: written under another token or shard token, "
                "or altered or planted since"
            )
    if stored_job != job_id:
        raise OuterSnapshotError(f"{where} belongs to job '{stored_job}'")
    expected_bytes = start + header_bytes + sum(8 * count for _, count in buckets)
    if (
        step < 0
        or rounds < 0
        or any(count < 0 for _, count in buckets)
        or expected_bytes != len(body)
    ):
        raise OuterSnapshotError(
            f"{where} holds {len(body)} bytes, its header (step {step}, rounds {rounds}, "
            f"buckets {buckets}) says {expected_bytes}"
        )
    parameters: dict[int, Floats] = {}
    momenta: dict[int, Floats] = {}
    offset = start + header_bytes
    for index, count in buckets:
        for target in (parameters, momenta):
            target[index] = np.frombuffer(body, "<f4", count, offset).astype(np.float32)
            offset += 4 * count
    whole = hashlib.sha256(blob).hexdigest()
    return OuterSnapshot(
        stored_job,
        signature,
        step,
        rounds,
        parameters,
        momenta,
        run,
        sealed and key is not None,
        whole,
    )
