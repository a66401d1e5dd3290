"""Hierarchical aggregation: a rank's gradient path when its host's ranks sum locally first.

When the coordinator groups several ranks of one host (same `Join.host_id`;
`Welcome.local_ranks` lists the group, the lowest rank leads), the session
routes the gradients through a `LocalGroupPath`, a `GradientPath` that wraps
the rank's own (direct or sharded) path; the session link is untouched
(every rank keeps its own Sync stream for heartbeats, collectives,
checkpoints and faults). `submit_bucket` and `wait_step` go through the
host's `gradsync.local.local_group.LocalGroup`: every member posts its
buckets into shared memory, the group sums them (in local-rank order), and
only the leader uploads each sum, with `covered_ranks` naming the ranks it
holds, and receives the averages, which every member then copies out. The
coordinator sums the units (flat ranks and local groups) in ascending leader
rank, and divides by the ranks covered.

A leader on the coordinator's own host (its Welcome names a payload socket)
hands the segment to the coordinator (`register_segment`, once, by descriptor,
with its session) and uploads each sum header-only: the coordinator reads it
from the result region and writes the averages back there, so no payload
crosses TCP, and nothing is copied into or out of gRPC messages (gRPC stays the
control channel). This is an optimization only: any failure to register is
logged once and the leader carries on over TCP. `$GRADSYNC_PAYLOAD_SOCKET=0`
turns it off (debugging).

Hierarchy v1 sums float32/float64 buckets with no comm hook and no
`wire_dtype` (`check_hierarchical` decides before joining).
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import time
from collections.abc import Mapping, Sequence
from typing import Protocol

import torch
from gradsync_proto.payload_socket import (
    EXCHANGE_TIMEOUT_S,
    MAX_REPLY_BYTES,
    Registration,
    address,
    enabled,
    encode_request,
    reply_problem,
)
from gradsync_proto.v1 import gradsync_pb2 as pb

from gradsync.errors import GradSyncError, SyncTimeoutError
from gradsync.local.local_group import LocalGroup
from gradsync.path.buffers import BucketBuffer
from gradsync.path.gradient_path import BucketEventHandler, GradientPath
from gradsync.path.step_results import RoundReport

log = logging.getLogger("gradsync.client")

#: Bucket dtypes a local group sums in v1.
HIERARCHICAL_DTYPES = (torch.float32, torch.float64)


#: Environment variable giving `hierarchical` when the argument is not passed:
#: "auto", "1"/"true" or "0"/"false" (switch a job's layout without editing code).
ENV_HIERARCHICAL = "GRADSYNC_HIERARCHICAL"
_ENV_VALUES: dict[str, bool | str] = {
    "auto": "auto",
    "1": True,
    "true": True,
    "0": False,
    "false": False,
}


def requested_hierarchical(
    argument: bool | str | None, environ: Mapping[str, str] | None = None
) -> bool | str:
    """`DistributedDataParallel(hierarchical=)`, or $GRADSYNC_HIERARCHICAL when it is None.

    Raises:
        ValueError: the variable holds something else than the values above.
    """
    if argument is not None:
        return argument
    raw = (os.environ if environ is None else environ).get(ENV_HIERARCHICAL, "auto")
    value = _ENV_VALUES.get(raw.strip().lower())
    if value is None:
        raise ValueError(f"${ENV_HIERARCHICAL}={raw!r}: expected one of {', '.join(_ENV_VALUES)}")
    return value


def check_hierarchical(
    requested: bool | str, bucket_dtypes: Sequence[torch.dtype], wire_dtype: torch.dtype | None
) -> bool:
    """Whether to ask for hierarchical aggregation (send a host id in Join).

    Args:
        requested: "auto", True or False (`requested_hierarchical`).
        bucket_dtypes: every gradient bucket's dtype.
        wire_dtype: the 16-bit wire dtype asked for, if any.

    Raises:
        ValueError: `requested` is True and the model or the options do not allow it,
            or `requested` is not one of the three values.
    """
    if requested not in ("auto", True, False):
        raise ValueError(f"hierarchical must be 'auto', True or False, got {requested!r}")
    if requested is False:
        return False
    reasons = []
    others = sorted({str(d) for d in bucket_dtypes if d not in HIERARCHICAL_DTYPES})
    if others:
        reasons.append(f"buckets of {', '.join(others)} (only float32/float64 are summed locally)")
    if wire_dtype is not None:
        reasons.append(f"wire_dtype={wire_dtype} (local sums are full precision)")
    if not reasons:
        return True
    why = "; ".join(reasons)
    if requested is True:
        raise ValueError(f"hierarchical=True is not possible with {why}; pass hierarchical=False")
    log.info("hierarchical aggregation is off: %s", why)
    return False


def register_segment(
    socket_name: str,
    registration: Registration,
    fd: int,
    *,
    timeout_s: float = EXCHANGE_TIMEOUT_S,
    environ: Mapping[str, str] | None = None,
) -> bool:
    """Hand the segment `fd` to the coordinator's payload socket; True if it took it.

    Never raises: a refusal or an error is logged (once, here) and False
    returned, so that the caller goes on over TCP.
    """
    if not socket_name or not enabled(os.environ if environ is None else environ):
        return False
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(timeout_s)
            sock.connect(address(socket_name))
            socket.send_fds(sock, [encode_request(registration)], [fd])
            sock.shutdown(socket.SHUT_WR)
            reply = sock.recv(MAX_REPLY_BYTES)
    except OSError as exc:
        log.warning(
            "rank %d: could not hand the local group's segment to the coordinator (%s); "
            "gradient payloads go over TCP",
            registration.rank,
            exc,
        )
        return False
    problem = reply_problem(reply)
    if problem is not None:
        log.warning(
            "rank %d: the coordinator refused the local group's segment (%s); gradient "
            "payloads go over TCP",
            registration.rank,
            problem,
        )
        return False
    log.info(
        "rank %d: gradient payloads move through shared memory with the coordinator",
        registration.rank,
    )
    return True


class GroupLink(Protocol):
    """What a local group needs of its rank's session link (`gradsync.control.link`)."""

    def send_local_posted(self, step: int, bucket_index: int) -> None:
        """Tell the coordinator this rank posted a bucket into its local group."""

    def live_ranks(self) -> tuple[int, ...] | None:
        """The job's live ranks as the coordinator last announced them, or None."""
        ...


class LocalGroupPath:
    """A `GradientPath` through the host's local group, around the rank's own path.

    Args:
        upstream: the rank's own gradient path (the leader uploads the sums on it;
            every rank watches it for an abort or a lost coordinator while it waits).
        link: the rank's session link (reports posted buckets, names dropped ranks).
        group: the formed local group (closed by `close`).
        bucket_bytes: every bucket's size (the presence bucket last).
        welcome: the Welcome that formed the group (its payload socket, if any).
        on_bucket_event: the observer of bucket events (metrics, trace), or None.
    """

    #: Every member copies the averages out inside `wait_step`, once the whole step is
    #: averaged: until then its buffers hold its upload, so a resend needs no copy of it.
    averages_land_early = False

    def __init__(
        self,
        upstream: GradientPath,
        link: GroupLink,
        group: LocalGroup,
        bucket_bytes: Sequence[int],
        welcome: pb.Welcome,
        on_bucket_event: BucketEventHandler | None = None,
    ) -> None:
        self._upstream = upstream
        self._link = link
        self.group = group
        self._num_buckets = len(bucket_bytes)
        self._on_bucket_event = on_bucket_event
        #: The coordinator holds the segment: uploads and averages stay in shared memory.
        self.in_segment = False
        if group.is_leader:
            fd = group.segment.fd
            if welcome.payload_socket and fd is not None:
                self.in_segment = register_segment(
                    welcome.payload_socket,
                    Registration(welcome.job_id, group.rank, welcome.session),
                    fd,
                )
            group.on_event = self._event
            group.set_reduced_handler(self._upload)

    def submit_bucket(
        self,
        step: int,
        bucket_index: int,
        buffer: BucketBuffer,
        dtype: int,
        *,
        result: BucketBuffer | None = None,
        result_dtype: int = 0,
        covered_ranks: tuple[int, ...] = (),
        nonfinite_ranks: tuple[int, ...] = (),
        segment_offset: int | None = None,
    ) -> None:
        """Post the bucket into this rank's slot; the group sums it, the leader uploads it.

        Raises:
            ValueError: averages asked in another dtype (a comm hook: hierarchy v1 has none).
        """
        if result is not None or covered_ranks or nonfinite_ranks or segment_offset is not None:
            raise ValueError(
                "a local group uploads full-precision buckets only (no comm hook); "
                "pass hierarchical=False"
            )
        self.group.post(step, bucket_index, buffer, dtype)
        self._link.send_local_posted(step, bucket_index)

    def round_report(self) -> RoundReport:
        """Nothing beyond `wait_step`'s contributors: a local group runs no partial rounds."""
        return RoundReport()

    def wait_step(self, step: int, timeout_s: float) -> int:
        """Wait for the averages of `step` and copy them into this rank's buffers.

        The leader waits for its group's sums, then for the coordinator, then
        tells its followers; a follower waits for its leader. Both keep an eye
        on their own Sync stream (an abort or a lost coordinator is raised).
        """
        group = self.group
        # A poll that finds the averages complete has taken them from the inbox
        # (wait_step consumes a step): keep its answer, never wait for them twice.
        averaged: list[int] = []

        def poll(wait_s: float) -> None:
            if averaged:
                return
            with contextlib.suppress(SyncTimeoutError):
                averaged.append(self._upstream.wait_step(step, wait_s))

        try:
            if not group.is_leader:
                contributors = group.wait_averaged(step, timeout_s, poll, self._dropped)
                for bucket_index in range(self._num_buckets):
                    self._event("averaged", step, bucket_index)
                return contributors
            started = time.monotonic()
            group.wait_reduced(step, self._num_buckets, timeout_s, poll, self._dropped)
            contributors = (
                averaged[0]
                if averaged
                else self._upstream.wait_step(
                    step, max(0.001, timeout_s - (time.monotonic() - started))
                )
            )
            group.publish_averaged(step, contributors)
            return contributors
        except GradSyncError:
            group.forget(step)
            raise

    def _dropped(self, rank: int) -> bool:
        live = self._link.live_ranks()
        return live is not None and rank not in live

    def _upload(
        self,
        step: int,
        bucket_index: int,
        dtype: int,
        covered: tuple[int, ...],
        nonfinite: tuple[int, ...],
    ) -> None:
        """Leader, I/O thread: hand a bucket's local sum to the coordinator.

        `nonfinite` names the covered ranks whose own gradient held NaN/Inf (the
        local sum found them), so that the coordinator names them, not this leader.
        """
        result = BucketBuffer([self.group.segment.result(bucket_index)])
        log.debug(
            "rank %d: step %d bucket %d summed locally over ranks %s; uploading %d bytes",
            self.group.rank,
            step,
            bucket_index,
            list(covered),
            result.size,
        )
        self._event("host_upload", step, bucket_index)
        self._upstream.submit_bucket(
            step,
            bucket_index,
            result,
            dtype,
            covered_ranks=covered,
            nonfinite_ranks=nonfinite,
            segment_offset=(
                self.group.segment.result_offset(bucket_index) if self.in_segment else None
            ),
        )

    def _event(self, event: str, step: int, bucket_index: int) -> None:
        handler = self._on_bucket_event
        if handler is not None:
            try:
                handler(event, step, bucket_index)
            except Exception:  # instrumentation must never break the data path
                log.exception("bucket event handler failed")

    def abandon_step(self, step: int, reason: str) -> None:
        """Forget `step` locally; the coordinator aborts it for every rank (upstream)."""
        self.group.forget(step)
        self._upstream.abandon_step(step, reason)

    def close(self) -> None:
        """Close the local group (the session closes its link after). Idempotent."""
        self.group.close()
