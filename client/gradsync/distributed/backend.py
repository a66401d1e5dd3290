"""The c10d backend "gradsync": registration and the factory c10d calls for every group.

`register()` (run by `import gradsync.distributed`, idempotent) tells c10d
about the backend, for CPU and CUDA tensors, with the extended factory API,
and registers the `gradsync://` rendezvous. c10d then calls `create_group`
once per group it makes: the default group of `init_process_group`, every
`new_group`, every DeviceMesh dimension. Each group joins a job of its own on
the coordinator (`group_job_id`: the user's job id plus a suffix from the
group's name and ranks, so the ranks of a group agree without talking) as a
collectives-only session, and blocks until the group's ranks have all joined,
as gloo's rendezvous does.

Where the coordinator is: `GradsyncOptions.coordinator` (passed as
`init_process_group(..., pg_options=GradsyncOptions(...))`), else the
`gradsync://` rendezvous's address, else $GRADSYNC_COORDINATOR. TLS and the
token: the options', else the wrapper's environment variables. Same-host
ranks form a host group per host (`gradsync.distributed.host_group`).
"""

from __future__ import annotations

import atexit
import hashlib
import logging
import os
import threading
import weakref
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from gradsync_proto.net.channels import ChannelSecurity
from torch.distributed.rendezvous import register_rendezvous_handler

from gradsync import defaults
from gradsync.config import ENV_COORDINATOR, ENV_JOB_ID
from gradsync.distributed.group_session import GroupSession
from gradsync.distributed.host_group import form_host_group, resolve_hierarchical
from gradsync.distributed.op_trace import OpTrace, resolve_trace_path
from gradsync.distributed.process_group import BACKEND_NAME, MAX_IN_FLIGHT, ProcessGroupGradsync
from gradsync.distributed.store import (
    SCHEME,
    coordinator_of_rendezvous,
    handler as rendezvous_handler,
)
from gradsync.distributed.wire import check_wire_dtype, on_wire, resolve_wire_dtype

log = logging.getLogger("gradsync.client")

#: The longest job id the coordinator accepts (`gradsync_server.control.admission`).
MAX_JOB_ID_CHARS = 128
#: Hex digits of the group digest in a subgroup's job id.
DIGEST_CHARS = 12


@dataclass(frozen=True)
class GradsyncOptions:
    """Backend options, given as `init_process_group("gradsync", pg_options=...)`.

    Attributes:
        coordinator: the coordinator's "host:port" (default: the rendezvous's, else
            $GRADSYNC_COORDINATOR).
        job_id: the job id the groups' ids start with (default $GRADSYNC_JOB_ID, else
            "default").
        security: TLS and token (default: `ChannelSecurity.resolve()`, the environment).
        wire_dtype: torch.bfloat16 or torch.float16 to send the float32 inputs of
            summing reductions (all-reduce SUM, AVG, PREMUL_SUM; reduce-scatter) in 16
            bits, half the bytes (`gradsync.distributed.wire`); torch.float32 for none
            (default: $GRADSYNC_WIRE_DTYPE, "bfloat16" or "float16", else none). Every
            rank of a group must use the same.
        hierarchical: whether the ranks of a group on one host sum its all-reduces
            in shared memory first, one of them uploading the host's sum
            (`gradsync.distributed.host_group`): "auto" (on when at least two ranks of
            the group share a host), "1"/True (on), "0"/False (off). Default:
            $GRADSYNC_HIERARCHICAL, else "auto". Every rank must use the same.
        trace_path: write a Chrome trace of the group's operations there, each one's
            phases per rank (`gradsync.distributed.op_trace`; "{rank}" in the path
            becomes the global rank). Default: $GRADSYNC_TRACE, else no trace.

    Raises:
        ValueError: another `wire_dtype` or `hierarchical`.
    """

    coordinator: str | None = None
    job_id: str | None = None
    security: ChannelSecurity | None = None
    wire_dtype: torch.dtype | None = None
    hierarchical: str | bool | None = None
    trace_path: str | os.PathLike[str] | None = None

    def __post_init__(self) -> None:
        check_wire_dtype(self.wire_dtype, "GradsyncOptions.wire_dtype")
        if self.hierarchical is not None:
            resolve_hierarchical(self.hierarchical)


def group_job_id(base: str, group_name: str, global_ranks: list[int]) -> str:
    """The coordinator job of a c10d group: `<base>.pg-world` for the default group,
    `<base>.pg-<digest of the group's name and ranks>` for any other.

    Raises:
        ValueError: the result would be longer than the coordinator accepts.
    """
    if not global_ranks:
        suffix = "world"
    else:
        key = f"{group_name}|{','.join(str(rank) for rank in global_ranks)}"
        suffix = hashlib.sha256(key.encode()).hexdigest()[:DIGEST_CHARS]
    job_id = f"{base}.pg-{suffix}"
    if len(job_id) > MAX_JOB_ID_CHARS:
        raise ValueError(
            f"job id {base!r} is too long for a process group's job ({len(job_id)} characters "
            f"with the group suffix; at most {MAX_JOB_ID_CHARS})"
        )
    return job_id


def resolve_coordinator(options: GradsyncOptions | None) -> str:
    """Where the groups' jobs run (see the module docstring).

    Raises:
        ValueError: no coordinator given anywhere.
    """
    address = (
        (options.coordinator if options is not None else None)
        or coordinator_of_rendezvous()
        or os.environ.get(ENV_COORDINATOR)
    )
    if not address:
        raise ValueError(
            "gradsync backend: no coordinator: use init_method='gradsync://host:port', "
            f"set {ENV_COORDINATOR}, or pass pg_options=GradsyncOptions(coordinator=...)"
        )
    return address


def create_group(backend_options: Any, pg_options: Any = None) -> ProcessGroupGradsync:
    """c10d's factory (extended API): one joined `ProcessGroupGradsync` for one group.

    Args:
        backend_options: c10d's `_DistributedBackendOptions` (store, group_rank,
            group_size, timeout, group_id, global_ranks_in_group).
        pg_options: a `GradsyncOptions`, or None.

    Raises:
        ValueError: no coordinator, or options of another backend.
        GradSyncError: joining the group's job failed.
    """
    if pg_options is not None and not isinstance(pg_options, GradsyncOptions):
        raise ValueError(
            "gradsync backend: pg_options must be a GradsyncOptions, "
            f"got {type(pg_options).__name__}"
        )
    options = pg_options or GradsyncOptions()
    address = resolve_coordinator(options)
    base = options.job_id or os.environ.get(ENV_JOB_ID) or defaults.JOB_ID
    group_name = str(backend_options.group_id)
    ranks = [int(rank) for rank in backend_options.global_ranks_in_group]
    job_id = group_job_id(base, group_name, ranks)
    security = options.security or ChannelSecurity.resolve()
    timeout_s = float(backend_options.timeout.total_seconds())
    wire_dtype = resolve_wire_dtype(options.wire_dtype)
    rank, size = int(backend_options.group_rank), int(backend_options.group_size)
    session = GroupSession(address, job_id, rank, size, security, timeout_s)
    setting = resolve_hierarchical(options.hierarchical)
    if wire_dtype is not None:  # (a group on a 16-bit wire stays flat)
        setting = "off"
    store, resuming = backend_options.store, session.resuming
    try:
        host = form_host_group(
            store, rank, size, job_id, setting, resuming, MAX_IN_FLIGHT, timeout_s
        )
    except BaseException:
        session.close()
        raise
    trace = None
    template = resolve_trace_path(options.trace_path)
    if template is not None:
        global_rank = ranks[session.rank] if ranks else session.rank
        trace = OpTrace(template, global_rank, job_id)
        if session.shard_routes is None:  # (the shards' streams number their ranges apart)
            session.observe(trace.numbered, trace.on_link_event)
    group = ProcessGroupGradsync(session, group_name, wire_dtype, host, trace)
    _live.add(group)
    log.info(
        "rank %d: process group '%s' (size %d) runs as job '%s' at %s%s",
        session.rank,
        group_name,
        session.world_size,
        job_id,
        address,
        on_wire(wire_dtype),
    )
    return group


#: Groups not yet shut down: left at interpreter exit, so the coordinator hears a goodbye.
_live: weakref.WeakSet[ProcessGroupGradsync] = weakref.WeakSet()
_registered = threading.Lock()
_done = False


def _leave_all() -> None:
    for group in list(_live):
        try:
            group.shutdown()
        except Exception:  # leaving is best effort at exit; the coordinator's liveness covers it
            log.debug("leaving %r at exit failed", group, exc_info=True)


def register() -> None:
    """Register the backend "gradsync" and the gradsync:// rendezvous with c10d. Idempotent."""
    global _done
    with _registered:
        if _done:
            return
        if BACKEND_NAME.upper() not in dist.Backend._plugins:
            dist.Backend.register_backend(
                BACKEND_NAME, create_group, extended_api=True, devices=["cpu", "cuda"]
            )
        try:
            register_rendezvous_handler(SCHEME, rendezvous_handler)  # type: ignore[no-untyped-call]  # torch's is untyped
        except RuntimeError:  # "already registered": by an earlier copy of this module
            log.debug("the gradsync:// rendezvous was registered already")
        atexit.register(_leave_all)
        _done = True
