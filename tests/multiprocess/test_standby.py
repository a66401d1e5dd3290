"""The standby coordinator's lease against a real redis-server: one holder at a time, a
fence that grows with every holder, and writes of a holder that lost it refused by Redis."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest
from gradsync_server.store.lease import FencedWriteError, RedisLease, fence_script
from support.redisserver import RedisServer

redis = pytest.importorskip("redis")

_WRITE = fence_script("redis.call('SET', KEYS[1], ARGV[1])\nreturn 1")


def _client(server: RedisServer) -> redis.Redis:
    return redis.Redis.from_url(server.url, socket_timeout=5, socket_connect_timeout=5)


@pytest.mark.timeout(60)
def test_one_holder_at_a_time_and_the_fence_grows(redis_server: RedisServer) -> None:
    client = _client(redis_server)
    first = RedisLease(client, "coord-a", "127.0.0.1:1", ttl_s=0.6)
    second = RedisLease(client, "coord-b", "127.0.0.1:2", ttl_s=0.6)
    taken = first.try_acquire()
    assert taken is not None and taken.fence == 1
    assert second.try_acquire() is None  # split brain: the second stays a standby
    assert second.current() == taken
    assert first.renew()
    # The first stops renewing (as if SIGSTOPped): the key expires in Redis, the second
    # takes over with a larger fence.
    deadline = time.monotonic() + 10
    while (record := second.try_acquire()) is None:
        assert time.monotonic() < deadline, "the lease never expired"
        time.sleep(0.05)
    assert record.fence == 2 and record.holder == "coord-b"
    assert not first.renew()  # past its deadline: demoted without touching Redis
    assert first.held is None


@pytest.mark.timeout(60)
def test_a_demoted_holder_writes_nothing(redis_server: RedisServer) -> None:
    client = _client(redis_server)
    old = RedisLease(client, "coord-a", "127.0.0.1:1", ttl_s=30)
    new = RedisLease(client, "coord-b", "127.0.0.1:2", ttl_s=30)
    write = client.register_script(_WRITE)
    assert old.try_acquire() is not None
    assert old.fenced_call(write, keys=["ckpt"], args=["from-old"]) == 1
    # Someone else holds the lease now (the old one's key was taken over while it was
    # paused; its local timer has not noticed yet, so only Redis can refuse the write).
    client.delete(old.key)
    assert new.try_acquire() is not None
    with pytest.raises(FencedWriteError, match="fence 1 lost the lease"):
        old.fenced_call(write, keys=["ckpt"], args=["late-from-old"])
    assert old.refused_writes == 1 and old.held is None
    assert new.fenced_call(write, keys=["ckpt"], args=["from-new"]) == 1
    assert client.get("ckpt") == b"from-new"
    assert client.get(new.fence_key) == b"2"
    # A demoted one is refused locally too, and counted.
    with pytest.raises(FencedWriteError, match="holds no current lease"):
        old.fenced_call(write, keys=["ckpt"], args=["again"])
    assert old.refused_writes == 2 and client.get("ckpt") == b"from-new"


@pytest.mark.timeout(60)
def test_release_hands_over_at_once(redis_server_factory: Callable[..., RedisServer]) -> None:
    client = _client(redis_server_factory())
    first = RedisLease(client, "coord-a", "127.0.0.1:1", ttl_s=30)
    second = RedisLease(client, "coord-b", "127.0.0.1:2", ttl_s=30)
    assert first.try_acquire() is not None
    first.release()
    record = second.try_acquire()
    assert record is not None and record.fence == 2
