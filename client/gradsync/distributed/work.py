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

The caller gets a c10d `Work` made from that future
(`torch._C._distributed_c10d._create_work_from_future`): `work.wait()` and
`work.get_future()` behave as for gloo. Every wait inside an operation is
bounded by the group's timeout (the `Collectives`' own), so a Work always
completes or fails.
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
from torch._C import _distributed_c10d as c10d_ext

log = logging.getLogger("gradsync.client")

#: What an operation's network part returns: the tensors its future carries.
OpResult = list[torch.Tensor]


@dataclass
class _Queued:
    sequence: int
    name: str
    run: Callable[[], OpResult]
    future: torch.futures.Future[Any]


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
        # (not in torch's stubs; c10d's documented way for a Python process group)
        return c10d_ext._create_work_from_future(future)  # type: ignore[attr-defined]

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
                item.future.set_exception(error)
            else:
                item.future.set_result(result)
            self.completed += 1
