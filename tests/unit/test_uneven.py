"""join() over uneven inputs, against a scripted coordinator: what a rank that ran out sends,
how long it waits, and how every rank ends equal.
"""

from __future__ import annotations

import threading

import numpy as np
import numpy.typing as npt
import pytest
import torch
from gradsync.collectives import Collectives
from gradsync.errors import GradSyncError, SyncTimeoutError
from gradsync.uneven import join_context
from gradsync_proto.v1 import gradsync_pb2 as pb
from support.fakegroup import ThreadedGroup
from torch import nn

pytestmark = pytest.mark.unit


class JoinLink:
    """Answers OutOfInputs with scripted JoinProgress, and broadcasts from the group."""

    def __init__(self, group_link: object, script: list[tuple[float, pb.JoinProgress]]) -> None:
        self.group_link = group_link
        self.script = list(script)
        self.current_step = 0
        self.out_of_inputs: list[int] = []
        self.collective_sequence = 0
        self._queue: list[pb.JoinProgress] = []
        self._cond = threading.Condition()

    def send_out_of_inputs(self, step: int) -> None:
        self.out_of_inputs.append(step)
        elapsed = 0.0
        for delay, message in self.script:
            elapsed += delay
            threading.Timer(elapsed, self._deliver, args=(message,)).start()

    def _deliver(self, message: pb.JoinProgress) -> None:
        with self._cond:
            self._queue.append(message)
            self._cond.notify_all()

    def wait_join_progress(self, timeout_s: float) -> pb.JoinProgress:
        with self._cond:
            if not self._cond.wait_for(lambda: bool(self._queue), timeout_s):
                raise SyncTimeoutError(f"timed out after {timeout_s:g}s", rank=0)
            return self._queue.pop(0)

    def set_collective_sequence(self, sequence: int) -> None:
        self.collective_sequence = sequence
        self.group_link.set_collective_sequence(sequence)  # type: ignore[attr-defined]

    def run_collective(
        self,
        op: int,
        dtype: int,
        payload: npt.NDArray[np.uint8],
        root: int,
        timeout_s: float,
        *,
        result_bytes: int | None = None,
        template: object = None,
    ) -> tuple[bytearray, int]:
        return self.group_link.run_collective(  # type: ignore[attr-defined, no-any-return]
            op, dtype, payload, root, timeout_s, result_bytes=result_bytes, template=template
        )


class Wrapper:
    """What join() needs of the model wrapper."""

    def __init__(self, module: nn.Module, collectives: Collectives, step: int) -> None:
        self.module = module
        self.collectives = collectives
        self._step = step

    @property
    def step(self) -> int:
        return self._step

    @step.setter
    def step(self, value: int) -> None:
        self._step = value


def done(last: int, step: int, collective: int) -> pb.JoinProgress:
    return pb.JoinProgress(
        joined_ranks=[0, 1], all_joined=True, last_joiner=last, next_step=step,
        next_collective=collective,
    )  # fmt: skip


def make(rank: int, group: ThreadedGroup, script: list[tuple[float, pb.JoinProgress]],
         step: int, timeout_s: float = 5.0) -> tuple[Wrapper, JoinLink]:  # fmt: skip
    torch.manual_seed(rank)
    module = nn.Sequential(nn.Linear(3, 2), nn.BatchNorm1d(2))
    link = JoinLink(group.link(rank), script)
    collectives = Collectives(lambda: link, rank, group.world_size, timeout_s)  # type: ignore[arg-type, return-value]
    return Wrapper(module, collectives, step), link


def test_ranks_that_run_out_wait_for_the_last_then_adopt_its_state() -> None:
    group = ThreadedGroup(2)
    wrappers = {
        # Rank 0 ran out at step 3 and shadows two more steps of rank 1.
        0: make(0, group, [(0.05, pb.JoinProgress(joined_ranks=[0], next_step=4)),
                           (0.05, pb.JoinProgress(joined_ranks=[0], next_step=5)),
                           (0.05, done(1, 5, 9))], step=3),
        1: make(1, group, [(0.05, done(1, 5, 9))], step=5),
    }  # fmt: skip
    expected = [t.clone() for t in wrappers[1][0].module.state_dict().values()]

    def body(rank: int) -> None:
        with join_context(wrappers[rank][0]):
            pass

    group.run(body)
    for rank, (wrapper, link) in wrappers.items():
        assert link.out_of_inputs == [3 if rank == 0 else 5]
        assert wrapper.step == 5 and link.collective_sequence == 9
        for mine, theirs in zip(wrapper.module.state_dict().values(), expected, strict=True):
            assert torch.equal(mine, theirs)
    assert [(sequence, op) for sequence, op in group.log] == [(9, pb.COLLECTIVE_OP_BROADCAST)]


def test_each_progress_message_renews_the_deadline() -> None:
    group = ThreadedGroup(1)
    steps = [(0.2, pb.JoinProgress(joined_ranks=[0], next_step=s)) for s in range(1, 6)]
    wrapper, link = make(0, group, [*steps, (0.2, done(0, 6, 0))], step=0, timeout_s=0.5)
    with join_context(wrapper):  # 1.2 s in all, never 0.5 s without news
        pass
    assert wrapper.step == 6 and link.current_step == 5


def test_no_progress_within_the_timeout_names_the_step() -> None:
    wrapper, _ = make(0, ThreadedGroup(1), [], step=7, timeout_s=0.2)
    with (
        pytest.raises(SyncTimeoutError, match="out of inputs at step 7") as raised,
        join_context(wrapper),
    ):
        pass
    assert raised.value.step == 7 and raised.value.rank == 0


def test_an_exception_in_the_block_propagates_without_joining() -> None:
    wrapper, link = make(0, ThreadedGroup(1), [], step=2)
    with pytest.raises(KeyError), join_context(wrapper):
        raise KeyError("boom")
    assert link.out_of_inputs == []


def test_disabled_join_does_nothing() -> None:
    wrapper, link = make(0, ThreadedGroup(1), [], step=2)
    with join_context(wrapper, enable=False):
        pass
    assert link.out_of_inputs == []


def test_a_last_joiner_outside_the_job_is_an_error() -> None:
    wrapper, _ = make(0, ThreadedGroup(1), [(0.0, done(4, 1, 0))], step=0)
    with pytest.raises(GradSyncError, match="rank 4 as the last to join"), join_context(wrapper):
        pass


@pytest.mark.parametrize(
    ("option", "message"),
    [
        ({"divide_by_initial_world_size": False}, "divide_by_initial_world_size"),
        ({"throw_on_early_termination": True}, "throw_on_early_termination"),
    ],
)
def test_unsupported_options_are_refused(option: dict[str, bool], message: str) -> None:
    wrapper, _ = make(0, ThreadedGroup(1), [], step=0)
    with pytest.raises(ValueError, match=message), join_context(wrapper, **option):
        pass
