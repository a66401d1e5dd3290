"""Admitting a worker's Join at the coordinator: the checks before any job is touched.

A stream's first message must be a Join of bounded size. A Join names a job
id and carries free text (incarnation, client version, host id) that the
coordinator logs and relays to other ranks, so the servicer checks its size
and text here, along with the coordinator's own limits (world size,
--max-jobs, shutting down), before it finds or creates the job; and it creates a new job
from the coordinator's configuration with `new_job`. Kept apart from the
servicer so that these rules are pure and read in one place; the servicer
stays the glue between the stream and the job. Pure logic, no gRPC, no
asyncio.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from gradsync_proto.codes import Code
from gradsync_proto.v1 import gradsync_pb2 as pb

from gradsync_server.config import CoordinatorConfig
from gradsync_server.control.job import Job
from gradsync_server.control.signature import is_collectives_only
from gradsync_server.dataplane.budget import ByteBudget
from gradsync_server.dataplane.host_groups import host_id_problem
from gradsync_server.dataplane.observer import StepObserver
from gradsync_server.text import quoted

MAX_JOB_ID_CHARS = 128
#: Longest Join.incarnation and Join.client_version accepted (they are logged and relayed).
MAX_INCARNATION_CHARS = 128
MAX_VERSION_CHARS = 64
#: Largest Join accepted (a signature of ~10^5 tensors with long names fits).
MAX_JOIN_BYTES = 4 << 20
SHUTTING_DOWN = "the coordinator is shutting down"


def _short_printable(text: str, limit: int) -> bool:
    """True for free text safe to log and relay as is: printable and at most `limit` long."""
    return len(text) <= limit and text.isprintable()


def too_many_jobs(running: int, max_jobs: int) -> tuple[Code, str]:
    """The refusal of a Join that would start a job beyond --max-jobs."""
    return (
        Code.RESOURCE_EXHAUSTED,
        f"the coordinator already runs {running} jobs (limit {max_jobs})",
    )


def first_message_problem(kind: str | None, size: int) -> tuple[Code, str] | None:
    """Why a stream's first message (of oneof `kind`, `size` bytes) cannot open it, or None."""
    if kind != "join":
        got = kind or "an empty message"
        return (
            Code.FAILED_PRECONDITION,
            f"the first message on a stream must be a Join, got {got}",
        )
    if size > MAX_JOIN_BYTES:
        return (
            Code.RESOURCE_EXHAUSTED,
            f"a Join of {size} bytes is larger than the {MAX_JOIN_BYTES} accepted",
        )
    return None


def join_problem(
    join: pb.Join, config: CoordinatorConfig, draining: bool, known_job: bool, running_jobs: int
) -> tuple[Code, str] | None:
    """Why the coordinator refuses `join` before looking at its job, or None.

    Args:
        config: the coordinator's configuration (world size, --max-jobs).
        draining: the coordinator is shutting down.
        known_job: a job with the Join's id exists already (it needs no new slot).
        running_jobs: how many jobs the coordinator holds now.
    """
    job_id = join.job_id
    if draining:
        return (Code.UNAVAILABLE, SHUTTING_DOWN)
    if not job_id or len(job_id) > MAX_JOB_ID_CHARS or not job_id.isprintable():
        return (
            Code.INVALID_ARGUMENT,
            f"job id {job_id!r} must be 1..{MAX_JOB_ID_CHARS} printable characters",
        )
    if not _short_printable(join.incarnation, MAX_INCARNATION_CHARS) or not (
        _short_printable(join.client_version, MAX_VERSION_CHARS)
    ):
        return (
            Code.INVALID_ARGUMENT,
            f"Join.incarnation {quoted(join.incarnation, 40)} ({len(join.incarnation)} "
            f"characters) and Join.client_version {quoted(join.client_version, 40)} "
            f"({len(join.client_version)}) must be printable, with at most "
            f"{MAX_INCARNATION_CHARS} and {MAX_VERSION_CHARS} characters",
        )
    host_problem = host_id_problem(join.rank, join.host_id)
    if host_problem is not None:
        return (Code.INVALID_ARGUMENT, host_problem)
    world_size = job_world_size(join, config)
    if join.rank >= world_size:
        return (
            Code.INVALID_ARGUMENT,
            f"rank {join.rank} is out of range for world size {world_size} "
            f"(valid ranks 0..{world_size - 1})",
        )
    if not known_job and running_jobs >= config.max_jobs:
        return too_many_jobs(running_jobs, config.max_jobs)
    return None


def job_world_size(join: pb.Join, config: CoordinatorConfig) -> int:
    """The world size of the job `join` starts or joins: the coordinator's --world-size, or
    for a collectives-only session (a torch.distributed group, `gradsync.distributed`) the
    Join's own, from 1 up to --world-size: a subgroup or a mesh dimension has fewer ranks."""
    if is_collectives_only(join.signature) and 1 <= join.world_size <= config.world_size:
        return int(join.world_size)
    return config.world_size


def new_job(
    job_id: str,
    config: CoordinatorConfig,
    budget: ByteBudget,
    clock: Callable[[], float],
    metrics: StepObserver,
    shard_map: Callable[[], list[pb.ShardAddress] | None],
    payload_endpoint: tuple[str, str] | None = None,
    world_size: int | None = None,
) -> Job:
    """A new job named `job_id`, configured as the coordinator's flags say.

    `world_size`: the job's own (`job_world_size`), when not the coordinator's.

    `payload_endpoint`: (socket name, coordinator host id) of the same-host
    payload path, None when it is off (see `gradsync_server.rpc.segments`).
    """
    settings = config.job_settings()
    if world_size is not None and world_size != settings.world_size:
        settings = dataclasses.replace(
            settings, world_size=world_size, min_workers=min(settings.min_workers, world_size)
        )
    return Job(job_id, settings, budget, clock, metrics, shard_map, payload_endpoint)
