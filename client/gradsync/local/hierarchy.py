"""Hierarchical aggregation: a rank's link when its host's ranks sum locally first.

When the coordinator groups several ranks of one host (same `Join.host_id`;
`Welcome.local_ranks` lists the group, the lowest rank leads), the session
wraps its link in a `HierarchicalLink`. Everything but the gradient path is
delegated to the real link (every rank keeps its own Sync stream for
heartbeats, collectives, checkpoints and faults); `submit_bucket` and
`wait_step` go through the host's `gradsync.local.local_group.LocalGroup`
instead: every member posts its buckets into shared memory, the group sums
them (in local-rank order), and only the leader uploads each sum, with
`covered_ranks` naming the ranks it holds, and receives the averages, which
every member then copies out. The coordinator sums the units (flat ranks and
local groups) in ascending leader rank, and divides by the ranks covered.

A leader on the coordinator's own host (its Welcome names a payload socket)
hands the segment to the coordinator (`gradsync.local.payload_segment`) and
uploads each sum header-only: the coordinator reads it from the result
region and writes the averages back there, so no payload crosses TCP.

Hierarchy v1 sums float32/float64 buckets with no comm hook and no
`wire_dtype` (`check_hierarchical` decides before joining).
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Mapping, Sequence

import numpy as np
import numpy.typing as npt
import torch
from gradsync_proto import defaults
from gradsync_proto.payload_socket import Registration
from gradsync_proto.v1 import gradsync_pb2 as pb

from gradsync.control.link import BucketEventHandler, CoordinatorLink
from gradsync.errors import GradSyncError, SyncTimeoutError
from gradsync.local.local_group import LocalGroup
from gradsync.local.payload_segment import register_segment
from gradsync.path.buffers import BucketBuffer

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


class HierarchicalLink:
    """A `CoordinatorLink` whose gradients go through the host's local group.

    Args:
        link: the rank's own link to the coordinator (the leader's uploads the sums).
        group: the formed local group (closed with this link).
        bucket_bytes: every bucket's size (the presence bucket last).
        welcome: the Welcome that formed the group (heartbeat interval).
    """

    def __init__(
        self,
        link: CoordinatorLink,
        group: LocalGroup,
        bucket_bytes: Sequence[int],
        welcome: pb.Welcome,
    ) -> None:
        self.link = link
        self.group = group
        self._num_buckets = len(bucket_bytes)
        self._heartbeat_s = welcome.heartbeat_interval_s or defaults.HEARTBEAT_INTERVAL_S
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

    # ------------------------------------------------------------ the gradient path
    def configure_buckets(self, bucket_bytes: list[int]) -> None:
        """The layout is fixed when the group forms; the real link keeps counting buckets."""
        self.link.configure_buckets(bucket_bytes)

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
        self.link.send_local_posted(step, bucket_index)

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
                averaged.append(self.link.wait_step(step, wait_s))

        try:
            if not group.is_leader:
                contributors = group.wait_averaged(step, timeout_s, poll, self._dropped)
                self._averaged_events(step)
                return contributors
            started = time.monotonic()
            group.wait_reduced(step, self._num_buckets, timeout_s, poll, self._dropped)
            contributors = (
                averaged[0]
                if averaged
                else self.link.wait_step(step, max(0.001, timeout_s - (time.monotonic() - started)))
            )
            group.publish_averaged(step, contributors)
            return contributors
        except GradSyncError:
            group.forget(step)
            raise

    def _dropped(self, rank: int) -> bool:
        live = self.link.live_ranks()
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
        self.link.submit_bucket(
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

    def _averaged_events(self, step: int) -> None:
        for bucket_index in range(self._num_buckets):
            self._event("averaged", step, bucket_index)

    def _event(self, event: str, step: int, bucket_index: int) -> None:
        handler = self.link.on_bucket_event
        if handler is not None:
            try:
                handler(event, step, bucket_index)
            except Exception:  # instrumentation must never break the data path
                log.exception("bucket event handler failed")

    # ------------------------------------------------------------ delegated
    @property
    def current_step(self) -> int:
        """The step heartbeats report (the real link's)."""
        return self.link.current_step

    @current_step.setter
    def current_step(self, value: int) -> None:
        self.link.current_step = value

    @property
    def on_bucket_event(self) -> BucketEventHandler | None:
        """The real link's observer (the group reports through it too)."""
        return self.link.on_bucket_event

    @on_bucket_event.setter
    def on_bucket_event(self, handler: BucketEventHandler | None) -> None:
        self.link.on_bucket_event = handler

    @property
    def collective_sequence(self) -> int:
        """The real link's next collective number."""
        return self.link.collective_sequence

    def open(self, join: pb.Join) -> None:
        """Delegated."""
        self.link.open(join)

    def wait_welcome(self, timeout_s: float) -> pb.Welcome:
        """Delegated."""
        return self.link.wait_welcome(timeout_s)

    def send_state(self, blob: npt.NDArray[np.uint8]) -> None:
        """Delegated."""
        self.link.send_state(blob)

    def receive_state(self, num_bytes: int, timeout_s: float) -> bytearray:
        """Delegated."""
        return self.link.receive_state(num_bytes, timeout_s)

    def receive_resume(self, num_bytes: int, timeout_s: float) -> bytes:
        """Delegated."""
        return self.link.receive_resume(num_bytes, timeout_s)

    def send_checkpoint(self, step: int, blob: bytes) -> None:
        """Delegated."""
        self.link.send_checkpoint(step, blob)

    def wait_checkpoint(self, step: int, timeout_s: float) -> pb.CheckpointSaved:
        """Delegated."""
        return self.link.wait_checkpoint(step, timeout_s)

    def take_heal_request(self) -> bool:
        """Delegated."""
        return self.link.take_heal_request()

    def step_report(self) -> pb.StepReport | None:
        """Delegated."""
        return self.link.step_report()

    def live_ranks(self) -> tuple[int, ...] | None:
        """Delegated."""
        return self.link.live_ranks()

    def send_heal(self, step: int, blob: bytes) -> None:
        """Delegated."""
        self.link.send_heal(step, blob)

    def abandon_step(self, step: int, reason: str) -> None:
        """Delegated (the coordinator aborts the step for every rank); forget it locally."""
        self.group.forget(step)
        self.link.abandon_step(step, reason)

    def run_collective(
        self,
        op: int,
        dtype: int,
        payload: npt.NDArray[np.uint8],
        root: int,
        timeout_s: float,
        *,
        result_bytes: int | None = None,
    ) -> tuple[bytearray, int]:
        """Delegated: collectives stay flat (every rank on its own stream)."""
        return self.link.run_collective(
            op, dtype, payload, root, timeout_s, result_bytes=result_bytes
        )

    def set_collective_sequence(self, sequence: int) -> None:
        """Delegated."""
        self.link.set_collective_sequence(sequence)

    def send_out_of_inputs(self, step: int) -> None:
        """Delegated."""
        self.link.send_out_of_inputs(step)

    def send_local_posted(self, step: int, bucket_index: int) -> None:
        """Delegated (submit_bucket sends it itself)."""
        self.link.send_local_posted(step, bucket_index)

    def wait_join_progress(self, timeout_s: float) -> pb.JoinProgress:
        """Delegated."""
        return self.link.wait_join_progress(timeout_s)

    def close(self, timeout_s: float = 10.0) -> None:
        """Close the local group, then the real link. Idempotent."""
        try:
            self.group.close()
        finally:
            self.link.close(timeout_s)
