"""The gradient path's seam: where a rank's buckets go and its averages come from.

`GradientPath` (submit a bucket, wait for a step, give a step up) is what
the reducer and the step path use. It has three compositions: *direct* and
*sharded*, both `gradsync.control.transport.Transport` (a sharded
coordinator's Welcome makes it cut every bucket per shard, invisibly to the
wrapper), and *local group* (`gradsync.local.hierarchy.LocalGroupPath`),
which sums a host's ranks in shared memory and wraps another path for its
leader's uploads. The contract every implementation keeps is
`gradsync.control.link`'s.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from gradsync.path.buffers import BucketBuffer
from gradsync.path.step_results import RoundReport

__all__ = ["BucketEventHandler", "GradientPath"]

#: Called as (event, step, bucket_index) for "upload_start", "upload_end" and
#: "averaged"; with hierarchical aggregation also "local_reduce_start",
#: "local_reduce_end" (a local leader's sum of a bucket) and "host_upload" (a
#: local leader hands a bucket's sum to the coordinator: bytes this host sends).
#: Must be quick and must not raise (it runs on an I/O thread).
BucketEventHandler = Callable[[str, int, int], None]


class GradientPath(Protocol):
    """Where a rank's gradient buckets go and its averages come from."""

    #: Whether a bucket's averages may land in its `buffer` before `wait_step` returns
    #: (as each bucket completes). Only then must a rank that may upload the step again
    #: (`Reducer.resend`) keep what it uploaded (`BucketBuffer.record_sent`, which such a
    #: path must honour as the transport's chunk encoder does): a path that writes every
    #: average inside `wait_step` leaves the uploads intact until the step is over.
    averages_land_early: bool

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
        """Queue a bucket for upload; its averages are written back into `buffer`.

        Args:
            buffer: the bytes to upload, `dtype` elements.
            result: where the averages go instead of `buffer`, when they come
                back in another dtype (`result_dtype`, asked of the coordinator
                in every chunk's `reply_dtype`); None = into `buffer`.
            result_dtype: the `DType` of `result`'s elements; 0 = `dtype`.
            covered_ranks: a local leader's partial sum: the ranks it holds,
                ascending, the leader first (every chunk says so; the
                coordinator weighs it by their number); () = this rank's own.
            nonfinite_ranks: those of `covered_ranks` whose own gradient of this
                bucket held NaN/Inf (the local sum found them): the coordinator names
                them under its --nonfinite policy instead of the leader.
            segment_offset: a local leader whose segment the coordinator holds
                (same-host payload path): `buffer` lies in that segment at this
                byte offset, so chunks travel header-only (`in_segment`) and the
                averages are written there by the coordinator; None = over TCP.
        """

    def wait_step(self, step: int, timeout_s: float) -> int:
        """Block (bounded) until every averaged bucket of `step` is in place.

        Returns:
            The number of ranks averaged over.

        Raises:
            StepAbortedError (or a subclass): the coordinator abandoned the step.
            SyncTimeoutError: the results did not arrive within `timeout_s`.
            CoordinatorUnavailableError / other GradSyncError: the stream failed.
        """
        ...

    def abandon_step(self, step: int, reason: str) -> None:
        """Tell the coordinator this rank gives up on `step`. Never blocks."""

    def round_report(self) -> RoundReport:
        """What the answers of the step `wait_step` returned last said (DiLoCo's rounds)."""
        ...
