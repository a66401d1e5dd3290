"""The receive side of the Sync stream, driven message by message (no network).

`Inbox` is fed serialized CoordinatorMessages directly; the stream-end tests
run the Sync stream's reader over a scripted call, so the path from the
coordinator's last message and status to the exception a waiter gets is the
production one.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc
import pytest
from gradsync.control.inbox import Inbox
from gradsync.control.transport import Transport
from gradsync.errors import (
    CheckpointFailedError,
    CoordinatorUnavailableError,
    DeclaredDeadError,
    GradSyncError,
    JoinRefusedError,
    PeerLostError,
    ResourceExhaustedError,
    SyncTimeoutError,
)
from gradsync_proto.codes import Code
from gradsync_proto.net.stream_client import GrpcPipe
from gradsync_proto.v1 import gradsync_pb2 as pb


def test_state_arriving_before_anyone_waits_for_it_is_kept() -> None:
    # Under load, rank 0's broadcast can overtake the worker's call to
    # receive_state(); the chunks must land, not be reported as out of range.
    inbox = Inbox("127.0.0.1:1", rank=1)
    welcome = pb.CoordinatorMessage(welcome=pb.Welcome(state_bytes=6, chunk_bytes=4))
    inbox.on_message(welcome.SerializeToString())
    for offset, payload in ((0, b"abcd"), (4, b"ef")):
        chunk = pb.CoordinatorMessage(state=pb.StateChunk(offset=offset, payload=payload))
        inbox.on_message(chunk.SerializeToString())
    assert bytes(inbox.receive_state(6, timeout_s=1)) == b"abcdef"


def test_waiting_for_missing_state_times_out_with_a_clear_error() -> None:
    inbox = Inbox("127.0.0.1:1", rank=1)
    welcome = pb.CoordinatorMessage(welcome=pb.Welcome(state_bytes=6, chunk_bytes=4))
    inbox.on_message(welcome.SerializeToString())
    with pytest.raises(SyncTimeoutError, match="rank 0's state"):
        inbox.receive_state(6, timeout_s=0.2)


class ScriptedCall:
    """Stands in for the gRPC call: yields `messages`, then ends with `status` (or OK)."""

    def __init__(self, messages: list[pb.CoordinatorMessage], status: Code | None) -> None:
        self._messages = [m.SerializeToString() for m in messages]
        self._status = status

    def __aiter__(self) -> AsyncIterator[bytes]:
        return self._replay()

    def cancel(self) -> bool:
        """As grpc.aio's call: the transport cancels its call when it closes."""
        return False

    async def _replay(self) -> AsyncIterator[bytes]:
        for raw in self._messages:
            yield raw
        if self._status is not None:
            raise grpc.aio.AioRpcError(
                grpc.StatusCode[self._status.name], details=f"{self._status.name} details"
            )


def end_stream(messages: list[pb.CoordinatorMessage], status: Code | None) -> GradSyncError:
    """Play a stream's last messages and end through the transport; return what waiters get."""
    transport = Transport("127.0.0.1:1", rank=2)
    try:
        transport.configure_buckets([8])  # so that step 3 waits for something
        pipe = GrpcPipe()
        pipe._call = ScriptedCall(messages, status)
        transport._run(pipe._read(transport._sync), timeout_s=5)
        with pytest.raises(GradSyncError) as raised:
            transport.wait_step(3, timeout_s=1)
        return raised.value
    finally:
        transport.close(timeout_s=2)


def stream_end(reason: int, code: Code, message: str) -> pb.CoordinatorMessage:
    return pb.CoordinatorMessage(
        stream_end=pb.StreamEnd(reason=reason, code=code, message=message)  # type: ignore[arg-type]
    )


@pytest.mark.parametrize(
    ("reason", "status", "expected"),
    [
        (pb.END_REASON_DECLARED_DEAD, Code.UNAVAILABLE, DeclaredDeadError),
        (pb.END_REASON_CHECKPOINT_FAILED, Code.UNAVAILABLE, CheckpointFailedError),
        (pb.END_REASON_SHUTTING_DOWN, Code.UNAVAILABLE, CoordinatorUnavailableError),
        (pb.END_REASON_JOB_REFUSED, Code.INVALID_ARGUMENT, JoinRefusedError),
        (pb.END_REASON_PEER_LOST, Code.ABORTED, PeerLostError),
        (pb.END_REASON_RESOURCE_EXHAUSTED, Code.RESOURCE_EXHAUSTED, ResourceExhaustedError),
    ],
)
def test_a_stream_end_decides_the_error_of_the_status_that_follows(
    reason: int, status: Code, expected: type[GradSyncError]
) -> None:
    error = end_stream([stream_end(reason, status, "why")], status)
    assert type(error) is expected
    assert error.rank == 2 and error.code is status
    assert f"{status.name}: why" in str(error)
    assert isinstance(error.__cause__, grpc.aio.AioRpcError)


def test_the_stream_ends_words_win_over_a_status_the_transport_replaced() -> None:
    # Seen in CI: the coordinator ended the stream cleanly after its StreamEnd, but
    # the client's gRPC reported INTERNAL "Internal error from Core" instead.
    message = "checkpoint of step 40 failed and --require-checkpoint is set: store down"
    end = stream_end(pb.END_REASON_CHECKPOINT_FAILED, Code.FAILED_PRECONDITION, message)
    error = end_stream([end], Code.INTERNAL)
    assert type(error) is CheckpointFailedError
    assert error.code is Code.FAILED_PRECONDITION and message in str(error)


def test_unavailable_without_a_stream_end_is_a_lost_coordinator() -> None:
    error = end_stream([], Code.UNAVAILABLE)
    assert type(error) is CoordinatorUnavailableError


def test_a_stream_end_followed_by_a_clean_close_still_names_the_reason() -> None:
    # The status is lost or OK, but the coordinator said why it was leaving.
    message = "rank 2 was declared dead after 5s without a heartbeat"
    error = end_stream([stream_end(pb.END_REASON_DECLARED_DEAD, Code.UNAVAILABLE, message)], None)
    assert type(error) is DeclaredDeadError
    assert error.code is Code.UNAVAILABLE and message in str(error)


def test_a_clean_close_without_a_stream_end_is_a_lost_coordinator() -> None:
    error = end_stream([], None)
    assert type(error) is CoordinatorUnavailableError and "ended the stream" in str(error)


def test_an_end_reason_this_client_does_not_know_falls_back_to_the_status() -> None:
    error = end_stream([stream_end(42, Code.ALREADY_EXISTS, "?")], Code.ALREADY_EXISTS)
    assert type(error) is JoinRefusedError
