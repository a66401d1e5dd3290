"""The refusal log: a flood of refusals on any port is a line per period, with its count."""

from __future__ import annotations

import logging

import pytest
from gradsync_server.rpc.auth_check import RefusalLog


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_refusals_on_every_port_share_one_line_per_period(caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock()
    refusals = RefusalLog(period_s=10.0, clock=clock)
    with caplog.at_level(logging.WARNING, logger="gradsync.server"):
        for index in range(500):
            refusals.note(
                "frame", f"ipv4:10.0.0.{index % 200}:5000", "no HELLO within the deadline"
            )
            refusals.note("gRPC", "'/gradsync.v1.Coordinator/Sync'", "wrong token")
            clock.now += 0.01  # 5 s in all: within one period
        assert refusals.lines == 1  # the first refusal's line
        clock.now += 10.0
        refusals.note("frame", "ipv4:10.0.0.7:5000", "wrong token")
    lines = [record.getMessage() for record in caplog.records]
    assert len(lines) == 2 and refusals.lines == 2, lines
    assert "refused 1 " in lines[0]
    # The second line counts everything since the first, by port, and names the latest.
    assert "refused 1000 " in lines[1], lines[1]
    assert "500 on the frame port" in lines[1] and "500 on the gRPC port" in lines[1]
    assert "in the last 15s" in lines[1], lines[1]
    assert "ipv4:10.0.0.7:5000 on the frame port: wrong token" in lines[1]
    assert refusals.total == {"frame": 501, "gRPC": 500}
