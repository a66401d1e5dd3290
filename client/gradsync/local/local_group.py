"""The ranks of one host summing their gradients in shared memory (hierarchical aggregation).

A `LocalGroup` is formed after the Welcome (`gradsync.local.local_rendezvous`:
abstract Unix socket, secret, one anonymous segment passed by fd, laid out
by `gradsync.local.local_segment`). Per bucket per step:

1. every member copies its bucket into its slot (one `np.copyto` per
   segment) and sends POSTED(step, bucket) to the leader;
2. when every live member posted, the leader sends REDUCE to all; member j
   sums share j of the bucket's elements over the slots, in local-rank order,
   into the result region and answers REDUCED;
3. when every share is summed the leader hands the result region to its
   callback (the coordinator upload, `gradsync.local.hierarchy`), whose averages
   land in the result region;
4. the leader sends AVERAGED(step, contributors); every member copies the
   result region into its own buffers and answers COPIED. The leader sends
   no REDUCE of a later step before every COPIED: the result region is
   shared.

Each member runs one I/O thread that blocks in `select`/`recv` (the GIL
released) and does the summing, so reductions overlap the backward pass:
that side, the messages and the sums, is `gradsync.local.local_io`. This
module is the training thread's side: forming the group, posting a bucket,
and the bounded waits that end a step (and their fault handling).

Faults: a peer's EOF is recorded. A wait that needs that peer then polls the
coordinator's verdict on this rank's own Sync stream for 3 heartbeat
intervals + 5 s (the caller's `poll` raises it: it names the lost rank), and
otherwise raises a `GradSyncError` naming the local peer. When the caller's
`excused` says the coordinator dropped a follower (elastic), lost locally or
only frozen (SIGSTOP: its socket stays open and silent), the leader stops
waiting for it at once: it excludes it from every bucket it had not posted
and sums its shares itself. Posted buckets keep it: its gradient is in its
slot, and counts. The excluded member is sent EXCLUDED and its connection is
shut; a frozen one that wakes reads EXCLUDED in the same batch as any REDUCE
still queued, and sums nothing more into the shared result region.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import time
from collections.abc import Callable, Sequence

import numpy as np

from gradsync.errors import GradSyncError, SyncTimeoutError
from gradsync.local.local_io import LocalGroupIO, ReducedHandler
from gradsync.local.local_rendezvous import Kind, follow, frame, lead
from gradsync.local.local_segment import LOCAL_DTYPES, Segment, SegmentLayout, shm_dir
from gradsync.path.buffers import BucketBuffer

log = logging.getLogger("gradsync.client")

#: How often a wait looks at the coordinator's side while nothing happens locally.
POLL_S = 0.05
#: Added to 3 heartbeat intervals: how long a lost peer's verdict is waited for.
VERDICT_MARGIN_S = 5.0

#: A wait's look at the coordinator: blocks up to the given seconds, raises its verdict.
Poll = Callable[[float], None]
#: Whether the coordinator dropped a (lost) global rank from the job.
Excused = Callable[[int], bool]


class LocalGroup(LocalGroupIO):
    """This rank's membership in its host's local group (see the module docstring).

    Use `form`. `post` is called by autograd hooks (never blocks on a peer);
    `wait_reduced` (leader) and `wait_averaged` (follower) are the bounded waits.
    The I/O thread's side (messages, sums) is inherited from `LocalGroupIO`.
    """

    def __init__(
        self,
        rank: int,
        ranks: Sequence[int],
        layout: SegmentLayout,
        segment: Segment,
        peers: dict[int, socket.socket],
        on_reduced: ReducedHandler | None,
        heartbeat_interval_s: float,
    ) -> None:
        self.verdict_s = 3 * heartbeat_interval_s + VERDICT_MARGIN_S
        super().__init__(rank, ranks, layout, segment, peers, on_reduced)

    @classmethod
    def form(
        cls,
        *,
        job_id: str,
        rank: int,
        ranks: Sequence[int],
        secret: bytes,
        bucket_bytes: Sequence[int],
        timeout_s: float,
        heartbeat_interval_s: float,
        on_reduced: ReducedHandler | None = None,
        directory: str | None = None,
    ) -> LocalGroup:
        """Meet the other ranks of `ranks` (ascending; the first leads); bounded by `timeout_s`.

        Raises:
            SharedMemoryError: the segment does not fit in `directory` (every member raises it).
            SyncTimeoutError: a member did not turn up in time.
            GradSyncError: refused (wrong secret), or the leader went away.
        """
        ranks = list(ranks)
        layout = SegmentLayout(tuple(bucket_bytes), len(ranks))
        deadline = time.monotonic() + timeout_s
        if rank == ranks[0]:
            formed = lead(job_id, ranks, secret, layout, deadline, directory or shm_dir())
        else:
            formed = follow(job_id, rank, ranks, secret, deadline)
            if formed.segment_bytes != layout.total_bytes:
                formed.peers[0].close()
                raise GradSyncError(
                    f"local leader rank {ranks[0]} made a {formed.segment_bytes}-byte segment; "
                    f"this rank's buckets need {layout.total_bytes}",
                    rank=rank,
                )
        segment = Segment(formed.segment_fd, layout)
        return cls(rank, ranks, layout, segment, formed.peers, on_reduced, heartbeat_interval_s)

    def set_reduced_handler(self, on_reduced: ReducedHandler) -> None:
        """Leader: what to do with each summed bucket (set before the first post)."""
        self._on_reduced = on_reduced

    # ------------------------------------------------------------ training thread
    def post(self, step: int, bucket_index: int, buffer: BucketBuffer, dtype: int) -> None:
        """Copy a bucket into this rank's slot and tell the leader. Never blocks on a peer.

        Raises:
            ValueError: a dtype the local group cannot sum, or a bucket of the wrong size.
        """
        if dtype not in LOCAL_DTYPES:
            raise ValueError(f"a local group sums float32/float64 buckets, not dtype {dtype}")
        slot = self.segment.slot(self.slot, bucket_index)
        if buffer.size != slot.size:
            raise ValueError(
                f"bucket {bucket_index} has {buffer.size} bytes, the local group {slot.size}"
            )
        position = 0
        for piece in buffer.segments:
            np.copyto(slot[position : position + piece.size], piece)
            position += piece.size
        with self._cond:
            self._buffers.setdefault(step, {})[bucket_index] = buffer
        self._send_leader(frame(Kind.POSTED, bucket_index, step, dtype))

    def wait_reduced(
        self, step: int, num_buckets: int, timeout_s: float, poll: Poll, excused: Excused
    ) -> None:
        """Leader: block until every bucket of `step` was summed and handed off."""
        self._wait(
            lambda: self._schedule.handed(step) >= num_buckets,
            timeout_s,
            f"the local sums of step {step}",
            poll,
            excused,
            detail=lambda: self._unposted(step, num_buckets),
        )

    def _unposted(self, step: int, num_buckets: int) -> str:
        """Leader: which bucket of `step` waits for which local ranks (for a timeout)."""
        with self._cond:
            missing = [
                f"bucket {bucket} not posted by ranks {[self.ranks[s] for s in slots]}"
                for bucket, slots in self._schedule.unposted(step, num_buckets)
            ]
        return "; ".join(missing[:4]) + ("; ..." if len(missing) > 4 else "")

    def publish_averaged(self, step: int, contributors: int) -> None:
        """Leader: the averages of `step` are in the result region: tell everyone, copy out."""
        with self._cond:
            live = [s for s in self._peers if s not in self._lost and s not in self._excluded]
            self._schedule.published(step, live)
        for slot in live:
            self._send(slot, frame(Kind.AVERAGED, 0, step, contributors))
        self._copy_out(step)

    def wait_averaged(self, step: int, timeout_s: float, poll: Poll, excused: Excused) -> int:
        """Follower: block until the leader says the averages of `step` are in; copy them out.

        Returns:
            The number of ranks averaged over.
        """
        self._wait(
            lambda: step in self._averaged,
            timeout_s,
            f"the averages of step {step} from local leader rank {self.ranks[0]}",
            poll,
            excused,
        )
        with self._cond:
            contributors = self._averaged.pop(step)
            for old in [s for s in self._averaged if s < step]:
                del self._averaged[old]
        self._copy_out(step)
        self._send_leader(frame(Kind.COPIED, 0, step))
        return contributors

    def forget(self, step: int) -> None:
        """Drop what this rank kept of `step` (it was aborted or abandoned)."""
        with self._cond:
            for old in [s for s in self._buffers if s <= step]:
                del self._buffers[old]

    def close(self, timeout_s: float = 2.0) -> None:
        """Say goodbye, stop the I/O thread, unmap the segment. Idempotent."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
        for slot in list(self._peers):
            self._send(slot, frame(Kind.BYE))
            with contextlib.suppress(OSError):
                self._peers[slot].shutdown(socket.SHUT_RDWR)
        if self._wake_tx is not None:
            with contextlib.suppress(OSError):
                self._wake_tx.send(frame(Kind.BYE))
        self._thread.join(timeout_s)
        for conn in [*self._peers.values(), self._wake_rx, self._wake_tx]:
            if conn is not None:
                conn.close()
        self.segment.close()

    # ------------------------------------------------------------ waiting
    def _wait(
        self,
        ready: Callable[[], bool],
        timeout_s: float,
        what: str,
        poll: Poll,
        excused: Excused,
        detail: Callable[[], str] | None = None,
    ) -> None:
        """Wait for `ready`, polling the coordinator; a lost peer gets its bounded verdict wait."""
        deadline = time.monotonic() + timeout_s
        verdict_by: float | None = None
        while True:
            with self._cond:
                if self._fatal is not None:
                    raise self._fatal
                if ready():
                    return
                blocking = self._blocking_loss()
                if blocking is None:
                    verdict_by = None
                    self._cond.wait(POLL_S)
            now = time.monotonic()
            if self.is_leader:
                # The coordinator's verdict outranks the local socket: a frozen member
                # (SIGSTOP, a hung host) keeps its connection open, sends nothing, and
                # would otherwise be waited for until `timeout_s`.
                self._exclude_dropped(excused)
            if blocking is None:
                poll(0.0)
            else:
                slot, why = blocking
                if verdict_by is None:
                    verdict_by = now + self.verdict_s
                poll(POLL_S)  # the coordinator's word on it (PeerLostError names the rank)
                if self.is_leader and excused(self.ranks[slot]):
                    self._exclude(slot)
                    verdict_by = None
                elif time.monotonic() >= verdict_by:
                    waiting = f" ({detail()})" if detail is not None else ""
                    raise GradSyncError(
                        f"lost local {'follower' if self.is_leader else 'leader'} rank "
                        f"{self.ranks[slot]} ({why}) while waiting for {what}{waiting}; the "
                        f"coordinator said nothing about it within {self.verdict_s:g}s",
                        rank=self.rank,
                    )
            if now >= deadline:
                why = f" ({detail()})" if detail is not None else ""
                raise SyncTimeoutError(
                    f"timed out after {timeout_s:g}s waiting for {what}{why}", rank=self.rank
                )

    def _exclude_dropped(self, excused: Excused) -> None:
        """Leader: exclude every member the coordinator dropped, lost locally or not."""
        with self._cond:
            candidates = [s for s in range(1, len(self.ranks)) if s not in self._excluded]
        for slot in candidates:
            if excused(self.ranks[slot]):
                self._exclude(slot)

    def _blocking_loss(self) -> tuple[int, str] | None:
        """A lost peer this rank still depends on (under the lock)."""
        for slot, why in sorted(self._lost.items()):
            if slot not in self._excluded:
                return slot, why
        return None

    def _exclude(self, slot: int) -> None:
        """Leader: stop waiting for `slot` (dropped by the coordinator); the I/O thread re-plans."""
        log.warning(
            "rank %d: local rank %d was dropped from the job; the local group goes on without it",
            self.rank,
            self.ranks[slot],
        )
        # Excluded before the I/O thread hears of it: it re-plans from `_excluded`.
        with self._cond:
            if slot in self._excluded:
                return
            self._excluded.add(slot)
            self._schedule.copied(slot)  # a frozen member never answers COPIED
        if self._wake_tx is not None:
            with contextlib.suppress(OSError):
                self._wake_tx.send(frame(Kind.EXCLUDE, slot))

    def _copy_out(self, step: int) -> None:
        """Copy the result region into this rank's buffers of `step` (one copyto per segment)."""
        with self._cond:
            buffers = self._buffers.pop(step, {})
            for old in [s for s in self._buffers if s < step]:
                del self._buffers[old]
        for bucket_index, buffer in buffers.items():
            result = self.segment.result(bucket_index)
            position = 0
            for piece in buffer.segments:
                np.copyto(piece, result[position : position + piece.size])
                position += piece.size

    # ------------------------------------------------------------ sending to the leader
    def _send_leader(self, message: bytes) -> None:
        if self.is_leader:
            assert self._wake_tx is not None
            try:
                self._wake_tx.send(message)
            except OSError as exc:
                self._record_fatal(f"the local group's I/O thread is gone ({exc})")
        else:
            self._send(0, message)
