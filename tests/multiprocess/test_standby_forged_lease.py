"""A lease value no coordinator wrote does not keep the standbys out for ever.

Whoever can write to the Redis store can set the lease key to a value without a
deadline (`SET` with no `PX`), to one that does not parse, or to a well-formed one
with a fence the counter never issued. The holder that finds it is demoted (it cannot
tell a forgery from a takeover); a standby treats the value as expired once it has
stayed unchanged for the lease's ttl, logs an ERROR naming the key and why, and takes
the lease with the next fence. A real redis-server and the real standby loop.
"""

from __future__ import annotations

import asyncio
import logging
import time

import pytest
from gradsync_server import standby
from gradsync_server.rpc.standby_gate import StandbyGate
from gradsync_server.store.lease import LeaseRecord, RedisLease
from support.redisserver import RedisServer

redis = pytest.importorskip("redis")

TTL_S = 0.6


def _lease(server: RedisServer, holder: str) -> RedisLease:
    client = redis.Redis.from_url(server.url, socket_timeout=5, socket_connect_timeout=5)
    return RedisLease(client, holder, f"127.0.0.1:{len(holder)}", ttl_s=TTL_S)


async def _take_over(lease: RedisLease) -> tuple[LeaseRecord, float]:
    """Run the standby loop until it holds the lease: (its record, seconds it took)."""
    started = time.monotonic()
    record = await asyncio.wait_for(standby._stand_by(lease, StandbyGate(), time.monotonic), 15)
    return record, time.monotonic() - started


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("forged", "ttl", "why"),
    [
        ("7|intruder|10.9.9.9:50051", False, "no deadline"),
        ("not a lease at all", False, "is not 'fence|holder|address'"),
        ("1|intruder|10.9.9.9:50051", True, "its fence 1 is not the last one issued (1"),
    ],
    ids=["no-ttl", "garbage", "unknown-fence"],
)
def test_a_forged_lease_value_is_treated_as_expired_after_the_ttl_and_a_standby_takes_over(
    redis_server: RedisServer,
    caplog: pytest.LogCaptureFixture,
    forged: str,
    ttl: bool,
    why: str,
) -> None:
    active, waiting = _lease(redis_server, "coord-a"), _lease(redis_server, "coord-bb")
    held = active.try_acquire()
    assert held is not None and held.fence == 1
    if ttl:  # a second genuine holder came and went: the counter is at 2
        active.release()
        held = active.try_acquire()
        assert held is not None and held.fence == 2
        why = why.replace("(1", "(2")
    # The intruder overwrites the key (with a long deadline, or none at all).
    active.client.set(active.key, forged, px=600_000 if ttl else None)
    assert not active.renew() and active.held is None  # the holder is demoted
    with caplog.at_level(logging.ERROR, logger="gradsync.server.standby"):
        record, took_s = asyncio.run(_take_over(waiting))
    assert record.holder == "coord-bb" and record.fence == held.fence + 1
    # Not before a whole ttl of the forged value, and not much after.
    assert TTL_S <= took_s < TTL_S + 3, took_s
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1 and active.key in errors[0] and why in errors[0], errors
    assert "treated as expired" in errors[0]
    assert waiting.current() == record  # Redis holds the standby's value now, with a ttl
    assert 0 < waiting.client.pttl(waiting.key) <= TTL_S * 1000


@pytest.mark.timeout(60)
def test_a_genuine_holder_is_never_evicted_and_a_dead_one_is_warmed_up_for(
    redis_server: RedisServer,
) -> None:
    """The holder's own value, renewed, is never taken for a forgery by a standby. Once the
    holder stops renewing, the standby calls its warm-up (local shards) before the key
    expires, then takes over."""
    active, waiting = _lease(redis_server, "coord-a"), _lease(redis_server, "coord-bb")
    assert active.try_acquire() is not None
    calls: list[tuple[float, bool]] = []

    async def warm(late: bool) -> None:
        calls.append((time.monotonic(), late))

    async def scenario() -> tuple[LeaseRecord, float]:
        standing_by = asyncio.create_task(
            standby._stand_by(waiting, StandbyGate(), time.monotonic, warm)
        )
        for _ in range(int(4 * TTL_S / (TTL_S / 3))):  # four ttls of renewals
            await asyncio.sleep(TTL_S / 3)
            assert await asyncio.to_thread(active.renew)
        assert not standing_by.done()
        last_renewal = time.monotonic()  # the holder dies here
        record = await asyncio.wait_for(standing_by, 15)
        return record, last_renewal

    record, died = asyncio.run(scenario())
    assert record.holder == "coord-bb" and record.fence == 2
    took_over = time.monotonic()
    assert any(not late for _, late in calls), calls  # the renewals were seen as such
    late = [t for t, late in calls if late and t >= died]
    # Warmed up after the holder was late by half a ttl, and before the takeover.
    assert late and died + TTL_S / 2 - 0.05 <= late[0] < took_over, (calls, died, took_over)
