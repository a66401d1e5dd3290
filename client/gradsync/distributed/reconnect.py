"""A process group's link to the coordinator that outlives a coordinator restart.

A coordinator killed and started again on the same address has lost every
collective in flight, but the ranks have not lost their inputs: each rank of
a process group reconnects (backoff, bounded by the reconnect window),
rejoins its group's job with the same job id and rank, and sends every
collective that had not completed again, under the same sequence numbers.
The training script recomputes nothing: a pending `Work` just completes
later (stock DDP's backward takes longer).

The ranks need not agree on what completed: the coordinator may have sent
collective N's result to one rank and died before the other got it. So each
rank claims the lowest collective it has no result for
(`Join.collective_resume`), the restarted coordinator goes on from the lowest
claim, and every rank sends each collective from there on again: the one
still waiting with its own input, the one already done with a copy of its
input kept for that (the last `KEEP_COMPLETED` completed collectives; a rank
cannot run further ahead of another, since a collective completes only once
every rank sent its input). A rank discards a result it already had. Op N of
one rank is thus always paired with op N of the others.

If no coordinator takes the job back within the window, every pending
collective fails naming the coordinator's address, the collective's number and
its op, and so does every later one.

Every result is taken off the transport by the link's own hook, on the
transport's reading thread, and handed to the waiter from here, so that a
stream that failed is told apart from a result that came in.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
from gradsync_proto.v1 import gradsync_pb2 as pb

from gradsync.control.collective_results import op_name
from gradsync.control.link import CoordinatorLink, IssuesCollectives
from gradsync.errors import (
    ClosedError,
    CollectiveError,
    CoordinatorUnavailableError,
    GradSyncError,
    SyncTimeoutError,
)

log = logging.getLogger("gradsync.client")

#: Completed collectives whose input a rank keeps, to send again for a rank behind it: a
#: rank behind has at most its group's `MAX_IN_FLIGHT` outstanding, and a rank ahead can
#: only have completed collectives every rank issued.
KEEP_COMPLETED = 8
#: Carried collectives (`reserve_collective(carried=True)`) remembered, in units of this.
CARRIED_KEPT = 16
#: How long the lost link gets to close before it is replaced.
ABANDON_LINK_TIMEOUT_S = 2.0
#: Reconnect backoff: first pause, and the cap it doubles up to.
FIRST_RETRY_DELAY_S = 0.25
MAX_RETRY_DELAY_S = 2.0

#: Joins the group's job again: (the claimed resume sequence, the time left) -> the
#: joined link and its Welcome. Raises what `Transport.wait_welcome` raises.
Rejoin = Callable[[int, float], tuple[CoordinatorLink, pb.Welcome]]


@dataclass
class _Sent:
    """One collective this rank issued: what to send again, and its outcome."""

    sequence: int
    op: int
    dtype: int
    payload: npt.NDArray[np.uint8]
    root: int
    result_bytes: int | None
    template: pb.CollectiveChunk | None
    on_ready: Callable[[], None] | None
    result: tuple[bytearray, int] | None = None
    error: BaseException | None = None

    def describe(self) -> str:
        return f"collective {self.sequence} ({op_name(self.op)})"


class ResumingLink(IssuesCollectives):
    """The collectives side of a group's link, across coordinator restarts.

    It offers what `gradsync.collectives.Collectives` uses (`issue_collective`,
    `wait_collective`, `run_collective`, `live_ranks`) over the current
    transport, and replaces the transport when the coordinator is lost.

    Args:
        link: the joined transport.
        next_sequence: the number of this rank's next collective (from the Welcome).
        rejoin: joins the job again on a new transport (`Rejoin`).
        address: the coordinator's "host:port" (named in errors).
        rank: this rank in the group.
        reconnect_timeout_s: how long to keep reconnecting; 0: never (a lost
            coordinator fails the pending collectives at once).
    """

    def __init__(
        self,
        link: CoordinatorLink,
        next_sequence: int,
        rejoin: Rejoin,
        address: str,
        rank: int,
        reconnect_timeout_s: float,
    ) -> None:
        self._link = link
        self._rejoin = rejoin
        self.address = address
        self.rank = rank
        self.reconnect_timeout_s = reconnect_timeout_s
        self._lock = threading.RLock()
        self._changed = threading.Condition(self._lock)
        self._next = next_sequence
        #: Issued, without an outcome taken by a waiter yet, by sequence.
        self._pending: dict[int, _Sent] = {}
        #: Completed (their input copied), oldest first.
        self._kept: OrderedDict[int, _Sent] = OrderedDict()
        #: Numbered by `reserve_collective` and not sent yet.
        self._reserved: set[int] = set()
        #: Numbered and never sent: a host group's leader carries this rank's input.
        self._carried: set[int] = set()
        #: Bumped at each loss: hooks of an older transport are ignored.
        self._generation = 0
        self._reconnecting = False
        #: Why the link gave up (then every collective fails with it).
        self._failure: GradSyncError | None = None
        self._closed = False
        #: Told (why) when this link starts reconnecting: a host group's leader passes it on
        #: to its members, whose links have nothing in flight to notice the loss by.
        self.on_lost: Callable[[str], None] | None = None
        #: Told each collective's number as it is numbered, on the numbering thread (the
        #: group's trace: which operation it belongs to), or None.
        self.on_numbered: Callable[[int], None] | None = None
        #: Restarts survived so far, and collectives sent again after them (tests read them).
        self.reconnects = 0
        self.resent = 0

    @property
    def link(self) -> CoordinatorLink:
        """The current transport (replaced by each reconnect)."""
        return self._link

    def live_ranks(self) -> tuple[int, ...] | None:
        return self._link.live_ranks()

    # ------------------------------------------------------------ collectives
    def reserve_collective(self, *, carried: bool) -> int:
        """Number a collective now whose input is sent later (`issue_collective(sequence=)`,
        a host group's leader once its host's inputs are in) or, `carried`, never (a host
        group's member: its leader's input covers it). Never blocks.

        Raises:
            CoordinatorUnavailableError: the coordinator was lost and did not come back.
        """
        with self._lock:
            sequence = self._number()
            if carried:
                self._carried.add(sequence)
                self._carried.difference_update(
                    [s for s in self._carried if s < sequence - 4 * CARRIED_KEPT]
                )
            else:
                self._reserved.add(sequence)
            return sequence

    def issue_collective(
        self,
        op: int,
        dtype: int,
        payload: npt.NDArray[np.uint8],
        root: int,
        *,
        result_bytes: int | None = None,
        template: pb.CollectiveChunk | None = None,
        on_ready: Callable[[], None] | None = None,
        sequence: int | None = None,
    ) -> int:
        """Number the collective (or take the `sequence` reserved for it) and send its input
        (never blocks: while reconnecting it is sent once the job is back); return its
        sequence number.

        Raises:
            CoordinatorUnavailableError: the coordinator was lost and did not come back.
            ValueError: `sequence` was not reserved, or was sent already.
        """
        with self._lock:
            if sequence is None:
                sequence = self._number()
            elif self._failure is not None:
                raise self._failure
            elif sequence in self._reserved:
                self._reserved.discard(sequence)
            else:
                raise ValueError(f"collective {sequence} was not reserved (or was sent already)")
            sent = _Sent(sequence, op, dtype, payload, root, result_bytes, template, on_ready)
            self._pending[sent.sequence] = sent
            if not self._reconnecting:
                self._send(sent)
        return sent.sequence

    def wait_collective(self, sequence: int, timeout_s: float) -> tuple[bytearray, int]:
        """Block (bounded, across a reconnect) for collective `sequence`'s result.

        Raises:
            CollectiveError: it is not outstanding, or the coordinator failed it.
            SyncTimeoutError: no result within `timeout_s`.
            CoordinatorUnavailableError: the coordinator was lost and did not come back.
        """
        deadline = time.monotonic() + timeout_s
        with self._changed:
            sent = self._pending.get(sequence)
            if sent is None:
                raise CollectiveError("it is not outstanding", rank=self.rank, sequence=sequence)
            while sent.result is None and sent.error is None:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    del self._pending[sequence]
                    where = " (reconnecting to the coordinator)" if self._reconnecting else ""
                    raise SyncTimeoutError(
                        f"timed out after {timeout_s:g}s waiting for the result of "
                        f"{sent.describe()}{where}",
                        rank=self.rank,
                    )
                self._changed.wait(remaining)
            del self._pending[sequence]
            if sent.error is not None:
                raise sent.error
            result = sent.result
            assert result is not None
            if self.reconnect_timeout_s > 0:
                # Its input, for a rank behind that sends it again after a restart (the
                # caller's tensor is overwritten with the result once this returns).
                sent.payload, sent.on_ready = sent.payload.copy(), None
                self._kept[sequence] = sent
                while len(self._kept) > KEEP_COMPLETED:
                    self._kept.popitem(last=False)
            return result

    def close(self, timeout_s: float) -> None:
        """Close the current transport and stop reconnecting; a collective still pending
        fails (`ClosedError`). Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._generation += 1
            self._reconnecting = False
            self._failure = ClosedError("the process group was shut down", rank=self.rank)
            self._fail_pending(
                lambda sent: ClosedError(
                    f"{sent.describe()} did not complete: the process group was shut down",
                    rank=self.rank,
                )
            )
            link = self._link
        link.close(timeout_s)

    # ------------------------------------------------------------ internals
    def _number(self) -> int:
        """The next collective's number (lock held), unless the link gave up."""
        if self._failure is not None:
            raise self._failure
        sequence = self._next
        self._next += 1
        if self.on_numbered is not None:
            self.on_numbered(sequence)
        return sequence

    def _send(self, sent: _Sent) -> None:
        """Issue `sent` on the current transport under its own number (lock held)."""
        told = functools.partial(self._told, sent, self._generation)
        self._link.set_collective_sequence(sent.sequence)
        issued = self._link.issue_collective(  # type: ignore[attr-defined]
            sent.op,
            sent.dtype,
            sent.payload,
            sent.root,
            result_bytes=sent.result_bytes,
            template=sent.template,
            on_ready=told,
        )
        if issued != sent.sequence:
            raise RuntimeError(f"the transport numbered {sent.describe()} {issued}")

    def _told(self, sent: _Sent, generation: int) -> None:
        """The transport's hook: `sent`'s result is in, or the stream failed."""
        with self._lock:
            if generation != self._generation:
                return  # a transport this link left
            link = self._link
        result: tuple[bytearray, int] | None = None
        error: BaseException | None = None
        try:
            result = link.wait_collective(sent.sequence, 0.0)  # type: ignore[attr-defined]
        except CoordinatorUnavailableError as exc:
            self._lost(exc, generation)
            return
        except Exception as exc:  # the coordinator failed it (named), or a bad result
            error = exc
        with self._lock:
            if generation != self._generation or self._pending.get(sent.sequence) is not sent:
                return  # (a completed one sent again for a rank behind: its result is known)
            if sent.result is not None or sent.error is not None:
                return  # (the same, its result not yet taken by the waiter)
            sent.result, sent.error = result, error
            hook = sent.on_ready
            self._changed.notify_all()
        if hook is not None:
            hook()

    def reconnect(self, why: str) -> None:
        """Reconnect now, as though this link had lost the coordinator itself (a host
        group's member, told by its leader). Does nothing while reconnecting."""
        self._lost(CoordinatorUnavailableError(why, rank=self.rank), self._generation)

    def _lost(self, cause: CoordinatorUnavailableError, generation: int) -> None:
        """The coordinator was lost: reconnect on a thread of its own (once per loss)."""
        with self._lock:
            if generation != self._generation or self._reconnecting or self._closed:
                return
            self._generation += 1
            if self.reconnect_timeout_s <= 0:
                self._give_up(cause, cause)
                return
            self._reconnecting = True
            lost = self._link
        threading.Thread(
            target=self._reconnect,
            args=(cause, lost),
            name=f"gradsync-pg-reconnect-r{self.rank}",
            daemon=True,
        ).start()
        hook = self.on_lost
        if hook is not None:
            try:
                hook(str(cause))
            except Exception:  # passing it on is best effort; the members' own waits are bounded
                log.exception("telling the host group about the lost coordinator failed")

    def _reconnect(self, cause: CoordinatorUnavailableError, lost: CoordinatorLink) -> None:
        deadline = time.monotonic() + self.reconnect_timeout_s
        with self._lock:
            waiting = len(self._pending)
        log.warning(
            "rank %d: lost the coordinator at %s (%s); reconnecting for up to %gs to send "
            "%d collective(s) again",
            self.rank,
            self.address,
            cause,
            self.reconnect_timeout_s,
            waiting,
        )
        try:
            lost.close(ABANDON_LINK_TIMEOUT_S)
        except Exception:  # it failed already; closing is best effort
            log.debug("closing the lost link failed", exc_info=True)
        delay = FIRST_RETRY_DELAY_S
        while True:
            with self._lock:
                if self._closed:
                    return
                claim = min(
                    [s for s, sent in self._pending.items() if sent.result is None]
                    + sorted(self._reserved)[:1],
                    default=self._next,
                )
            remaining = deadline - time.monotonic()
            try:
                link, welcome = self._rejoin(claim, max(1.0, remaining))
                break
            except (CoordinatorUnavailableError, SyncTimeoutError) as exc:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    with self._lock:
                        self._give_up(cause, exc)
                    return
                time.sleep(min(delay, remaining))
                delay = min(delay * 2, MAX_RETRY_DELAY_S)
            except Exception as exc:  # refused: the coordinator is up but will not take it
                with self._lock:
                    self._give_up(cause, exc)
                return
        self._resume(link, int(welcome.next_collective), cause)

    def _resume(self, link: CoordinatorLink, start: int, cause: BaseException) -> None:
        """Send every collective from `start` on again, on the rejoined `link`."""
        with self._lock:
            if self._closed:
                link.close(ABANDON_LINK_TIMEOUT_S)
                return
            # (A reserved one is sent when its host's inputs are in; a carried one never.)
            again = [
                s
                for s in range(start, self._next)
                if s not in self._reserved and s not in self._carried
            ]
            missing = [s for s in again if s not in self._pending and s not in self._kept]
            self._link = link
            self._reconnecting = False
            if missing:
                self._generation += 1
                self._give_up(
                    cause,
                    RuntimeError(
                        f"the restarted coordinator resumed at collective {start}, but this rank "
                        f"no longer holds the input of collective(s) {missing[:8]} (it keeps "
                        f"the last {KEEP_COMPLETED} completed)"
                    ),
                )
                return
            self.reconnects += 1
            self.resent += len(again)
            try:
                for sequence in again:
                    self._send(self._pending.get(sequence) or self._kept[sequence])
            except Exception as exc:  # the rejoined transport failed at once
                self._generation += 1
                self._give_up(cause, exc)
                return
            log.warning(
                "rank %d: rejoined the coordinator at %s; sent collectives %d to %d again",
                self.rank,
                self.address,
                start,
                self._next - 1,
            )

    def _give_up(self, cause: BaseException, last: BaseException) -> None:
        """Fail every pending collective and every later one (lock held)."""
        self._reconnecting = False
        window = (
            f"and it did not come back within {self.reconnect_timeout_s:g}s"
            if self.reconnect_timeout_s > 0
            else "(reconnecting is off)"
        )
        why = f"lost the coordinator at {self.address} ({cause}) {window}: {last}"
        self._failure = CoordinatorUnavailableError(why, rank=self.rank)
        log.error("rank %d: %s", self.rank, self._failure)
        self._fail_pending(
            lambda sent: CoordinatorUnavailableError(
                f"{sent.describe()} did not complete: {why}", rank=self.rank
            )
        )

    def _fail_pending(self, error_for: Callable[[_Sent], GradSyncError]) -> None:
        """Fail every collective without an outcome, and tell its hook (lock held)."""
        hooks = []
        for sent in self._pending.values():
            if sent.result is None and sent.error is None:
                sent.error = error_for(sent)
                if sent.on_ready is not None:
                    hooks.append(sent.on_ready)
        self._changed.notify_all()
        if hooks:  # told on a thread of their own: the lock is held, and a hook completes Work
            threading.Thread(target=_run_all, args=(hooks,), daemon=True).start()


def _run_all(hooks: list[Callable[[], None]]) -> None:
    for hook in hooks:
        try:
            hook()
        except Exception:  # a hook's failure is its own; the others still run
            log.exception("a collective's completion hook failed")
