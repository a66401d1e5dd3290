"""`error_from_status`, the one boundary between a stream's end and user-facing exceptions."""

from __future__ import annotations

import gradsync
import pytest
from gradsync.errors import error_from_status
from gradsync_proto.codes import Code
from gradsync_proto.v1 import gradsync_pb2 as pb

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    ("reason", "code", "expected"),
    [
        (pb.END_REASON_DECLARED_DEAD, Code.UNAVAILABLE, gradsync.DeclaredDeadError),
        (pb.END_REASON_CHECKPOINT_FAILED, Code.UNAVAILABLE, gradsync.CheckpointFailedError),
        (pb.END_REASON_SHUTTING_DOWN, Code.UNAVAILABLE, gradsync.CoordinatorUnavailableError),
        (pb.END_REASON_JOB_REFUSED, Code.INVALID_ARGUMENT, gradsync.JoinRefusedError),
        (pb.END_REASON_PEER_LOST, Code.ABORTED, gradsync.PeerLostError),
        (
            pb.END_REASON_RESOURCE_EXHAUSTED,
            Code.RESOURCE_EXHAUSTED,
            gradsync.ResourceExhaustedError,
        ),
    ],
)
def test_the_end_reason_picks_the_exception(
    reason: int, code: Code, expected: type[gradsync.GradSyncError]
) -> None:
    error = error_from_status(code, "rank 1 went quiet", reason=reason, rank=1, step=4)
    assert type(error) is expected
    assert error.code is code and (error.rank, error.step) == (1, 4)
    assert str(error) == f"[rank 1, step 4] {code.name}: rank 1 went quiet"


@pytest.mark.parametrize("reason", [None, pb.END_REASON_UNSPECIFIED, 999])
def test_without_a_known_reason_the_status_code_decides(reason: int | None) -> None:
    # No StreamEnd (an older coordinator, or a connection that simply broke).
    assert type(error_from_status(Code.UNAVAILABLE, "x", reason=reason)) is (
        gradsync.CoordinatorUnavailableError
    )
    assert type(error_from_status(Code.ALREADY_EXISTS, "x", reason=reason)) is (
        gradsync.JoinRefusedError
    )
    assert type(error_from_status(Code.INTERNAL, "x", reason=reason)) is gradsync.GradSyncError


def test_an_unknown_status_code_is_unknown_not_a_crash() -> None:
    error = error_from_status(77, "from the future")
    assert type(error) is gradsync.GradSyncError and error.code is Code.UNKNOWN


@pytest.mark.parametrize(
    "cls",
    [
        gradsync.DeclaredDeadError,
        gradsync.CheckpointFailedError,
        gradsync.JoinRefusedError,
        gradsync.ResourceExhaustedError,
        gradsync.PeerLostError,
    ],
)
def test_only_a_lost_coordinator_is_a_coordinator_unavailable_error(
    cls: type[gradsync.GradSyncError],
) -> None:
    # The model wrapper reconnects on CoordinatorUnavailableError: a rank that
    # was declared dead or refused must not try to sneak back in.
    assert issubclass(cls, gradsync.GradSyncError)
    assert not issubclass(cls, gradsync.CoordinatorUnavailableError)


def test_new_exceptions_are_exported() -> None:
    for name in ("DeclaredDeadError", "ResourceExhaustedError"):
        assert name in gradsync.__all__ and hasattr(gradsync, name)
