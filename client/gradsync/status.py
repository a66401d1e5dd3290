"""`gradsync status`: ask a coordinator who is in which job, where, and who is late.

Also how recently ended jobs ended (the coordinator keeps their outcome for a
while), so "did my job finish?" has an answer after the workers are gone, and,
for a sharded coordinator, a table of its shards (liveness, bytes, lag), so a
dead or slow shard is spotted from the one address users know.
`--json` prints the reply with protobuf's JSON names, but every integer as a
JSON number: protobuf's JSON mapping writes 64-bit integers as strings
("openStep": "12"), which makes `jq '.jobs[0].openStep > 10'` compare a
string, so `status_dict` converts them back.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import grpc
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.json_format import MessageToDict
from gradsync_proto.net.channels import ChannelSecurity, handshake_failure, looks_like_tls
from gradsync_proto.v1 import gradsync_pb2 as pb

from gradsync import defaults

STATUS_METHOD = "/gradsync.v1.Coordinator/Status"


def query_status(
    address: str,
    job_id: str = "",
    timeout_s: float = defaults.STATUS_TIMEOUT_S,
    security: ChannelSecurity | None = None,
) -> pb.StatusReply:
    """A coordinator's status of its jobs: what `gradsync status` shows.

    Args:
        address: the coordinator's "host:port".
        job_id: one job's status; "" = every job.
        timeout_s: the bound on the call.
        security: TLS and token (default: plaintext, no token); a token is needed
            like on every call.

    Returns:
        The coordinator's `StatusReply` (`gradsync.v1`).

    Raises:
        ConnectionError: the coordinator could not be reached in time, refused the
            token, or the TLS handshake failed (the message says which).
    """
    security = security or ChannelSecurity()
    with security.channel(address) as channel:
        call = channel.unary_unary(
            STATUS_METHOD,
            request_serializer=pb.StatusRequest.SerializeToString,
            response_deserializer=pb.StatusReply.FromString,
        )
        try:
            reply: pb.StatusReply = call(
                pb.StatusRequest(job_id=job_id), timeout=timeout_s, metadata=security.metadata
            )
        except grpc.RpcError as exc:
            raise ConnectionError(describe_call_error(address, timeout_s, exc, security)) from exc
    return reply


def describe_call_error(
    address: str, timeout_s: float, exc: grpc.RpcError, security: ChannelSecurity
) -> str:
    """Why a call to `address` failed, naming the token or TLS when they are the cause."""
    code = exc.code() if isinstance(exc, grpc.Call) else None
    details = (exc.details() if isinstance(exc, grpc.Call) else str(exc)) or ""
    name = code.name if code is not None else "error"
    if code == grpc.StatusCode.UNAUTHENTICATED:
        return f"{address} refused the call (UNAUTHENTICATED): {details}"
    if code == grpc.StatusCode.UNAVAILABLE:
        failure = handshake_failure(address, security, min(2.0, timeout_s))
        if failure is not None or (security.tls and looks_like_tls(details)):
            return f"no TLS connection to {address}: {failure or details}"
    return f"no status from {address} within {timeout_s:g}s: {name}: {details}"


#: Field types protobuf's JSON mapping writes as strings; they are integers.
_INT64_TYPES = frozenset(
    {
        FieldDescriptor.TYPE_INT64,
        FieldDescriptor.TYPE_UINT64,
        FieldDescriptor.TYPE_SINT64,
        FieldDescriptor.TYPE_FIXED64,
        FieldDescriptor.TYPE_SFIXED64,
    }
)


def status_dict(reply: pb.StatusReply) -> dict[str, Any]:
    """The reply as JSON-ready data: every field present, integers as numbers."""
    data: dict[str, Any] = MessageToDict(reply, always_print_fields_with_no_presence=True)
    _integers_as_numbers(data, reply.DESCRIPTOR)
    return data


def status_json(reply: pb.StatusReply) -> str:
    """What `gradsync status --json` prints."""
    return json.dumps(status_dict(reply), indent=2, sort_keys=True)


def _integers_as_numbers(data: dict[str, Any], descriptor: Descriptor) -> None:
    for field in descriptor.fields:
        if field.json_name not in data:
            continue
        value = data[field.json_name]
        repeated = isinstance(value, list)  # the JSON form tells; no descriptor API needed
        if field.message_type is not None:
            for item in value if repeated else [value]:
                _integers_as_numbers(item, field.message_type)
        elif field.type in _INT64_TYPES:
            data[field.json_name] = [int(v) for v in value] if repeated else int(value)


def format_status(reply: pb.StatusReply) -> str:
    """A readable report of a StatusReply: running jobs, then ended ones, then the shards."""
    lines = [] if reply.jobs else ["no jobs"]
    for job in reply.jobs:
        if not job.ended:
            lines.extend(_running_job(job))
    for job in reply.jobs:
        if job.ended:
            outcome = job.outcome or f"{job.state} after {job.steps_completed} steps"
            lines.append(
                f"job '{job.job_id}': ended {job.ended_s_ago:.0f}s ago ({job.state}): {outcome}"
            )
            if job.outer:
                lines.append(_diloco_line(job))
            lines += _nonfinite_lines(job)
    tail = (format_shards(reply.shards), _recovery_line(reply.recovery))
    return "\n".join([*lines, *(line for line in tail if line)])


def _recovery_line(recovery: pb.Recovery) -> str:
    """What failures cost on this coordinator; empty when it has seen none and holds no lease."""
    parts = []
    if recovery.fence:
        parts.append(f"active, lease fence {recovery.fence} ({recovery.takeovers} takeovers)")
    if recovery.ranks_lost:
        parts.append(
            f"{recovery.ranks_lost} ranks lost (latest detected {recovery.last_detect_s:.2f}s "
            f"after its last sign of life, training again {recovery.last_rank_recover_s:.2f}s "
            "later)"
        )
    restarts = recovery.restarts_continued + recovery.restarts_checkpoint
    if restarts:
        parts.append(
            f"{restarts} restarts ({recovery.restarts_continued} continued, "
            f"{recovery.restarts_checkpoint} from a checkpoint; {recovery.steps_recomputed} steps "
            f"recomputed; latest training again {recovery.last_restart_recover_s:.2f}s after "
            "this coordinator became active)"
        )
    return "recovery: " + "; ".join(parts) if parts else ""


def format_shards(shards: Sequence[pb.ShardStatus]) -> str:
    """The shard table of a sharded coordinator ("" when it is not sharded)."""
    if not shards:
        return ""
    alive = sum(1 for shard in shards if shard.alive)
    header = (
        "shard",
        "address",
        "state",
        "last heard",
        "received",
        "sent",
        "buckets",
        "mean bucket",
        "buffered",
        "streams",
        "version",
    )
    rows = [header]
    for shard in shards:
        rows.append(
            (
                str(shard.index),
                shard.address or ("(leader)" if shard.index == 0 else "?"),
                _shard_state(shard),
                f"{shard.last_seen_s:.1f}s ago" if shard.index and shard.version else "-",
                _mib(shard.bytes_received),
                _mib(shard.bytes_sent),
                str(shard.buckets_completed),
                f"{shard.mean_bucket_s * 1e3:.1f} ms",
                _mib(shard.buffered_bytes),
                str(shard.connections),
                shard.version or "-",
            )
        )
    widths = [max(len(row[column]) for row in rows) for column in range(len(header))]
    lines = [f"shards: {alive}/{len(shards)} up"]
    lines += [
        "  " + "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
        for row in rows
    ]
    return "\n".join(lines)


def _shard_state(shard: pb.ShardStatus) -> str:
    """up; silent (registered, not heard within the timeout); lost (was there); missing."""
    if shard.alive:
        return "up"
    if shard.version:
        return "silent"
    return "lost" if shard.address else "missing"


def _mib(nbytes: int) -> str:
    return f"{nbytes / (1 << 20):.1f} MiB"


def _diloco_line(job: pb.JobStatus) -> str:
    return (
        f"  DiLoCo: {job.outer_rounds} outer rounds applied, global parameters and "
        f"momentum held here: {_mib(job.outer_state_bytes)}"
    )


def _nonfinite_lines(job: pb.JobStatus) -> list[str]:
    if not job.nonfinite_contributions:
        return []
    return [
        f"  non-finite gradients (NaN/Inf): {job.nonfinite_contributions} contributions, "
        f"latest: {job.last_nonfinite}"
    ]


def _running_job(job: pb.JobStatus) -> list[str]:
    """Lines of a job that still runs (or assembles): members, laggards, who is missing."""
    checkpoint = (
        f"last checkpoint step {job.last_checkpoint_step}"
        if job.last_checkpoint_step >= 0
        else "no checkpoint"
    )
    lines = [
        f"job '{job.job_id}': {job.state}, {len(job.members)}/{job.world_size} workers, "
        f"epoch {job.membership_epoch}, step {job.open_step} "
        f"({job.steps_completed} completed), {checkpoint}"
    ]
    for member in job.members:
        lines.append(
            f"  rank {member.rank}: {member.peer or '?'}, last heard {member.last_seen_s:.1f}s "
            f"ago, at step {member.reported_step}, mean lag {member.mean_lag_s * 1e3:.1f} ms"
        )
    if job.outer:
        lines.append(_diloco_line(job))
    missing = sorted(set(range(job.world_size)) - {member.rank for member in job.members})
    if missing:
        lines.append(f"  waiting for ranks {missing} of {job.world_size}")
    lagging = sorted(job.members, key=lambda m: m.mean_lag_s, reverse=True)
    if lagging and lagging[0].mean_lag_s > 0:
        lines.append(
            "  slowest ranks (mean lag): "
            + ", ".join(f"rank {m.rank} {m.mean_lag_s * 1e3:.1f} ms" for m in lagging[:3])
        )
    if job.late:
        waiting = ", ".join(
            f"rank {late.rank} (buckets {list(late.bucket_indices)})" for late in job.late
        )
        lines.append(f"  step {job.open_step} is {job.step_age_s:.1f}s old, waiting for {waiting}")
    lines += _nonfinite_lines(job)
    if job.screened_contributions:
        lines.append(
            f"  screen ({job.screen}): {job.screened_contributions} contributions flagged, "
            f"latest: {job.last_screened}"
        )
    if job.outer_state:
        lines.append(f"  outer state: {job.outer_state}")
    if job.restart:
        lines.append(f"  restart: {job.restart} ({job.steps_recomputed} steps recomputed)")
    return lines
