"""A process group's network thread: its collectives run there, in issue order, as futures.

A c10d collective must not block its caller: DDP's reducer calls `allreduce`
from the autograd thread for every bucket, and `dist.all_reduce(...,
async_op=True)` promises a handle at once. So a `gradsync.distributed` group
validates a call on the caller's thread, then hands the network part to its
`OpQueue`: one daemon thread per group that runs the queued operations one
after the other (every rank issues the group's collectives in the same order,
and the coordinator pairs them by number, so they must reach the stream in
that order) and completes each operation's `torch.futures.Future` with its
output tensors, written in place, or fails it with a
`torch.distributed.DistBackendError` that names the rank, the operation, its
number in the group and the group's job.

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


@dataclass
class _Queued:
    sequence: int
    name: str
    run: Callable[[], OpResult]
    future: torch.futures.Future[Any]


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
    """Runs one group's operations on its own thread, in the order they were queued.

    Args:
        describe: names the group in errors ("rank 1 of group 'default' (job 'j.pg-world')").
        thread_name: the thread's name (seen in stack dumps).
    """

    def __init__(self, describe: str, thread_name: str) -> None:
        self._describe = describe
        self._queue: queue.SimpleQueue[_Queued | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._next_sequence = 0
        self._closed = False
        #: Operations completed or failed so far (tests and status read it).
        self.completed = 0
        self._thread = threading.Thread(target=self._serve, name=thread_name, daemon=True)
        self._thread.start()

    def submit(self, name: str, run: Callable[[], OpResult]) -> Any:
        """Queue `run` as operation `name`; return a c10d Work at once (never blocks).

        Raises:
            RuntimeError: the group was shut down.
        """
        future: torch.futures.Future[Any] = torch.futures.Future()
        with self._lock:
            if self._closed:
                raise RuntimeError(
                    f"gradsync: {self._describe}: {name} after the group was shut down"
                )
            sequence = self._next_sequence
            self._next_sequence += 1
            self._queue.put(_Queued(sequence, name, run, future))
        return GradsyncWork(future)

    def close(self, timeout_s: float) -> None:
        """Stop taking operations; let the queued ones finish (bounded by `timeout_s`)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._queue.put(None)
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout_s)

    def _serve(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            try:
                result = item.run()
            except Exception as exc:  # every failure reaches the op's future, named
                error = dist.DistBackendError(
                    f"gradsync: {self._describe}: {item.name} (operation {item.sequence} of "
                    f"the group) failed: {exc}"
                )
                error.__cause__ = exc
                log.debug("%s", error)
                self.completed += 1  # (counted before a waiter can wake)
                item.future.set_exception(error)
            else:
                self.completed += 1
                item.future.set_result(result)
