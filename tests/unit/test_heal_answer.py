"""A donor's wait for the coordinator's answer to the state it sent (`Inbox.wait_heal_answer`).

The donor of a rejoining rank uploads nothing of the step until the coordinator
admitted the newcomers (a MembershipChanged past the epoch its state went out in)
or asked for the state again; with neither it gives up after its bound. Messages
are fed to a real `Inbox` as the I/O thread would, from another thread.
"""

from __future__ import annotations

import threading
import time

from gradsync.control.inbox import Inbox
from gradsync_proto.v1 import gradsync_pb2 as pb


def _welcome(epoch: int) -> bytes:
    welcome = pb.Welcome(job_id="default", world_size=3, membership_epoch=epoch, chunk_bytes=1024)
    return pb.CoordinatorMessage(welcome=welcome).SerializeToString()


def _state_request(for_rank: int = 2) -> bytes:
    request = pb.StateRequest(for_rank=for_rank)
    return pb.CoordinatorMessage(state_request=request).SerializeToString()


def _membership(epoch: int, ranks: list[int]) -> bytes:
    change = pb.MembershipChanged(membership_epoch=epoch, ranks=ranks, step=7, reason="test")
    return pb.CoordinatorMessage(membership=change).SerializeToString()


def _later(inbox: Inbox, raw: bytes, after_s: float) -> threading.Thread:
    thread = threading.Timer(after_s, inbox.on_message, args=(raw,))
    thread.start()
    return thread


def _donor(epoch: int = 3) -> Inbox:
    inbox = Inbox("127.0.0.1:1", rank=0)
    inbox.on_message(_welcome(epoch))
    inbox.on_message(_state_request())
    assert inbox.take_heal_request()  # the state goes out in this epoch
    return inbox


def test_the_donor_waits_for_the_membership_change_that_admits_the_newcomer() -> None:
    inbox = _donor()
    started = time.monotonic()
    thread = _later(inbox, _membership(4, [0, 1, 2]), 0.3)
    assert inbox.wait_heal_answer(7, timeout_s=10.0)
    waited = time.monotonic() - started
    thread.join()
    assert 0.25 <= waited < 5.0, waited


def test_a_change_already_in_before_the_state_went_out_is_no_answer() -> None:
    inbox = Inbox("127.0.0.1:1", rank=0)
    inbox.on_message(_welcome(3))
    inbox.on_message(_membership(4, [0, 1]))  # a rank lost: before the request
    inbox.on_message(_state_request())
    assert inbox.take_heal_request()
    assert not inbox.wait_heal_answer(7, timeout_s=0.2)


def test_a_new_request_for_the_state_ends_the_wait_and_stays_to_be_taken() -> None:
    inbox = _donor()
    thread = _later(inbox, _state_request(), 0.1)
    assert inbox.wait_heal_answer(7, timeout_s=10.0)
    thread.join()
    assert inbox.take_heal_request()  # the next step boundary sends the state again


def test_an_abort_of_the_step_ends_the_wait() -> None:
    inbox = _donor()
    aborted = pb.StepAborted(step=7, code=10, message="a shard refused a chunk")
    raw = pb.CoordinatorMessage(step_aborted=aborted).SerializeToString()
    thread = _later(inbox, raw, 0.1)
    assert inbox.wait_heal_answer(7, timeout_s=10.0)
    thread.join()


def test_without_an_answer_the_wait_gives_up_after_its_bound() -> None:
    inbox = _donor()
    started = time.monotonic()
    assert not inbox.wait_heal_answer(7, timeout_s=0.3)
    assert 0.25 <= time.monotonic() - started < 5.0


def test_a_rank_that_sent_no_state_does_not_wait() -> None:
    inbox = Inbox("127.0.0.1:1", rank=1)
    inbox.on_message(_welcome(0))
    assert inbox.wait_heal_answer(7, timeout_s=30.0)
