"""A leased coordinator with `--shards S` starts local shards its own leader accepts.

Found by the churn soak: a `--lease`/`--standby` leader starts its local shards only once
it holds the lease, and it started them with the caller's config, which lacks the shard
token `start_server` generated; every shard was refused ("must present the leader's shard
token") and restarted in a loop, so the job never started.
"""

from __future__ import annotations

from typing import Any

import pytest
from gradsync.status import query_status
from support.faults import wait_for
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
