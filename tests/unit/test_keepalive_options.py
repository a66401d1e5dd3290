"""The worker's keepalive ack timeout: its default, its override and what is refused.

A slow link shared by many ranks queues a ping and its ack behind megabytes of
gradients; 3 s was too short for `gradsync bench`'s 8 ranks on one 200 Mbit/s
coordinator link (a healthy stream was ended as frozen), so the default is
longer and `GRADSYNC_KEEPALIVE_TIMEOUT_S` tunes it.
"""

from __future__ import annotations

import pytest
from gradsync import defaults
from gradsync.path.shard_streams import (
    ENV_KEEPALIVE_TIMEOUT_S,
    KEEPALIVE_TIME_MS,
    channel_options,
    keepalive_timeout_s,
)

pytestmark = pytest.mark.unit


def _option(options: list[tuple[str, int]], name: str) -> int:
    values = [value for key, value in options if key == name]
    assert len(values) == 1, f"{name} set {len(values)} times"
    return values[0]


def test_the_default_leaves_a_slow_shared_link_room_and_still_finds_a_frozen_coordinator() -> None:
    options = channel_options({})
    timeout_ms = round(defaults.KEEPALIVE_TIMEOUT_S * 1000)
    # Both gRPC knobs: gRPC >= 1.5x waits `ping_timeout_ms` whatever the keepalive says.
    assert _option(options, "grpc.keepalive_timeout_ms") == timeout_ms
    assert _option(options, "grpc.http2.ping_timeout_ms") == timeout_ms
    assert _option(options, "grpc.keepalive_time_ms") == KEEPALIVE_TIME_MS
    assert 10_000 <= timeout_ms < round(defaults.TIMEOUT_S * 1000) / 10


def test_the_environment_overrides_the_ack_timeout() -> None:
    options = channel_options({ENV_KEEPALIVE_TIMEOUT_S: "42.5"})
    assert _option(options, "grpc.keepalive_timeout_ms") == 42_500
    assert _option(options, "grpc.http2.ping_timeout_ms") == 42_500
    assert keepalive_timeout_s({ENV_KEEPALIVE_TIMEOUT_S: ""}) == defaults.KEEPALIVE_TIMEOUT_S


@pytest.mark.parametrize("raw", ["abc", "0.5", "0", "-3", "nan"])
def test_a_bad_override_is_refused_naming_the_variable_and_the_value(raw: str) -> None:
    with pytest.raises(ValueError, match=f"{ENV_KEEPALIVE_TIMEOUT_S}='{raw}'"):
        channel_options({ENV_KEEPALIVE_TIMEOUT_S: raw})
