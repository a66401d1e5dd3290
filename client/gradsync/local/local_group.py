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
released) and does the summing, so reductions overlap the backward pass; the
training thread only posts and, at the end of a step, waits (bounded). Both
share their state under one condition.

- The follower's thread receives the leader's messages in batches: a REDUCE
  sums this member's share of a bucket (`sum_share`) and answers REDUCED; an
  AVERAGED is recorded for `wait_averaged`. A batch that holds EXCLUDED sums
  nothing at all: the leader summed this (frozen) rank's shares itself, so a
  REDUCE still queued must not touch the shared result region.
- The leader's thread selects over its followers and a wake pipe (its own
  POSTED and the training thread's EXCLUDE come through it as slot 0). It
  sends REDUCE once every live member posted a bucket (`LeaderSchedule` keeps
  who owes what), sums its own shares and those of lost or excluded members,
  and hands each summed bucket to the `ReducedHandler` (the coordinator upload).

Each share's summer also checks its share of the sum for NaN/Inf (in the
same pass, `sum_share`) and names the slots that held one in its REDUCED;
the leader passes them on with its upload, so the coordinator names the
member that produced a NaN, not the leader.

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
import selectors
import socket
import threading
import time
from collections.abc import Callable, Sequence

import numpy as np

from gradsync.errors import GradSyncError, SyncTimeoutError
from gradsync.local.local_rendezvous import MAX_MESSAGE_BYTES, Kind, follow, frame, lead, parse
from gradsync.local.local_schedule import LeaderSchedule
from gradsync.local.local_segment import LOCAL_DTYPES, Segment, SegmentLayout, shm_dir, sum_share
from gradsync.path.buffers import BucketBuffer
from gradsync.path.gradient_path import BucketEventHandler

log = logging.getLogger("gradsync.client")

#: How often a wait looks at the coordinator's side while nothing happens locally.
POLL_S = 0.05
#: Added to 3 heartbeat intervals: how long a lost peer's verdict is waited for.
VERDICT_MARGIN_S = 5.0

#: A wait's look at the coordinator: blocks up to the given seconds, raises its verdict.
Poll = Callable[[float], None]
#: Whether the coordinator dropped a (lost) global rank from the job.
Excused = Callable[[int], bool]

#: Leader: (step, bucket, dtype, covered global ranks, those of them whose gradient held
#: NaN/Inf) of a summed bucket; quick, never raises.
ReducedHandler = Callable[[int, int, int, tuple[int, ...], tuple[int, ...]], None]


class LocalGroup:
    """This rank's membership in its host's local group (see the module docstring).

    Use `form`. `post` is called by autograd hooks (never blocks on a peer);
    `wait_reduced` (leader) and `wait_averaged` (follower) are the bounded waits.
    The I/O thread starts when the object is made.
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
        self.rank = rank
        self.ranks = list(ranks)
        self.slot = self.ranks.index(rank)
        self.is_leader = self.slot == 0
        self.layout = layout
        self.segment = segment
        self._peers = peers
        self._on_reduced = on_reduced
        #: Observer of "local_reduce_start" / "local_reduce_end" (the leader's).
        self.on_event: BucketEventHandler | None = None
        self._cond = threading.Condition()
        self._closed = False
        self._fatal: GradSyncError | None = None
        #: Slot -> why it is gone (EOF, error, or BYE).
        self._lost: dict[int, str] = {}
        self._excluded: set[int] = set()
        #: This rank's own submitted buffers of each step, for the copy-out.
        self._buffers: dict[int, dict[int, BucketBuffer]] = {}
        # Leader only: which bucket waits for whom.
        self._schedule = LeaderSchedule(len(self.ranks))
        # Follower only: step -> contributors.
        self._averaged: dict[int, int] = {}
        self._wake_rx: socket.socket | None = None
        self._wake_tx: socket.socket | None = None
        if self.is_leader:
            self._wake_rx, self._wake_tx = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._thread = threading.Thread(
            target=self._run_leader if self.is_leader else self._run_follower,
            name=f"gradsync-local-r{rank}",
            daemon=True,
        )
        self._thread.start()

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

    # ------------------------------------------------------------ sending
    def _send(self, slot: int, message: bytes) -> None:
        conn = self._peers.get(slot)
        if conn is None:
            return
        try:
            conn.send(message)
        except OSError as exc:
            self._peer_lost(slot, f"sending failed: {exc.strerror or exc}")

    def _record_fatal(self, why: str) -> None:
        with self._cond:
            if self._fatal is None and not self._closed:
                self._fatal = GradSyncError(why, rank=self.rank)
            self._cond.notify_all()

    def _peer_lost(self, slot: int, why: str) -> None:
        with self._cond:
            if slot in self._lost or self._closed:
                return
            self._lost[slot] = why
            self._schedule.copied(slot)
            self._cond.notify_all()
        if why != "closed its side":
            log.warning("rank %d: lost local rank %d: %s", self.rank, self.ranks[slot], why)

    # ------------------------------------------------------------ follower I/O thread
    def _run_follower(self) -> None:
        conn = self._peers[0]
        while True:
            raw_batch, ended = self._receive_batch(conn)
            batch = [parse(raw) for raw in raw_batch]
            if any(message[0] == Kind.EXCLUDED for message in batch):
                # Dropped by the coordinator (it was frozen): the leader summed this rank's
                # shares itself, so a REDUCE still queued must not touch the result region.
                self._peer_lost(
                    0, "the local leader excluded this rank (the coordinator dropped it)"
                )
                return
            for message in batch:
                if not self._on_follower_message(*message):
                    return
            if ended is not None:
                self._peer_lost(0, ended)
                return

    def _receive_batch(self, conn: socket.socket) -> tuple[list[bytes], str | None]:
        """Follower: one blocking receive, then everything already queued behind it.

        Returns:
            The messages, and why the connection ended if it did (EOF or an error).
        """
        batch: list[bytes] = []
        blocking = True
        while True:
            try:
                raw = conn.recv(MAX_MESSAGE_BYTES, 0 if blocking else socket.MSG_DONTWAIT)
            except BlockingIOError:
                return batch, None
            except OSError as exc:
                return batch, str(exc)
            if not raw:
                return batch, "its connection ended (EOF: it died or was killed)"
            batch.append(raw)
            blocking = False

    def _on_follower_message(
        self, kind: int, number: int, step: int, value: int, tail: bytes
    ) -> bool:
        """Follower: act on one (parsed) message of the leader; False once it said goodbye."""
        if kind == Kind.REDUCE:
            covered = np.frombuffer(tail, dtype=np.uint16).tolist()
            culprits = sum_share(self.segment, number, value, self.slot, covered)
            self._send(0, frame(Kind.REDUCED, number, step, 0, _slots_tail(culprits)))
        elif kind == Kind.AVERAGED:
            with self._cond:
                self._averaged[step] = value
                self._cond.notify_all()
        elif kind in (Kind.BYE, Kind.EXCLUDED):
            self._peer_lost(0, "closed its side" if kind == Kind.BYE else "excluded this rank")
            return False
        elif kind == Kind.ERROR:
            self._record_fatal(
                f"local leader rank {self.ranks[0]}: {tail.decode(errors='replace')}"
            )
        return True

    # ------------------------------------------------------------ leader I/O thread
    def _run_leader(self) -> None:
        assert self._wake_rx is not None
        selector = selectors.DefaultSelector()
        selector.register(self._wake_rx, selectors.EVENT_READ, 0)
        for peer_slot, peer in self._peers.items():
            selector.register(peer, selectors.EVENT_READ, peer_slot)
        try:
            while True:
                self._flush_deferred()
                for key, _ in selector.select():  # blocks without the GIL
                    slot: int = key.data
                    conn: socket.socket = key.fileobj  # type: ignore[assignment]
                    try:
                        raw = conn.recv(MAX_MESSAGE_BYTES)
                        why = "its connection ended (EOF: it died or was killed)"
                    except OSError as exc:
                        raw, why = b"", f"its connection failed: {exc}"
                    bye = bool(raw) and parse(raw)[0] == Kind.BYE
                    if slot == 0:
                        if bye or not raw:
                            return  # closing
                        self._on_leader_message(0, raw)
                    elif bye or not raw:
                        selector.unregister(conn)
                        if slot in self._excluded:
                            continue  # its end of a connection `_cut` shut
                        self._peer_lost(slot, "closed its side" if bye else why)
                        self._reduce_for_lost(slot)
                    else:
                        self._on_leader_message(slot, raw)
        except Exception as exc:  # a bug here must surface at the next wait, not hang it
            log.exception("rank %d: the local group's I/O thread failed", self.rank)
            self._record_fatal(f"the local group's I/O thread failed: {exc!r}")
        finally:
            selector.close()

    def _flush_deferred(self) -> None:
        """Send the REDUCEs held back while a follower still read the result region."""
        with self._cond:
            deferred = self._schedule.take_deferred()
        for key in deferred:
            self._maybe_reduce(*key)

    def _on_leader_message(self, slot: int, raw: bytes) -> None:
        kind, number, step, value, tail = parse(raw)
        if slot and slot in self._excluded:
            return  # dropped by the coordinator: whatever it says now counts for nothing
        if kind == Kind.POSTED:
            # The leader's own posts come through the wake pipe as slot 0.
            self._on_posted(slot, step, number, value)
        elif kind == Kind.REDUCED:
            culprits = _parse_slots(tail, len(self.ranks))
            with self._cond:
                self._schedule.summed(step, number, slot, culprits)
            self._maybe_hand_off(step, number)
        elif kind == Kind.COPIED:
            with self._cond:
                self._schedule.copied(slot)
            self._flush_deferred()
        elif kind == Kind.EXCLUDE:
            self._cut(number)
            self._reduce_for_lost(number)
            with self._cond:
                keys = self._schedule.keys()
            for key in keys:
                self._maybe_reduce(*key)

    def _cut(self, slot: int) -> None:
        """Leader's I/O thread: an excluded member is told so and its connection shut.

        The member may only be frozen: if it wakes up, it reads EXCLUDED (and then
        EOF) in the same batch as any REDUCE still queued for it, and so never writes
        into the result region the leader has summed its share into.
        """
        conn = self._peers.get(slot)
        if conn is None:
            return
        with contextlib.suppress(OSError):
            conn.send(frame(Kind.EXCLUDED))
        with contextlib.suppress(OSError):
            conn.shutdown(socket.SHUT_RDWR)

    def _on_posted(self, slot: int, step: int, bucket_index: int, dtype: int) -> None:
        with self._cond:
            if not self._schedule.post(slot, step, bucket_index, dtype):
                return  # a step the others already left (aborted): nothing to sum
        self._maybe_reduce(step, bucket_index)

    def _maybe_reduce(self, step: int, bucket_index: int) -> None:
        """Send REDUCE once every live member posted; sum this leader's (and lost ranks') shares."""
        with self._cond:
            gone = {s for s in range(len(self.ranks)) if s in self._lost or s in self._excluded}
            pending = self._schedule.start(step, bucket_index, self._excluded, gone)
            if pending is None:
                return
            mine = sorted({0} | gone)
            dtype = pending.dtype
        self._event("local_reduce_start", step, bucket_index)
        message = frame(
            Kind.REDUCE, bucket_index, step, dtype, np.array(pending.covered, np.uint16).tobytes()
        )
        for slot in self._peers:
            if slot not in gone:
                self._send(slot, message)
        for share in mine:
            culprits = sum_share(self.segment, bucket_index, dtype, share, pending.covered)
            with self._cond:
                self._schedule.summed(step, bucket_index, share, culprits)
        self._maybe_hand_off(step, bucket_index)

    def _reduce_for_lost(self, slot: int) -> None:
        """Sum `slot`'s share of every bucket it was told to sum and did not (it is gone)."""
        with self._cond:
            todo = self._schedule.owed_by(slot)
        for (step, bucket_index), pending in todo:
            culprits = sum_share(self.segment, bucket_index, pending.dtype, slot, pending.covered)
            with self._cond:
                self._schedule.summed(step, bucket_index, slot, culprits)
            self._maybe_hand_off(step, bucket_index)

    def _maybe_hand_off(self, step: int, bucket_index: int) -> None:
        with self._cond:
            pending = self._schedule.finish(step, bucket_index)
            if pending is None:
                return
        self._event("local_reduce_end", step, bucket_index)
        covered = tuple(self.ranks[s] for s in pending.covered)
        nonfinite = tuple(self.ranks[s] for s in sorted(pending.nonfinite))
        if self._on_reduced is not None:
            self._on_reduced(step, bucket_index, pending.dtype, covered, nonfinite)
        with self._cond:
            self._schedule.handed_off(step, bucket_index)
            self._cond.notify_all()

    def _event(self, event: str, step: int, bucket_index: int) -> None:
        if self.on_event is not None:
            try:
                self.on_event(event, step, bucket_index)
            except Exception:  # instrumentation must never break the data path
                log.exception("bucket event handler failed")


def _slots_tail(slots: Sequence[int]) -> bytes:
    """A REDUCED message's tail: the slots whose share held NaN/Inf (usually none)."""
    return np.array(slots, np.uint16).tobytes() if slots else b""


def _parse_slots(tail: bytes, members: int) -> list[int]:
    """The slots of a REDUCED tail; a malformed tail or a slot out of range counts as none
    (a member's word is only used to name a culprit, never to change a sum)."""
    if len(tail) % 2:
        return []
    slots = np.frombuffer(tail, dtype=np.uint16).tolist()
    return slots if all(s < members for s in slots) else []
