"""The local group's I/O thread: the messages between the members, and the sums they start.

Every member of a `gradsync.local.local_group.LocalGroup` runs one such thread,
so that the summing overlaps the backward pass: it blocks in `select`/`recv`
(the GIL released) while the training thread only posts and, at the end of a
step, waits. This module is that background side, and the state both threads
share (under one condition); the training thread's calls and its bounded waits
are `gradsync.local.local_group`.

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
"""

from __future__ import annotations

import contextlib
import logging
import selectors
import socket
import threading
from collections.abc import Callable, Sequence

import numpy as np

from gradsync.errors import GradSyncError
from gradsync.local.local_rendezvous import MAX_MESSAGE_BYTES, Kind, frame, parse
from gradsync.local.local_schedule import LeaderSchedule
from gradsync.local.local_segment import Segment, SegmentLayout, sum_share
from gradsync.path.buffers import BucketBuffer
from gradsync.path.gradient_path import BucketEventHandler

log = logging.getLogger("gradsync.client")

#: Leader: (step, bucket, dtype, covered global ranks, those of them whose gradient held
#: NaN/Inf) of a summed bucket; quick, never raises.
ReducedHandler = Callable[[int, int, int, tuple[int, ...], tuple[int, ...]], None]


class LocalGroupIO:
    """A member's I/O thread and the state it shares with the training thread.

    Not used alone: `gradsync.local.local_group.LocalGroup` adds the training
    thread's side. The thread starts when the object is made.
    """

    def __init__(
        self,
        rank: int,
        ranks: Sequence[int],
        layout: SegmentLayout,
        segment: Segment,
        peers: dict[int, socket.socket],
        on_reduced: ReducedHandler | None,
    ) -> None:
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
