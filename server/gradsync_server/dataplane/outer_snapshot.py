"""The durable form of a plane's DiLoCo outer state: encode, decode, verify (pure).

A coordinator that restarts must resume the outer optimizer where it stood:
the global parameters alone are not enough (every rank holds those), the
Nesterov momentum lives only at the coordinator. So after every committed
step the plane's `OuterState` (`gradsync_server.dataplane.outer`) is written
to the checkpoint store as one record per plane (leader and each shard, each
for its byte range), and read back when the job assembles again.

A record is verified before it is trusted: a magic, a length-prefixed JSON
header (job, layout signature, step, rounds, the element count of each
bucket range), the float32 arrays, and a SHA-256 of everything before it.
The layout signature hashes what makes the arrays meaningful (the outer
optimizer, the outer buckets' sizes and dtypes, the shard count and index):
a job restarted with another model, optimizer or shard count gets no state
that does not fit it, and reseeds instead. No I/O here.
"""

from __future__ import annotations

import hashlib
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
    "record_name",
]

Floats = npt.NDArray[np.float32]

_MAGIC = b"GSOUTER1"
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
    """

    job_id: str
    signature: str
    step: int
    rounds: int
    parameters: dict[int, Floats]
    momenta: dict[int, Floats]

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


def encode_snapshot(snapshot: OuterSnapshot) -> list[bytes]:
    """The record's bytes, as parts to write in order (the last one is the SHA-256)."""
    indices = sorted(snapshot.parameters)
    header = json.dumps(
        {
            "job_id": snapshot.job_id,
            "signature": snapshot.signature,
            "step": snapshot.step,
            "rounds": snapshot.rounds,
            "buckets": [[index, len(snapshot.parameters[index])] for index in indices],
        },
        sort_keys=True,
    ).encode()
    parts = [_MAGIC, _LENGTH.pack(len(header)), header]
    for index in indices:
        parts.append(snapshot.parameters[index].astype("<f4", copy=False).tobytes())
        parts.append(snapshot.momenta[index].astype("<f4", copy=False).tobytes())
    digest = hashlib.sha256()
    for part in parts:
        digest.update(part)
    return [*parts, digest.digest()]


def decode_snapshot(blob: bytes, job_id: str) -> OuterSnapshot:
    """Verify and decode a record of `job_id`.

    Raises:
        OuterSnapshotError: not a record, torn or altered (digest), another job's,
            or its header and arrays disagree; the message names the job and why.
    """
    where = f"the stored outer state of job '{job_id}'"
    if len(blob) < len(_MAGIC) + _LENGTH.size + _DIGEST_BYTES or not blob.startswith(_MAGIC):
        raise OuterSnapshotError(f"{where} is not an outer-state record ({len(blob)} bytes)")
    body, digest = blob[:-_DIGEST_BYTES], blob[-_DIGEST_BYTES:]
    if hashlib.sha256(body).digest() != digest:
        raise OuterSnapshotError(f"{where} fails its SHA-256 check ({len(blob)} bytes): torn?")
    (header_bytes,) = _LENGTH.unpack_from(body, len(_MAGIC))
    start = len(_MAGIC) + _LENGTH.size
    if header_bytes > min(_MAX_HEADER_BYTES, len(body) - start):
        raise OuterSnapshotError(f"{where} declares a {header_bytes}-byte header")
    try:
        header = json.loads(body[start : start + header_bytes])
        stored_job, signature = str(header["job_id"]), str(header["signature"])
        step, rounds = int(header["step"]), int(header["rounds"])
        buckets = [(int(index), int(count)) for index, count in header["buckets"]]
    except (ValueError, KeyError, TypeError) as exc:
        raise OuterSnapshotError(f"{where} has an unreadable header: {exc}") from exc
    if stored_job != job_id:
        raise OuterSnapshotError(f"{where} belongs to job '{stored_job}'")
    expected = start + header_bytes + sum(8 * count for _, count in buckets)
    if step < 0 or rounds < 0 or any(count < 0 for _, count in buckets) or expected != len(body):
        raise OuterSnapshotError(
            f"{where} holds {len(body)} bytes, its header (step {step}, rounds {rounds}, "
            f"buckets {buckets}) says {expected}"
        )
    parameters: dict[int, Floats] = {}
    momenta: dict[int, Floats] = {}
    offset = start + header_bytes
    for index, count in buckets:
        for target in (parameters, momenta):
            target[index] = np.frombuffer(body, "<f4", count, offset).astype(np.float32)
            offset += 4 * count
    return OuterSnapshot(stored_job, signature, step, rounds, parameters, momenta)
