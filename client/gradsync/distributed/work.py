"""A process group's operations: issued in order, several in flight, completed in order.

A c10d collective must not block its caller: DDP's reducer calls `allreduce`
from the autograd thread for every bucket, and `dist.all_reduce(...,
async_op=True)` promises a handle at once. So a `gradsync.distributed` group
validates a call on the caller's thread, then hands the network part to its
`OpQueue`. Every rank issues the group's collectives in the same order and the
coordinator pairs them by number, so they must reach the stream in that order;
they need not wait for each other, though: an all-reduce is issued (its input
queued on the stream) at once, on the caller's thread where it can be, and
the group's completing thread waits for the results in issue order, writes
each into the caller's tensors and completes the operation's
`torch.futures.Future` with its output tensors, or fails it with a
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

import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

log = logging.getLogger("gradsync.client")

#: What an operation's network part returns: the tensors its future carries.
OpResult = list[torch.Tensor]


#: A split operation's second half: waits for its result, writes it back, returns it.
Finish = Callable[[], OpResult]


@dataclass
class _Queued:
    sequence: int
    name: str
    #: A whole operation (None for a split one).
    run: Callable[[], OpResult] | None
    #: A split operation's first half (None for a whole one).
    issue: Callable[[], Finish] | None
    future: torch.futures.Future[Any]


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
        self._future = outcome.then(_value_of)

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


def _value_of(future: torch.futures.Future[Any]) -> Any:
    return future.value()


class OpQueue:
    """Runs one group's operations in the order they were queued, several in flight.

    An operation is either split (`submit_split`: `issue` sends its input and
    returns a `finish` that waits for the result) or whole (`submit`: one
    callable that runs every collective it needs and waits for each). A split
    operation is issued at once on the caller's thread when nothing queued is
    ahead of it, its tensor is on the CPU and fewer than `max_in_flight` are
    outstanding; else the group's issuing thread issues it in turn. The
    completing thread calls each `finish` in issue order and completes the
    operations' futures in that order. A whole operation runs on the completing
    thread once every operation before it completed, and nothing after it is
    issued until it is done (its collectives keep their place in the sequence).

    The first failure fails its operation and every later one, issued or not,
    with a `DistBackendError` that names the operation that failed first: the
    ranks' sequences can no longer be trusted to pair up.

    Args:
        describe: names the group in errors ("rank 1 of group 'default' (job 'j.pg-world')").
        thread_name: the threads' name (seen in stack dumps; "-issue" and "-done" appended).
        max_in_flight: bound on split operations issued and not yet completed (the
            coordinator holds at most `MAX_OPEN_COLLECTIVES` of a job open).
        timeout_s: bound on each wait of the threads for a free slot or a whole op.
    """

    def __init__(
        self,
        describe: str,
        thread_name: str,
        max_in_flight: int = 8,
        timeout_s: float = 300.0,
    ) -> None:
        if max_in_flight < 1:
            raise ValueError(f"max_in_flight must be at least 1, got {max_in_flight}")
        self._describe = describe
        self._timeout_s = timeout_s
        self.max_in_flight = max_in_flight
        self._queue: queue.SimpleQueue[_Queued | None] = queue.SimpleQueue()
        self._done: queue.SimpleQueue[_Issued | None] = queue.SimpleQueue()
        self._slots = threading.BoundedSemaphore(max_in_flight)
        self._lock = threading.Lock()
        self._next_sequence = 0
        #: Operations handed to the issuing thread and not yet issued (or, whole, done).
        self._waiting = 0
        self._closed = False
        #: The first failure: (its operation's name, sequence, error).
        self._failure: tuple[str, int, BaseException] | None = None
        #: Operations completed or failed so far (tests and status read it).
        self.completed = 0
        #: Operations issued on the caller's thread (no hop to the issuing thread).
        self.issued_inline = 0
        self._issuer = threading.Thread(
            target=self._serve_issues, name=f"{thread_name}-issue", daemon=True
        )
        self._completer = threading.Thread(
            target=self._serve_completions, name=f"{thread_name}-done", daemon=True
        )
        self._issuer.start()
        self._completer.start()

    def submit(self, name: str, run: Callable[[], OpResult]) -> Any:
        """Queue `run`, a whole operation; return a c10d Work at once (never blocks).

        Raises:
            RuntimeError: the group was shut down.
        """
        future: torch.futures.Future[Any] = torch.futures.Future()
        with self._lock:
            sequence = self._take_sequence(name)
            self._waiting += 1
            self._queue.put(_Queued(sequence, name, run, None, future))
        return GradsyncWork(future)

    def submit_split(self, name: str, issue: Callable[[], Finish], *, inline: bool) -> Any:
        """Queue an operation that `issue` sends and whose returned `finish` completes.

        With `inline`, `issue` runs here on the caller's thread when nothing is
        queued ahead and a slot is free (it must then not block: a CPU tensor on a
        link that can issue); else the issuing thread runs it in turn.

        Raises:
            RuntimeError: the group was shut down.
        """
        future: torch.futures.Future[Any] = torch.futures.Future()
        with self._lock:
            sequence = self._take_sequence(name)
            item = _Queued(sequence, name, None, issue, future)
            if inline and self._waiting == 0 and self._slots.acquire(blocking=False):
                self.issued_inline += 1
                self._issue(item)
            else:
                self._waiting += 1
                self._queue.put(item)
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
        return sequence

    def _issue(self, item: _Queued) -> None:
        """Issue a split operation (a slot is held) and hand it to the completing thread."""
        assert item.issue is not None
        finish: Finish | None = None
        error: BaseException | None = None
        if self._failure is None:
            try:
                finish = item.issue()
            except Exception as exc:
                error = exc
        self._done.put(_Issued(item, finish, error, holds_slot=True))

    def _serve_issues(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                self._done.put(None)
                return
            if item.run is not None:  # whole: it runs on the completing thread, in order
                finished = threading.Event()
                self._done.put(_Issued(item, None, None, holds_slot=False, finished=finished))
                while not finished.wait(self._timeout_s):  # (its own waits are bounded)
                    log.warning("gradsync: %s: %s still runs", self._describe, item.name)
            elif self._slots.acquire(timeout=self._timeout_s):
                self._issue(item)
            else:
                error = TimeoutError(
                    f"{self.max_in_flight} operations were in flight and none completed "
                    f"within {self._timeout_s:g} s"
                )
                self._done.put(_Issued(item, None, error, holds_slot=False))
            with self._lock:
                self._waiting -= 1

    def _serve_completions(self) -> None:
        while True:
            issued = self._done.get()
            if issued is None:
                return
            item = issued.item
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
                    result = item.run()
                else:
                    assert issued.finish is not None
                    result = issued.finish()
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
                item.future.set_exception(error)
            else:
                self._settle(issued)
                item.future.set_result(result)

    def _settle(self, issued: _Issued) -> None:
        self.completed += 1
        if issued.holds_slot:
            self._slots.release()
        if issued.finished is not None:
            issued.finished.set()
