"""The worker's checks of what the coordinator announces (Welcome) before trusting it.

A worker sizes buffers, timers and its shard connections from the Welcome, so
a wrong or hostile one must fail fast with an error naming the field and its
value, not allocate 2 GiB (`state_bytes`), spin (`heartbeat_interval_s` of 0
or NaN) or dial a garbage address. The worker knows its own model:
`state_bytes` must equal the size of its parameters and buffers, and
`world_size` and `job_id` what it joined with. Pure logic.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from gradsync_proto import dtypes
from gradsync_proto.net.address import parse_address
from gradsync_proto.v1 import gradsync_pb2 as pb

#: Smallest and largest chunk a worker believes. The coordinator's own config allows
#: 4 KiB..64 MiB; the worker refuses only what it cannot work with (0 means the default).
MIN_CHUNK_BYTES = 1
MAX_CHUNK_BYTES = 64 << 20
#: Room beyond one chunk that a message limit may add (the coordinator adds 64 KiB).
MAX_MESSAGE_SLACK_BYTES = 16 << 20
#: Longest heartbeat interval believed (the coordinator's defaults are 0.5 s of 5 s).
MAX_HEARTBEAT_INTERVAL_S = 600.0
#: Counters (steps, epochs, collective numbers) beyond this are not believed.
MAX_COUNTER = 1 << 53
#: Longest session secret believed (the coordinator issues 32 bytes).
MAX_SESSION_BYTES = 256
#: Most shards believed.
MAX_SHARDS = 1024
#: A resume blob (module + optimizer state, pickled) may be this many times the model's
#: state size, plus `RESUME_SLACK_BYTES`; beyond that it is not a checkpoint of this model.
RESUME_STATE_FACTOR = 8
RESUME_SLACK_BYTES = 256 << 20


def state_bytes(signature: pb.ModelSignature) -> int:
    """Bytes of rank 0's state broadcast for this signature: every parameter, then buffers."""
    total = 0
    for spec in (*signature.parameters, *signature.buffers):
        elements = 1
        for dim in spec.shape:
            elements *= dim
        total += elements * dtypes.itemsize(spec.dtype)
    return total


@dataclass(frozen=True)
class Expected:
    """What this worker knows the Welcome must say (from its own Join)."""

    job_id: str
    world_size: int
    state_bytes: int

    @classmethod
    def of(cls, join: pb.Join) -> Expected:
        return cls(join.job_id, join.world_size, state_bytes(join.signature))

    @property
    def max_resume_bytes(self) -> int:
        """The largest resume blob believed for this model."""
        return RESUME_STATE_FACTOR * self.state_bytes + RESUME_SLACK_BYTES


def welcome_problem(welcome: pb.Welcome, expected: Expected) -> str | None:
    """The first field of `welcome` that cannot be right, as "Welcome.FIELD = VALUE: why"."""

    def bad(name: str, value: object, why: str) -> str:
        return f"Welcome.{name} = {value!r}: {why}"

    if welcome.job_id and welcome.job_id != expected.job_id:
        return bad("job_id", welcome.job_id, f"this worker joined job {expected.job_id!r}")
    if welcome.world_size != expected.world_size:
        return bad(
            "world_size", welcome.world_size, f"this worker joined with {expected.world_size}"
        )
    chunk = welcome.chunk_bytes
    if chunk and not MIN_CHUNK_BYTES <= chunk <= MAX_CHUNK_BYTES:
        return bad("chunk_bytes", chunk, f"must be in {MIN_CHUNK_BYTES}..{MAX_CHUNK_BYTES}")
    limit = welcome.max_message_bytes
    if limit and not (chunk or MIN_CHUNK_BYTES) <= limit <= (chunk or MAX_CHUNK_BYTES) + (
        MAX_MESSAGE_SLACK_BYTES
    ):
        return bad("max_message_bytes", limit, f"must hold one chunk ({chunk}) plus headers")
    interval = welcome.heartbeat_interval_s
    if not math.isfinite(interval) or not 0 <= interval <= MAX_HEARTBEAT_INTERVAL_S:
        return bad(
            "heartbeat_interval_s", interval, f"must be finite, in 0..{MAX_HEARTBEAT_INTERVAL_S:g}"
        )
    for name in ("start_step", "membership_epoch", "next_collective", "checkpoint_every_steps"):
        value = getattr(welcome, name)
        if value > MAX_COUNTER:
            return bad(name, value, f"must be at most {MAX_COUNTER}")
    if welcome.state_bytes and welcome.state_bytes != expected.state_bytes:
        return bad(
            "state_bytes",
            welcome.state_bytes,
            f"this worker's parameters and buffers hold {expected.state_bytes} bytes",
        )
    if welcome.resume_bytes > expected.max_resume_bytes:
        return bad(
            "resume_bytes",
            welcome.resume_bytes,
            f"a checkpoint of this model ({expected.state_bytes} bytes of state) is at most "
            f"{expected.max_resume_bytes} bytes",
        )
    session = getattr(welcome, "session", b"")
    if len(session) > MAX_SESSION_BYTES:
        return bad("session", f"<{len(session)} bytes>", f"at most {MAX_SESSION_BYTES} bytes")
    if len(welcome.shards) > MAX_SHARDS:
        return bad("shards", f"<{len(welcome.shards)} entries>", f"at most {MAX_SHARDS}")
    for shard in welcome.shards:
        if shard.index >= max(len(welcome.shards), 1):
            return bad("shards.index", shard.index, f"{len(welcome.shards)} shards are listed")
        address = shard.address
        if not address:
            continue
        try:
            parse_address(f"localhost{address}" if address.startswith(":") else address)
        except ValueError as exc:
            return bad("shards.address", address[:200], f"not a host:port ({exc})")
    return None
