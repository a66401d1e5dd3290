"""A "gradsync" group's link across a coordinator restart: ranks that disagree on what
completed, and a coordinator that never comes back.

Each rank's `ResumingLink` (the real one) runs over `HubLink`s of a `Hub`: a
coordinator in a box that pairs the ranks' inputs by sequence number, checks
that they agree (op and size: op N of one rank must never meet op N+1 of
another), sums them and tells each rank's hook as the transport's reading
thread does. `Hub.die` loses it as a SIGKILL would, after handing the last
collective's result to some ranks only; a second hub takes the job back at
the lowest collective the ranks claim, as the coordinator does
(`Collectives.resume`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
import torch
import torch.distributed as dist
from gradsync.collectives import Collectives
from gradsync.distributed import ProcessGroupGradsync
from gradsync.distributed.process_group import MAX_IN_FLIGHT
from gradsync.distributed.reconnect import KEEP_COMPLETED, ResumingLink
from gradsync.errors import ClosedError, CoordinatorUnavailableError
from gradsync_proto.v1 import gradsync_pb2 as pb

WORLD = 2
WAIT_S = 10.0
ADDRESS = "127.0.0.1:7"


class Hub:
    """Sums float32 inputs of `WORLD` ranks by sequence number, from `floor` on."""

    def __init__(self, floor: int = 0) -> None:
        self.floor = floor
        self.lock = threading.Lock()
        self.links: dict[int, HubLink] = {}
        self.inputs: dict[int, dict[int, tuple[int, bytes]]] = {}
        self.received: list[tuple[int, int, bytes]] = []
        self.dead = False
        #: Results withheld from ranks (`die`'s "sent to some only").
        self.withhold: set[int] = set()

    def link(self, rank: int) -> HubLink:
        link = HubLink(self, rank)
        self.links[rank] = link
        return link

    def take(self, rank: int, sequence: int, op: int, payload: bytes) -> None:
        with self.lock:
            assert sequence >= self.floor, f"rank {rank} sent {sequence} below {self.floor}"
            self.received.append((rank, sequence, payload))
            held = self.inputs.setdefault(sequence, {})
            held[rank] = (op, payload)
            if len(held) < WORLD:
                return
            (first_op, first), *others = held.values()
            for other_op, other in others:  # op N never meets op N+1: they differ in size
                assert (other_op, len(other)) == (first_op, len(first)), (sequence, held)
            total = sum(np.frombuffer(p, np.float32) for _, p in held.values())
            result = bytearray(np.asarray(total, np.float32).tobytes())
            to = [r for r in range(WORLD) if r not in self.withhold]
        for r in to:
            self.links[r].deliver(sequence, result)

    def die(self) -> None:
        """Lost (SIGKILL): every rank's stream fails; pending waits raise."""
        self.dead = True
        for link in list(self.links.values()):
            link.fail()


class HubLink:
    """The transport side `ResumingLink` drives: numbered issues, told results."""

    def __init__(self, hub: Hub, rank: int) -> None:
        self.hub, self.rank = hub, rank
        self.sequence = 0
        self.results: dict[int, bytearray] = {}
        self.hooks: dict[int, Callable[[], None]] = {}
        self.failed = False
        self.lock = threading.Lock()

    def set_collective_sequence(self, sequence: int) -> None:
        self.sequence = sequence

    def issue_collective(
        self,
        op: int,
        dtype: int,
        payload: npt.NDArray[np.uint8],
        root: int,
        *,
        result_bytes: int | None = None,
        template: object = None,
        on_ready: Callable[[], None] | None = None,
    ) -> int:
        sequence, self.sequence = self.sequence, self.sequence + 1
        assert on_ready is not None
        with self.lock:
            self.hooks[sequence] = on_ready
            failed = self.failed
        if failed:
            on_ready()  # a stream that already failed tells at once
        else:
            self.hub.take(self.rank, sequence, op, bytes(payload))
        return sequence

    def deliver(self, sequence: int, result: bytearray) -> None:
        with self.lock:
            self.results[sequence] = result
            hook = self.hooks.pop(sequence)
        hook()

    def fail(self) -> None:
        with self.lock:
            self.failed = True
            hooks, self.hooks = list(self.hooks.values()), {}
        for hook in hooks:
            hook()

    def wait_collective(self, sequence: int, timeout_s: float) -> tuple[bytearray, int]:
        with self.lock:
            if sequence in self.results:
                return self.results.pop(sequence), WORLD
        raise CoordinatorUnavailableError(f"the coordinator at {ADDRESS} ended the stream")

    def live_ranks(self) -> None:
        return None

    def close(self, timeout_s: float = 0.0) -> None:
        pass


class Restart:
    """The ranks' `rejoin`: a second hub once every rank has claimed where it stands."""

    def __init__(self, up: bool = True) -> None:
        self.up = up
        self.claims: dict[int, int] = {}
        self.hub: Hub | None = None
        self.assembled = threading.Condition()

    def rejoin(self, rank: int) -> Callable[[int, float], tuple[Any, pb.Welcome]]:
        def join(claim: int, timeout_s: float) -> tuple[Any, pb.Welcome]:
            if not self.up:
                raise CoordinatorUnavailableError(f"could not reach the coordinator at {ADDRESS}")
            with self.assembled:
                self.claims[rank] = claim
                if len(self.claims) == WORLD:
                    self.hub = Hub(floor=min(self.claims.values()))
                    self.assembled.notify_all()
                assert self.assembled.wait_for(lambda: self.hub is not None, timeout_s)
                assert self.hub is not None
                link = self.hub.link(rank)
            return link, pb.Welcome(next_collective=self.hub.floor)

        return join


def values(sequence: int, rank: int) -> npt.NDArray[np.uint8]:
    """Rank `rank`'s input to collective `sequence`: sequence + 1 float32s."""
    return np.full(sequence + 1, 10.0 * sequence + rank, np.float32).view(np.uint8)


def expected(sequence: int) -> list[float]:
    return [float(sum(10.0 * sequence + r for r in range(WORLD)))] * (sequence + 1)


def summed(link: ResumingLink, sequence: int) -> list[float]:
    data, contributors = link.wait_collective(sequence, WAIT_S)
    assert contributors == WORLD
    return np.frombuffer(bytes(data), np.float32).tolist()


SUM = pb.COLLECTIVE_OP_SUM
F32 = pb.DTYPE_FLOAT32


@pytest.mark.parametrize("taken", [True, False], ids=["result-taken", "result-not-yet-taken"])
def test_ranks_that_disagree_on_what_completed_resend_from_the_lowest_claim(taken: bool) -> None:
    first, restart = Hub(), Restart()
    links = [
        ResumingLink(first.link(r), 0, restart.rejoin(r), ADDRESS, r, reconnect_timeout_s=WAIT_S)
        for r in range(WORLD)
    ]
    for sequence in range(2):  # both ranks have 0 and 1
        issued = [
            link.issue_collective(SUM, F32, values(sequence, r), 0) for r, link in enumerate(links)
        ]
        assert issued == [sequence] * WORLD
        assert [summed(link, sequence) for link in links] == [expected(sequence)] * WORLD
    # Collective 2's result reaches rank 0, not rank 1, and the coordinator dies.
    first.withhold = {1}
    for r, link in enumerate(links):
        link.issue_collective(SUM, F32, values(2, r), 0)
    if taken:  # else its result waits in the link, taken only after the restart
        assert summed(links[0], 2) == expected(2)
    first.die()
    # Rank 0 goes on to collective 3 (issued on the dead stream, it reconnects);
    # rank 1 still waits for 2, then issues 3.
    links[0].issue_collective(SUM, F32, values(3, 0), 0)
    assert summed(links[1], 2) == expected(2)
    links[1].issue_collective(SUM, F32, values(3, 1), 0)
    assert [summed(link, 3) for link in links] == [expected(3)] * WORLD
    if not taken:
        assert summed(links[0], 2) == expected(2)
    # Rank 0 claimed 3 and rank 1 claimed 2: the job went on from 2, rank 0 sending
    # its input of 2 again (kept, or not yet overwritten; not its result), every rank
    # once per collective.
    assert restart.claims == {0: 3, 1: 2}
    second = restart.hub
    assert second is not None and second.floor == 2
    assert sorted((r, s) for r, s, _ in second.received) == [(0, 2), (0, 3), (1, 2), (1, 3)]
    kept = [p for r, s, p in second.received if (r, s) == (0, 2)]
    assert kept == [values(2, 0).tobytes()]
    assert [link.reconnects for link in links] == [1, 1]
    # A rank behind has at most MAX_IN_FLIGHT collectives outstanding: the rank ahead
    # keeps the inputs of that many completed ones.
    assert KEEP_COMPLETED >= MAX_IN_FLIGHT


def test_a_coordinator_that_does_not_come_back_fails_the_pending_work_naming_it() -> None:
    hub, restart = Hub(), Restart(up=False)
    link = ResumingLink(hub.link(0), 0, restart.rejoin(0), ADDRESS, 0, reconnect_timeout_s=0.6)
    collectives = Collectives(lambda: link, 0, WORLD, timeout_s=WAIT_S)  # type: ignore[arg-type,return-value]
    session = type("Session", (), {"collectives": collectives, "rank": 0, "world_size": WORLD})()
    session.job_id, session.address, session.close = "job.pg-world", ADDRESS, lambda: None
    session.shard_routes = None  # an unsharded coordinator
    group = ProcessGroupGradsync(session, "0")
    try:
        work = group.allreduce([torch.ones(3)])  # rank 1 never sends: it stays pending
        hub.die()
        with pytest.raises(dist.DistBackendError) as failed:
            work.wait()
        message = str(failed.value)
        assert "allreduce" in message and "collective 0 (sum)" in message, message
        assert f"lost the coordinator at {ADDRESS}" in message, message
        assert "did not come back within 0.6s" in message, message
        # And every later one, at once.
        with pytest.raises(dist.DistBackendError, match=f"lost the coordinator at {ADDRESS}"):
            group.allreduce([torch.ones(3)]).wait()
    finally:
        group.shutdown()


def test_shutting_the_group_down_fails_a_collective_still_pending() -> None:
    hub = Hub()
    link = ResumingLink(hub.link(0), 0, Restart().rejoin(0), ADDRESS, 0, reconnect_timeout_s=WAIT_S)
    link.issue_collective(SUM, F32, values(0, 0), 0)  # rank 1 never sends
    link.close(1.0)
    with pytest.raises(ClosedError, match="collective 0 \\(sum\\) did not complete: the process"):
        link.wait_collective(0, WAIT_S)
    with pytest.raises(ClosedError, match="shut down"):
        link.issue_collective(SUM, F32, values(1, 0), 0)
