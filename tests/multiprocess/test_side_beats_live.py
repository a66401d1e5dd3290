"""A worker on the frame port beats on its side channel; on gRPC only it does not.

A real `gradsync serve` process on loopback and the real `Transport`: once the
job has started, the coordinator accepts the worker's `Beat`s (the transport
counts the accepted ones) and the rank stays a member past the heartbeat
timeout while it says nothing else; with `GRADSYNC_FRAMES=0` the stream runs on
gRPC, no beat is sent, and the Sync stream's heartbeats keep the rank alive as
they always did.
"""

from __future__ import annotations

import time

import pytest
from gradsync.control.transport import Transport
from gradsync_proto.v1 import gradsync_pb2 as pb
from support.rawclient import signature

TIMEOUT_S = 1.5


@pytest.mark.parametrize("frames", [True, False])
def test_heartbeats_go_beside_the_frames(
    coordinator_factory, monkeypatch: pytest.MonkeyPatch, frames: bool
) -> None:
    if not frames:
        monkeypatch.setenv("GRADSYNC_FRAMES", "0")
    coordinator = coordinator_factory(1, "--heartbeat-timeout", f"{TIMEOUT_S:g}")
    transport = Transport(coordinator.address, rank=0)
    try:
        join = pb.Join(job_id="beats", rank=0, world_size=1, signature=signature())
        transport.open(join)
        transport.wait_welcome(timeout_s=30)
        assert transport._sync.pipe == ("frames" if frames else "grpc")
        time.sleep(2 * TIMEOUT_S + 0.5)
        # Still a member: a rank declared dead has its stream ended (DECLARED_DEAD).
        assert transport._sync.ended is None, transport._sync.ended
        accepted = transport._side_beats.accepted
        if frames:
            assert accepted >= 3, accepted
        else:
            assert accepted == 0
    finally:
        transport.close(timeout_s=5)
