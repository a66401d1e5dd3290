"""The standby that was there all along wins the takeover (the churn soak's finding 3).

A supervisor restarts a SIGKILLed coordinator on its port within a fraction of a second,
well inside the lease's remaining life, so the restarted process and the standby both
wait for the same key to expire. They used to poll at the same pace, so which one won was
a coin toss (the restarted one won 3 of 8 in a soak; 6 of 7 in an earlier one). Now a
standby sleeps until just after the key's deadline, and one that came up less than a ttl
ago under another holder waits a poll interval more: the old standby takes over within
ttl + a poll interval of the kill, every time, even after a Redis restart.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest
from gradsync_proto.net.launch import free_port
from support.faults import wait_for
from support.redisserver import RedisServer

#: Long enough that a restarted coordinator is up well before the lease expires.
TTL_S = 3.0
#: `lease.poll_interval_s(TTL_S)`.
POLL_S = 0.5
#: Room for a loaded 2-core machine (process start, health probes over gRPC).
SLACK_S = 1.5
ROUNDS = 3


def _health(address: str) -> int:
    """1 SERVING, 2 NOT_SERVING, -1 nothing answers (over real gRPC)."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    try:
        with grpc.insecure_channel(address) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=""), timeout=2
            )
    except grpc.RpcError:
        return -1
    return int(reply.status)


@pytest.mark.timeout(240)
def test_the_old_standby_wins_over_a_restarted_coordinator_even_after_a_redis_restart(
    redis_server: RedisServer, coordinator_factory: Any, tmp_path: Path
) -> None:
    flags = ("--checkpoint-store", redis_server.url, "--lease-ttl-s", str(TTL_S))
    ports = [str(free_port()), str(free_port())]
    coordinators = [coordinator_factory(1, *flags, "--port", ports[0], "--lease")]
    wait_for(lambda: _health(coordinators[0].address) == 1, 30, "the first to take the lease")
    coordinators.append(coordinator_factory(1, *flags, "--port", ports[1], "--standby"))
    time.sleep(TTL_S + 1.0)  # the standby has watched the lease for more than a ttl

    # Redis dies and comes back at its address (AOF: the lease key and fence survive).
    assert redis_server.process is not None
    redis_server.process.kill()
    redis_server.process.wait()
    redis_server.start(same_port=True)
    time.sleep(TTL_S + 1.0)
    assert [_health(c.address) for c in coordinators] == [1, 2]

    took_over: list[float] = []
    active = 0
    for _ in range(ROUNDS):
        senior = 1 - active
        killed_at = time.monotonic()
        coordinators[active].process.kill()
        coordinators[active].process.wait()
        # The supervisor restarts it on its port at once (in the background, as the
        # banner takes a while: the takeover is timed meanwhile).
        restarted: list[Any] = []
        port = ports[active]

        def restart(restarted: list[Any] = restarted, port: str = port) -> None:
            restarted.append(coordinator_factory(1, *flags, "--port", port, "--standby"))

        starter = threading.Thread(target=restart)
        starter.start()
        wait_for(
            lambda old=coordinators[senior].address: _health(old) == 1,
            TTL_S + 30,
            "the old standby to take over",
        )
        took_over.append(time.monotonic() - killed_at)
        starter.join(timeout=60)
        assert restarted, "the killed coordinator did not start again"
        coordinators[active] = restarted[0]
        # The restarted one came up under the old lease: it stands by, it did not win.
        time.sleep(2 * POLL_S)
        assert _health(coordinators[active].address) == 2
        assert _health(coordinators[senior].address) == 1
        time.sleep(TTL_S + 0.5)  # the restarted one is a senior standby from now on
        active = senior
    assert max(took_over) <= TTL_S + POLL_S + SLACK_S, took_over
    for coordinator in coordinators:
        coordinator.stop()
    print(
        "the old standby took over "
        + ", ".join(f"{s:.2f}s" for s in took_over)
        + f" after SIGKILL (ttl {TTL_S:g}s, poll {POLL_S:g}s), each time racing the killed "
        "coordinator restarted on its port"
    )
