"""Transport regressions that need exact message orderings (driven directly, no network)."""

from __future__ import annotations

import pytest
from gradsync.errors import SyncTimeoutError
from gradsync.transport import Transport
from gradsync.v1 import gradsync_pb2 as pb


def test_state_arriving_before_anyone_waits_for_it_is_kept() -> None:
    # Under load, rank 0's broadcast can overtake the worker's call to
    # receive_state(); the chunks must land, not be reported as out of range.
    transport = Transport("127.0.0.1:1", rank=1)
    try:
        welcome = pb.CoordinatorMessage(welcome=pb.Welcome(state_bytes=6, chunk_bytes=4))
        transport._on_message(welcome.SerializeToString())
        for offset, payload in ((0, b"abcd"), (4, b"ef")):
            chunk = pb.CoordinatorMessage(state=pb.StateChunk(offset=offset, payload=payload))
            transport._on_message(chunk.SerializeToString())
        assert bytes(transport.receive_state(6, timeout_s=1)) == b"abcdef"
    finally:
        transport.close(timeout_s=2)


def test_waiting_for_missing_state_times_out_with_a_clear_error() -> None:
    transport = Transport("127.0.0.1:1", rank=1)
    try:
        welcome = pb.CoordinatorMessage(welcome=pb.Welcome(state_bytes=6, chunk_bytes=4))
        transport._on_message(welcome.SerializeToString())
        with pytest.raises(SyncTimeoutError, match="rank 0's state"):
            transport.receive_state(6, timeout_s=0.2)
    finally:
        transport.close(timeout_s=2)
