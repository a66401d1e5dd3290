"""A process group's operations: issued in order, several in flight, completed in order.

A c10d collective must not block its caller: DDP's reducer calls `allreduce`
from the autograd thread for every bucket, and `dist.all_reduce(...,
async_op=True)` promises a handle at once. So a `gradsync.distributed` group
validates a call on the caller's thread, then hands the network part to its
`OpQueue`. Every rank issues the group's collectives in the same order and the
coordinator pairs them by number, so they must reach the stream in that order;
they need not wait for each other, though: an all-reduce is issued (its input
queued on the stream) at once, on the caller's thread where it can be, and
completed in issue order by the thread that reads its result off the stream
(the link tells the queue when a result is whole): the result is written into
the caller's tensors there and the operation's `torch.futures.Future`
completed with its output tensors, or failed with a
`torch.distributed.DistBackendError` that names the rank, the operation, its
number in the group and the group's job. DDP's buckets of one step are thus
all in flight together, as the model wrapper's are.

The caller gets a `GradsyncWork`: `work.wait()` returns once the operation
completed and raises its `DistBackendError` if it failed (as gloo's does);
`work.get_future()` is a future of the output tensors that carries the failure
into C++ too, where DDP's reducer reads it. (c10d's
`_create_work_from_future` would not do: its `wait()` returns without raising,
and a Python future's exception reaches C++ as a value.) Every wait inside
an operation is bounded by the group's timeout (the `Collectives`' own), so a
Work always completes or fails.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from gradsync.distributed.op_trace import OpTrace

log = logging.getLogger("gradsync.client")

#: What an operation's network part returns: the tensors its future carries.
OpResult = list[torch.Tensor]


#: A split operation's second half: waits for its result, writes it back, returns it.
Finish = Callable[[], OpResult]
#: A split operation's first half: sends its input, returns its `Finish`; it is given
#: `ready`, to be called (once, never blocking) when `Finish` would no longer block.
Issue = Callable[[Callable[[], None]], Finish]
#: How often the completing thread looks for a told operation whose result is late,
#: and how late (seconds since its issue) it must be before that thread waits for it.
WATCH_S = 0.5
LATE_S = 1.0


@dataclass
class _Queued:
    sequence: int
    name: str
    #: A whole operation (None for a split one).
    run: Callable[[], OpResult] | None
    #: A split operation's first half (None for a whole one).
    issue: Issue | None
    future: torch.futures.Future[Any]
    #: A split operation whose `issue` calls `ready` (it can complete on that thread).
    tells: bool = False


@dataclass
class _Issued:
    """An operation handed to the completing thread, in issue order."""

    item: _Queued
    finish: Finish | None
    #: Why it could not be issued, if it could not.
    error: BaseException | None
    holds_slot: bool
    #: Set once a whole operation is done (the issuing thread waits for it).
    finished: threading.Event | None = None
    #: A told operation: its result is in (`Finish` will not block).
    ready: bool = False
    #: Its `issue` returned (or failed): `finish` or `error` is set.
    launched: bool = False
    issued_at: float = 0.0


class GradsyncWork(dist.Work):
    """A c10d Work over one queued operation's future.

    Args:
        outcome: completed by the group's thread with the output tensors, or with a
            `DistBackendError` (`Future.set_exception`).
    """

    def __init__(self, outcome: torch.futures.Future[Any]) -> None:
        super().__init__()
        self._outcome = outcome
        # A future whose failure is a failure in C++ as well (a callback that raises
        # fails the future `then` returns), for DDP's reducer and comm hooks.
        self._future = outcome.then(lambda done: done.value())

    def wait(self, timeout: Any = None) -> bool:
        """Block until the operation is done; raise its DistBackendError if it failed.

        The operation's own waits are bounded by the group's timeout, so this is too.
        """
        self._outcome.wait()  # raises what the thread set as the exception
        return True

    def get_future(self) -> torch.futures.Future[Any]:
        return self._future

    def is_completed(self) -> bool:
        return bool(self._outcome.done())

    def is_success(self) -> bool:
        if not self._outcome.done():
            return False
        try:
            self._outcome.wait()
        except Exception:
            return False
        return True

    def result(self) -> OpResult:
        return list(self._outcome.wait())


class OpQueue:
    """Runs one group's operations in the order they were queued, several in flight.

    An operation is either split (`submit(issue=)`: `issue` sends its input and
    returns a `finish` that waits for the result) or whole (`submit(run=)`: one
    callable that runs every collective it needs and waits for each). A split
    operation is issued at once on the caller's thread when nothing queued is
    ahead of it, its tensor is on the CPU and fewer than `max_in_flight` are
    outstanding; else the group's issuing thread issues it in turn. Operations
    complete in issue order. A split operation that tells when its result is in
    (`tells`) is completed by the thread that tells, as soon as every operation
    before it completed: no thread waits for it (the completing thread steps in
    only for one whose result is more than `LATE_S` late, and then waits for it,
    bounded). The others go to the completing thread, which calls each
    `finish` in order once the told operations before it completed. A whole
    operation runs on the completing thread once every operation before it
    completed, and nothing after it is issued until it is done (its
    collectives keep their place in the sequence).

    The first failure fails its operation and every later one, issued or not,
    with a `DistBackendError` that names the operation that failed first: the
    ranks' sequences can no longer be trusted to pair up.

    Args:
        describe: names the group in errors ("rank 1 of group 'default' (job 'j.pg-world')").
        thread_name: the threads' name (seen in stack dumps; "-issue" and "-done" appended).
        max_in_flight: bound on split operations issued and not yet completed (the
            coordinator holds at most `MAX_OPEN_COLLECTIVES` of a job open).
        timeout_s: bound on each wait of the threads for a free slot or a whole op.
        trace: records each operation's phases (`gradsync.distributed.op_trace`), or None.
    """

    def __init__(
        self,
        describe: str,
        thread_name: str,
        max_in_flight: int = 8,
        timeout_s: float = 300.0,
        trace: OpTrace | None = None,
    ) -> None:
        if max_in_flight < 1:
            raise ValueError(f"max_in_flight must be at least 1, got {max_in_flight}")
        self._describe = describe
        self._timeout_s = timeout_s
        self.trace = trace
        self.max_in_flight = max_in_flight
        self._queue: queue.SimpleQueue[_Queued | None] = queue.SimpleQueue()
        self._done: queue.SimpleQueue[_Issued | None] = queue.SimpleQueue()
        self._slots = threading.BoundedSemaphore(max_in_flight)
        # Reentrant: an operation issued inline holds it while its `ready` may be told.
        self._lock = threading.RLock()
        self._changed = threading.Condition(self._lock)
        self._next_sequence = 0
        #: Operations handed to the issuing thread and not yet issued (or, whole, done).
        self._waiting = 0
        #: Told operations issued and not yet completed, in issue order.
        self._told: collections.deque[_Issued] = collections.deque()
        #: Some thread is completing told operations (one at a time keeps the order).
        self._completing = False
        #: Operations handed to the completing thread and not yet completed.
        self._handed = 0
        self._closed = False
        #: The first failure: (its operation's name, sequence, error).
        self._failure: tuple[str, int, BaseException] | None = None
        #: Operations completed or failed so far (tests and status read it).
        self.completed = 0
        #: Operations issued on the caller's thread (no hop to the issuing thread).
        self.issued_inline = 0
        #: Told operations completed by the thread that told (no hop to a waiting thread).
        self.completed_on_tell = 0
        self._issuer = threading.Thread(
            target=self._serve_issues, name=f"{thread_name}-issue", daemon=True
        )
        self._completer = threading.Thread(
            target=self._serve_completions, name=f"{thread_name}-done", daemon=True
        )
        self._issuer.start()
        self._completer.start()

    def submit(
        self,
        name: str,
        run: Callable[[], OpResult] | None = None,
        issue: Issue | None = None,
        *,
        inline: bool = False,
        tells: bool = False,
    ) -> Any:
        """Queue `run`, a whole operation, or one that `issue` sends and whose returned
        `finish` completes; return a c10d Work at once (never blocks).

        With `inline`, `issue` runs here on the caller's thread when nothing is
        queued ahead and a slot is free (it must then not block: a CPU tensor on a
        link that can issue); else the issuing thread runs it in turn. With
        `tells`, `issue` calls the `ready` it is given once `finish` would not
        block (on whatever thread learns it; possibly before `issue` returned).

        Raises:
            RuntimeError: the group was shut down.
        """
        future: torch.futures.Future[Any] = torch.futures.Future()
        with self._lock:
            sequence = self._take_sequence(name)
            item = _Queued(sequence, name, run, issue, future, tells)
            if inline and self._waiting == 0 and self._slots.acquire(blocking=False):
                self.issued_inline += 1
                self._issue(item)
            else:
                self._waiting += 1
                self._queue.put(item)
        if inline:
            self._complete_ready()
        return GradsyncWork(future)

    def close(self, timeout_s: float) -> None:
        """Stop taking operations; let the queued ones finish (bounded by `timeout_s`)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._queue.put(None)
        current = threading.current_thread()
        for thread in (self._issuer, self._completer):
            if current is not thread:
                thread.join(timeout_s)

    # ------------------------------------------------------------ internals
    def _take_sequence(self, name: str) -> int:
        if self._closed:
            raise RuntimeError(f"gradsync: {self._describe}: {name} after the group was shut down")
        sequence = self._next_sequence
        self._next_sequence += 1
        if self.trace is not None:
            self.trace.issued(sequence, name)
        return sequence

    def _issue(self, item: _Queued) -> None:
        """Issue a split operation (a slot is held); queue it for completion in order.

        A told one is completed where its `ready` is told, unless operations handed
        to the completing thread are still ahead of it (it then goes there too).
        """
        assert item.issue is not None
        with self._lock:
            told = item.tells and self._handed == 0
            issued = _Issued(item, None, None, holds_slot=True, issued_at=time.monotonic())
            if told:
                self._told.append(issued)  # before the issue: `ready` may come at once
            else:
                self._handed += 1
        try:
            if self._failure is None:
                with self._running(item.sequence):
                    issued.finish = item.issue(functools.partial(self._on_ready, issued))
        except Exception as exc:
            issued.error = exc
        with self._lock:
            issued.launched = True
            if issued.error is not None or issued.finish is None:
                issued.ready = True  # (failed, or not issued after a failure: completes now)
            self._changed.notify_all()
        if not told:
            self._done.put(issued)

    def _on_ready(self, issued: _Issued) -> None:
        """A told operation's result is in; complete what can be, in order."""
        if self.trace is not None:
            self.trace.received(issued.item.sequence)
        with self._lock:
            issued.ready = True
        self._complete_ready()

    def _complete_ready(self) -> None:
        """Complete told operations from the oldest on while their results are in (any
        thread; never waits on the network)."""
        with self._lock:
            if self._completing:
                return  # that thread looks again before it stops
            self._completing = True
        try:
            while True:
                with self._lock:
                    if not self._told or not (self._told[0].ready and self._told[0].launched):
                        return
                    head = self._told.popleft()
                if threading.current_thread() is not self._completer:
                    self.completed_on_tell += 1
                self._complete(head)
        finally:
            with self._lock:
                self._completing = False
                self._changed.notify_all()

    def _complete_oldest_told(self) -> None:
        """Complete the oldest told operation here, waiting (bounded) for its result."""
        with self._lock:
            # Completing ready ones never waits on the network, and an issue never blocks.
            while self._completing or (self._told and not self._told[0].launched):
                self._changed.wait(WATCH_S)
            if not self._told:
                return
            head = self._told.popleft()
            self._completing = True
        try:
            self._complete(head)  # its `finish` waits at most until its own deadline
        finally:
            with self._lock:
                self._completing = False
                self._changed.notify_all()
        self._complete_ready()

    def _drain_told(self) -> None:
        """Complete every told operation issued so far (before what was handed here)."""
        while True:
            with self._lock:
                if not self._told:
                    return
            self._complete_oldest_told()

    def _watch_late(self) -> None:
        """Wait here for the oldest told operation if its result is late, so that a
        result that never comes still fails its Work within its timeout."""
        with self._lock:
            late = bool(self._told) and time.monotonic() - self._told[0].issued_at > LATE_S
        if late:
            self._complete_oldest_told()

    def _serve_issues(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                self._done.put(None)
                return
            if item.run is not None:  # whole: it runs on the completing thread, in order
                finished = threading.Event()
                self._hand(_Issued(item, None, None, holds_slot=False, finished=finished))
                while not finished.wait(self._timeout_s):  # (its own waits are bounded)
                    log.warning("gradsync: %s: %s still runs", self._describe, item.name)
            elif self._slots.acquire(timeout=self._timeout_s):
                self._issue(item)
                self._complete_ready()
            else:
                error = TimeoutError(
                    f"{self.max_in_flight} operations were in flight and none completed "
                    f"within {self._timeout_s:g} s"
                )
                self._hand(_Issued(item, None, error, holds_slot=False))
            with self._lock:
                self._waiting -= 1

    def _hand(self, issued: _Issued) -> None:
        """Hand an operation that holds no slot to the completing thread."""
        with self._lock:
            self._handed += 1
        self._done.put(issued)

    def _serve_completions(self) -> None:
        while True:
            try:
                issued = self._done.get(timeout=WATCH_S)
            except queue.Empty:
                self._watch_late()
                continue
            self._drain_told()  # told operations issued before this one complete first
            if issued is None:
                return
            self._complete(issued)
            with self._lock:
                self._handed -= 1

    def _complete(self, issued: _Issued) -> None:
        """Run or finish one operation and complete its future (or fail it, named)."""
        item = issued.item
        result: OpResult = []
        error: BaseException | None = None
        try:
            if self._failure is not None:
                name, sequence, first = self._failure
                raise RuntimeError(
                    f"an earlier operation of the group, {name} (operation {sequence}), "
                    f"failed: {first}"
                )
            if issued.error is not None:
                raise issued.error
            if item.run is not None:
                with self._running(item.sequence):
                    result = item.run()
            else:
                assert issued.finish is not None
                result = issued.finish()
            if self.trace is not None:
                self.trace.received(item.sequence)
        except Exception as exc:  # every failure reaches the op's future, named
            if self._failure is None:
                self._failure = (item.name, item.sequence, exc)
            error = dist.DistBackendError(
                f"gradsync: {self._describe}: {item.name} (operation {item.sequence} of "
                f"the group) failed: {exc}"
            )
            error.__cause__ = exc
            log.debug("%s", error)
        self._settle(issued)  # (counted before a waiter can wake)
        finished = time.perf_counter()
        if error is None:
            item.future.set_result(result)
        else:
            item.future.set_exception(error)
        if self.trace is not None:
            self.trace.completed(item.sequence, error is None, finished)

    def _running(self, sequence: int) -> contextlib.AbstractContextManager[None]:
        """While operation `sequence` issues or runs here: the trace's context, if any."""
        if self.trace is None:
            return contextlib.nullcontext()
        return self.trace.running(sequence)

    def _settle(self, issued: _Issued) -> None:
        self.completed += 1
        if issued.holds_slot:
            self._slots.release()
        if issued.finished is not None:
            issued.finished.set()
