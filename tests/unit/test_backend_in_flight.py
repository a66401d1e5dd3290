"""A "gradsync" group keeps several all-reduces in flight, completes them in order, and
fails every later Work after a failure.

The group runs over a `RecordingLink`: a link that can issue a collective and wait
for it separately (as `Transport` does) and records the order of the two, and
whose results come back only once the test lets them. The group's real
`Collectives` and `OpQueue` run unchanged on it.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
import torch
import torch.distributed as dist
from gradsync.collectives import Collectives
from gradsync.distributed import ProcessGroupGradsync
from gradsync.distributed.work import LATE_S
from gradsync.errors import CollectiveError

WAIT_S = 10.0


class StandInSession:
    """What a `ProcessGroupGradsync` reads of its `GroupSession`."""

    def __init__(self, collectives: Collectives) -> None:
        self.collectives = collectives
        self.rank, self.world_size = collectives.rank, collectives.world_size
        self.job_id, self.address = "job.pg-world", "127.0.0.1:1"
        self.shard_routes = None  # an unsharded coordinator

    def close(self) -> None:
        pass


class RecordingLink:
    """One rank of a group of one: a result is the input itself (a SUM over one rank)
    times `scale`, released by `release(sequence)` (which tells the collective's
    `on_ready`, as the stream's reading thread does, unless `tells` is False);
    `fail` names sequences whose result is refused."""

    def __init__(self, fail: frozenset[int] = frozenset(), *, tells: bool = True) -> None:
        self.events: list[tuple[str, int]] = []
        self.threads: dict[int, str] = {}
        self._hooks: dict[int, Any] = {}
        self._tells = tells
        self._inputs: dict[int, bytes] = {}
        self._released: dict[int, threading.Event] = {}
        self._lock = threading.Lock()
        self._fail = fail
        self.next_sequence = 0

    def issue_collective(
        self,
        op: int,
        dtype: int,
        payload: npt.NDArray[np.uint8],
        root: int,
        on_ready: Any = None,
        **_: Any,
    ) -> int:
        with self._lock:
            sequence = self.next_sequence
            self.next_sequence += 1
            if self._tells:
                self._hooks[sequence] = on_ready
            self._inputs[sequence] = payload.tobytes()
            self._released.setdefault(sequence, threading.Event())
            self.events.append(("issue", sequence))
            self.threads[sequence] = threading.current_thread().name
        return sequence

    def release(self, sequence: int) -> None:
        with self._lock:
            self._released.setdefault(sequence, threading.Event()).set()
            hook = self._hooks.pop(sequence, None)
        if hook is not None:
            hook()

    def wait_collective(self, sequence: int, timeout_s: float) -> tuple[bytearray, int]:
        assert self._released[sequence].wait(timeout_s), f"collective {sequence} not released"
        with self._lock:
            self.events.append(("result", sequence))
        if sequence in self._fail:
            raise CollectiveError("the coordinator failed it: test", rank=0, sequence=sequence)
        doubled = np.frombuffer(self._inputs[sequence], np.float32) * 2
        return bytearray(doubled.tobytes()), 1

    def run_collective(self, *args: Any, **kwargs: Any) -> tuple[bytearray, int]:
        raise AssertionError("an all-reduce must be issued and waited for separately")

    def live_ranks(self) -> None:
        return None


def group_over(link: RecordingLink, timeout_s: float = WAIT_S) -> ProcessGroupGradsync:
    collectives = Collectives(lambda: link, 0, 1, timeout_s=timeout_s)  # type: ignore[arg-type,return-value]
    return ProcessGroupGradsync(StandInSession(collectives), "0")  # type: ignore[arg-type]


def test_all_reduces_are_in_flight_together_and_complete_in_order() -> None:
    link = RecordingLink()
    pg = group_over(link)
    try:
        tensors = [torch.full((4,), float(k)) for k in range(4)]
        works = [pg.allreduce([t], dist.AllreduceOptions()) for t in tensors]
        # Every input went out before any result came back: nothing was released yet.
        assert link.events == [("issue", k) for k in range(4)]
        # Issued on the caller's thread (no hop to the group's threads).
        assert set(link.threads.values()) == {threading.current_thread().name}
        assert not any(work.is_completed() for work in works)
        done_order: list[int] = []
        for k, work in enumerate(works):
            work.get_future().then(lambda _, k=k: done_order.append(k))
        for k in (3, 1, 2, 0):  # results arrive out of order ...
            link.release(k)
        for work in works:
            work.wait()
        assert done_order == [0, 1, 2, 3]  # ... and complete in issue order
        # ... by the thread that told each result (here the test's): no thread waited.
        assert pg._ops.completed_on_tell == 4
        assert [("result", k) for k in range(4)] == link.events[4:]
        for k, tensor in enumerate(tensors):  # written in place
            assert torch.equal(tensor, torch.full((4,), 2.0 * k))
    finally:
        for k in range(link.next_sequence):
            link.release(k)
        pg.shutdown()


def test_a_failure_fails_that_work_and_every_later_one() -> None:
    link = RecordingLink(fail=frozenset({1}))
    pg = group_over(link)
    try:
        works = [pg.allreduce([torch.ones(2)], dist.AllreduceOptions()) for _ in range(4)]
        for k in range(4):
            link.release(k)
        works[0].wait()
        messages = []
        for work in works[1:]:
            with pytest.raises(dist.DistBackendError) as caught:
                work.wait()
            with pytest.raises(RuntimeError):
                work.get_future().wait()  # the future DDP's reducer reads fails too
            messages.append(str(caught.value))
        assert "(operation 1 of the group) failed: " in messages[0]
        assert "the coordinator failed it: test" in messages[0]
        for k, message in zip((2, 3), messages[1:], strict=True):
            assert f"(operation {k} of the group) failed: " in message
            assert (
                "an earlier operation of the group, allreduce(sum, [2] float32) (operation 1)"
                in (message)
            )
        # An operation submitted after the failure fails the same way, without being issued.
        issued = link.next_sequence
        later = pg.allreduce([torch.ones(2)], dist.AllreduceOptions())
        with pytest.raises(dist.DistBackendError, match=r"operation 1\), failed"):
            later.wait()
        assert link.next_sequence == issued
    finally:
        for k in range(link.next_sequence):
            link.release(k)
        pg.shutdown()


def test_in_flight_is_bounded_and_the_rest_queue_in_order() -> None:
    link = RecordingLink()
    pg = group_over(link)
    try:
        bound = pg._ops.max_in_flight
        works = [pg.allreduce([torch.ones(1)], dist.AllreduceOptions()) for _ in range(bound + 3)]
        assert link.next_sequence == bound  # the rest wait for a slot, in order
        for k in range(bound + 3):
            link.release(k)
        for work in works:
            work.wait()
        assert [s for kind, s in link.events if kind == "issue"] == list(range(bound + 3))
        assert pg._ops.issued_inline == bound
    finally:
        for k in range(link.next_sequence):
            link.release(k)
        pg.shutdown()


def test_a_link_that_does_not_tell_still_completes_in_order() -> None:
    link = RecordingLink(tells=False)
    pg = group_over(link)
    try:
        tensors = [torch.full((2,), float(k)) for k in range(3)]
        works = [pg.allreduce([t], dist.AllreduceOptions()) for t in tensors]
        for k in (2, 0, 1):
            link.release(k)
        for work in works:
            work.wait()  # the completing thread waits for a result that is late
        assert [("result", k) for k in range(3)] == link.events[3:]
        assert pg._ops.completed_on_tell == 0
        for k, tensor in enumerate(tensors):
            assert torch.equal(tensor, torch.full((2,), 2.0 * k))
    finally:
        for k in range(link.next_sequence):
            link.release(k)
        pg.shutdown()


def test_a_result_that_never_comes_fails_its_work_within_the_timeout() -> None:
    link = RecordingLink()
    pg = group_over(link, timeout_s=2.0)
    try:
        work = pg.allreduce([torch.ones(2)], dist.AllreduceOptions())
        started = time.monotonic()
        with pytest.raises(dist.DistBackendError, match=r"operation 0 of the group\) failed"):
            work.wait()
        assert time.monotonic() - started < 2.0 + 2 * LATE_S
    finally:
        for k in range(link.next_sequence):
            link.release(k)
        pg.shutdown()
