"""A leased coordinator with `--shards S` starts local shards its own leader accepts.

Found by the churn soak: a `--lease`/`--standby` leader starts its local shards only once
it holds the lease, and it started them with the caller's config, which lacks the shard
token `app.start` generated; every shard was refused ("must present the leader's shard
token") and restarted in a loop, so the job never started.
"""

from __future__ import annotations

from typing import Any

import pytest
from gradsync.status import query_status
from support.faults import HEARTBEAT, wait_for
from support.processes import children_of, running
from support.redisserver import RedisServer

pytest.importorskip("redis")


def _alive_shards(address: str) -> int:
    try:
        reply = query_status(address, "default", timeout_s=2)
    except ConnectionError:
        return 0
    return sum(1 for shard in reply.shards if shard.index > 0 and shard.alive)


@pytest.mark.timeout(90)
def test_a_leased_leader_registers_its_local_shards(
    redis_server: RedisServer, coordinator_factory: Any
) -> None:
    leader = coordinator_factory(
        2,
        "--checkpoint-store",
        redis_server.url,
        "--lease",
        "--lease-ttl-s",
        "1.5",
        "--shards",
        "3",
    )
    wait_for(lambda: _alive_shards(leader.address) == 2, 60, "both local shards to register")
    _, log = leader.stop()
    assert "refused this shard" not in log, log[-3000:]


@pytest.mark.timeout(180)
def test_a_demoted_leader_stops_its_shards_and_starts_new_ones_when_it_takes_over_again(
    redis_server: RedisServer, coordinator_factory: Any
) -> None:
    """SIGSTOP a leased leader with --shards 2 past its lease, SIGCONT: it stands by with no
    shard process left; SIGKILL the leader that took over: its shards die with it, and the
    first one takes the lease back and registers fresh shards."""
    import signal
    import time

    flags = (*HEARTBEAT, "--checkpoint-store", redis_server.url, "--lease-ttl-s", "1.5")
    flags += ("--shards", "2")
    first = coordinator_factory(2, *flags, "--lease")
    wait_for(lambda: _alive_shards(first.address) == 1, 60, "the first leader's shard")
    second = coordinator_factory(2, *flags, "--standby")
    assert children_of(second.process.pid) == []  # a standby runs no shard
    first.process.send_signal(signal.SIGSTOP)
    try:
        wait_for(lambda: _alive_shards(second.address) == 1, 60, "the second leader's shard")
    finally:
        first.process.send_signal(signal.SIGCONT)
    wait_for(lambda: children_of(first.process.pid) == [], 30, "the demoted one's shards to stop")
    assert first.process.poll() is None  # standing by, not exited
    victims = children_of(second.process.pid)
    assert len(victims) == 1
    second.process.kill()
    second.process.wait()
    wait_for(lambda: _alive_shards(first.address) == 1, 60, "the first leader's new shard")
    time.sleep(0.5)
    assert not [pid for pid in victims if running(pid)]  # gone with their leader
    code, log = first.stop()
    assert code == 0, log[-3000:]
    assert "standing by again" in log and "took over the lease with fence 3" in log, log[-3000:]
    assert "refused this shard" not in log, log[-3000:]
