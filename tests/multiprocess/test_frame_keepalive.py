"""A frozen coordinator ends a worker's frame stream within the keepalive bound.

A SIGSTOPped coordinator's kernel still accepts a worker's bytes, so a plain
socket alone would wait for the step timeout. The frame stream keeps the gRPC
channel it asked for the frame port on open beside it, with gRPC's keepalive
pings (`FramePipe._watch_keepalive`); a real `gradsync serve` process
is frozen with a real signal, and the worker's next wait must fail with
CoordinatorUnavailableError (the error the model wrapper reconnects on), in
seconds, naming the keepalive.
"""

from __future__ import annotations

import signal
import time

import pytest
from gradsync.control.transport import Transport
from gradsync.errors import CoordinatorUnavailableError
from gradsync_proto.v1 import gradsync_pb2 as pb
from support.rawclient import signature

KEEPALIVE_S = 2.0


def test_a_frozen_coordinator_ends_the_frame_stream_in_seconds(
    coordinator_factory, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("GRADSYNC_KEEPALIVE_TIMEOUT_S", str(KEEPALIVE_S))
    coordinator = coordinator_factory(1)
    transport = Transport(coordinator.address, rank=0)
    try:
        join = pb.Join(job_id="frozen", rank=0, world_size=1, signature=signature())
        transport.open(join)
        transport.wait_welcome(timeout_s=30)
        assert transport._sync.pipe == "frames"
        coordinator.process.send_signal(signal.SIGSTOP)
        try:
            started = time.monotonic()
            with pytest.raises(CoordinatorUnavailableError) as raised:
                transport.wait_join_progress(timeout_s=60)
            waited = time.monotonic() - started
        finally:
            coordinator.process.send_signal(signal.SIGCONT)
        assert "keepalive" in str(raised.value)
        # A ping every 1 s, its ack awaited KEEPALIVE_S: found well before any step timeout.
        assert waited < KEEPALIVE_S + 8, waited
    finally:
        transport.close(timeout_s=5)
