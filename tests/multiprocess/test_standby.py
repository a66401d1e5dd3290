"""The standby coordinator's lease against a real redis-server: one holder at a time, a
fence that grows with every holder, and writes of a holder that lost it refused by Redis."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from gradsync_server.store.lease import FencedWriteError, RedisLease, fence_script
from support.faults import HEARTBEAT, assert_matches_reference, finish, job_status, wait_for
from support.processes import start_workers
from support.redisserver import RedisServer
from support.shards import ShardProcess, wait_for_shards

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


def _health(address: str) -> int:
    """The coordinator's health status (1 SERVING, 2 NOT_SERVING) over real gRPC."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(address) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=""), timeout=5
        )
    return int(reply.status)


@pytest.mark.timeout(240)
def test_standby_takes_over_and_the_workers_follow_it(
    redis_server: RedisServer, tmp_path: Path, coordinator_factory: Any
) -> None:
    flags = (*HEARTBEAT, "--checkpoint-store", redis_server.url, "--checkpoint-every", "3")
    lease = ("--lease-ttl-s", "1.5")
    active = coordinator_factory(2, *flags, *lease, "--lease")
    wait_for(lambda: _health(active.address) == 1, 30, "the first coordinator to take the lease")
    standby = coordinator_factory(2, *flags, *lease, "--standby")
    time.sleep(1.0)  # several polls: it must stay a standby while the lease is renewed
    assert _health(standby.address) == 2
    both = f"{active.address},{standby.address}"
    processes = start_workers(both, 2, tmp_path, 12, None, "--step-delay-s", "0.3")

    def checkpoint_at_least_3() -> bool:
        job = job_status(active.address)
        return bool(job and job.last_checkpoint_step >= 3 and job.open_step >= 5)

    wait_for(checkpoint_at_least_3, 90, "a durable checkpoint and two more steps")
    before = job_status(active.address)
    assert before is not None
    killed_at = time.monotonic()
    active.process.kill()
    active.process.wait()
    wait_for(lambda: _health(standby.address) == 1, 30, "the standby to take over")
    took_over_s = time.monotonic() - killed_at

    def training_again() -> bool:
        job = job_status(standby.address)
        return bool(job and job.state == "running" and job.open_step > before.open_step)

    wait_for(training_again, 60, "the workers to train on the standby")
    training_s = time.monotonic() - killed_at
    reports = finish(processes, tmp_path, timeout_s=150)
    for report in reports:
        assert report is not None and report["status"] == "ok", report
        # No rollback, and the step in flight was uploaded again, not computed again.
        assert len(report["restarts"]) <= 1, report["restarts"]
        assert report["computed"][0] == 12, report  # no step computed twice
        assert_matches_reference(report, 2, 12)
    _, log = standby.stop()
    assert "took over the lease with fence 2" in log, log
    assert "from the ranks' own state" in log, log[-3000:]
    print(
        f"standby SERVING {took_over_s:.2f}s and training (a step past {before.open_step}) "
        f"{training_s:.2f}s after SIGKILL of the active coordinator"
    )


@pytest.mark.timeout(120)
def test_split_brain_two_leased_coordinators_one_serves(
    redis_server: RedisServer, coordinator_factory: Any
) -> None:
    flags = ("--checkpoint-store", redis_server.url, "--lease", "--lease-ttl-s", "1.5")
    first = coordinator_factory(1, *flags)
    second = coordinator_factory(1, *flags)
    time.sleep(2.0)  # past the first renewals and many standby polls
    states = sorted([_health(first.address), _health(second.address)])
    assert states == [1, 2], states
    client = _client(redis_server)
    assert client.get("gradsync:lease:coordinator:fence") == b"1"
    for coordinator in (first, second):
        coordinator.stop()


def test_a_file_store_with_standby_is_refused(tmp_path: Path) -> None:
    import subprocess
    import sys

    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "gradsync.cli",
            "serve",
            "--world-size",
            "1",
            "--port",
            "0",
            "--checkpoint-store",
            str(tmp_path / "ckpt"),
            "--standby",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2 and "need a redis://" in done.stderr, done.stderr


@pytest.mark.timeout(60)
def test_the_checkpoint_store_of_a_demoted_coordinator_is_fenced_in_redis(
    redis_server: RedisServer,
) -> None:
    from gradsync_server.store.checkpoint import Checkpoint, CheckpointError
    from gradsync_server.store.checkpoint_redis import RedisCheckpointStore

    client = _client(redis_server)
    old = RedisLease(client, "coord-a", "127.0.0.1:1", ttl_s=30)
    new = RedisLease(client, "coord-b", "127.0.0.1:2", ttl_s=30)
    assert old.try_acquire() is not None

    def checkpoint(step: int, payload: bytes) -> Checkpoint:
        return Checkpoint("job", step, 0, payload, {"world_size": "2"})

    with (
        RedisCheckpointStore(redis_server.url) as old_store,
        RedisCheckpointStore(redis_server.url) as new_store,
    ):
        old_store.fence, new_store.fence = old.write_token, new.write_token
        old_store.save(checkpoint(3, b"old"))
        old_store.save_record("job", "outer0", [b"old-record"])
        # The old coordinator was paused past its lease; the standby took it over.
        client.delete(old.key)
        assert new.try_acquire() is not None
        with pytest.raises(CheckpointError, match="FENCED"):
            old_store.save(checkpoint(6, b"late-from-old"))
        with pytest.raises(CheckpointError, match="FENCED"):
            old_store.save_record("job", "outer0", [b"late-record"])
        assert client.get("gradsync:ckpt:job:latest") == b"3"
        assert client.get("gradsync:ckpt:job:6") is None  # not even the blob
        assert client.get("gradsync:ckpt:job:outer0") == b"old-record"
        new_store.save(checkpoint(6, b"new"))  # the active one writes as before
        assert client.get("gradsync:ckpt:job:latest") == b"6"
        # A coordinator that knows it holds no lease sends nothing at all.
        new.release()
        with pytest.raises(CheckpointError, match="holds no current lease"):
            new_store.save(checkpoint(9, b"after-release"))
        assert client.get("gradsync:ckpt:job:latest") == b"6"


@pytest.mark.timeout(240)
def test_a_dedicated_shard_follows_the_standby_that_took_over(
    redis_server: RedisServer, tmp_path: Path, coordinator_factory: Any
) -> None:
    """`gradsync shard --leader a,b`: it registers with the active leader, and with the
    standby once that one holds the lease; the workers' job goes on over both."""
    from gradsync_proto.net.launch import free_port

    flags = (*HEARTBEAT, "--checkpoint-store", redis_server.url, "--checkpoint-every", "3")
    flags += ("--lease-ttl-s", "1.5", "--wait-for-shards", "1")
    active = coordinator_factory(2, *flags, "--lease")
    wait_for(lambda: _health(active.address) == 1, 30, "the first coordinator to take the lease")
    standby = coordinator_factory(2, *flags, "--standby")
    both = f"{active.address},{standby.address}"
    shard = ShardProcess(both, free_port(), tmp_path / "shard.log")
    processes = []
    try:
        wait_for_shards(active.address, 2, 60)
        processes = start_workers(both, 2, tmp_path, 12, None, "--step-delay-s", "0.3")
        wait_for(
            lambda: bool((job := job_status(active.address)) and job.open_step >= 5),
            90,
            "five steps on the first leader",
        )
        active.process.kill()
        active.process.wait()
        wait_for(lambda: _health(standby.address) == 1, 30, "the standby to take over")
        wait_for_shards(standby.address, 2, 30)  # the same shard process, registered again
        reports = finish(processes, tmp_path, timeout_s=150)
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
        shard.stop()
    for report in reports:
        assert report is not None and report["status"] == "ok", report
        assert report["computed"][0] == 12, report  # no step computed twice
        assert_matches_reference(report, 2, 12)
    assert f"lost the leader {active.address}" in shard.log()
    _, log = standby.stop()
    assert "from the ranks' own state" in log, log[-3000:]


@pytest.mark.timeout(300)
def test_a_frozen_active_coordinator_is_replaced_stands_by_when_it_wakes_and_takes_over_again(
    redis_server: RedisServer, tmp_path: Path, coordinator_factory: Any
) -> None:
    """SIGSTOP the active coordinator past its lease: the standby takes over and the workers
    follow it; on SIGCONT the old one finds its lease gone, writes nothing and stands by
    (health NOT_SERVING, still running); when the new active one is SIGKILLed it takes the
    lease back and the job goes on with it, ending as an uninterrupted run."""
    import signal

    steps = 24
    flags = (*HEARTBEAT, "--checkpoint-store", redis_server.url, "--checkpoint-every", "2")
    flags += ("--lease-ttl-s", "1.5")
    active = coordinator_factory(2, *flags, "--lease")
    wait_for(lambda: _health(active.address) == 1, 30, "the first coordinator to take the lease")
    standby = coordinator_factory(2, *flags, "--standby")
    both = f"{active.address},{standby.address}"
    processes = start_workers(both, 2, tmp_path, steps, None, "--step-delay-s", "0.3")
    wait_for(
        lambda: bool((job := job_status(active.address)) and job.open_step >= 4),
        90,
        "four steps on the first coordinator",
    )
    before = job_status(active.address)
    assert before is not None
    frozen_at = time.monotonic()
    active.process.send_signal(signal.SIGSTOP)
    try:
        wait_for(lambda: _health(standby.address) == 1, 30, "the standby to take over")
        took_over_s = time.monotonic() - frozen_at
        # The workers find the frozen one by keepalive (its kernel still takes their bytes).
        wait_for(
            lambda: bool((job := job_status(standby.address)) and job.open_step > before.open_step),
            60,
            "the workers to train on the standby",
        )
        training_s = time.monotonic() - frozen_at
    finally:
        active.process.send_signal(signal.SIGCONT)
    # Awake, it finds another holder at the key: demoted, it stands by again (it used to
    # exit 3). Several of its polls later it still runs, serves nothing and says so.
    time.sleep(3.0)
    assert active.process.poll() is None, active.stop()[1][-3000:]
    assert _health(active.address) == 2
    assert job_status(active.address) is None  # a standby answers no Status: UNAVAILABLE
    middle = job_status(standby.address)
    assert middle is not None and middle.state == "running", middle
    standby.process.kill()
    standby.process.wait()
    killed_at = time.monotonic()
    wait_for(lambda: _health(active.address) == 1, 30, "the old coordinator to take over again")
    back_s = time.monotonic() - killed_at
    wait_for(
        lambda: bool((job := job_status(active.address)) and job.open_step > middle.open_step),
        60,
        "the workers to train on the old coordinator again",
    )
    reports = finish(processes, tmp_path, timeout_s=150)
    for report in reports:
        assert report is not None and report["status"] == "ok", report
        assert report["computed"][0] == steps, report  # no step computed twice
        assert_matches_reference(report, 2, steps)
    client = _client(redis_server)
    assert client.get("gradsync:lease:coordinator:fence") == b"3"
    code, old_log = active.stop()
    assert code == 0, old_log[-3000:]
    assert "demoted: coordinator at" in old_log, old_log[-3000:]
    assert "standing by again" in old_log, old_log[-3000:]
    assert "took over the lease with fence 3" in old_log, old_log[-3000:]
    # Its second term started from the ranks' own state, not from its first term's job.
    assert old_log.count("from the ranks' own state") >= 1, old_log[-3000:]
    print(
        f"standby SERVING {took_over_s:.2f}s and training {training_s:.2f}s after SIGSTOP "
        f"of the active coordinator; the woken one, standing by, SERVING again {back_s:.2f}s "
        "after SIGKILL of the new active one"
    )


@pytest.mark.timeout(120)
def test_a_dead_first_address_is_left_well_before_the_join_timeout(
    tmp_path: Path, coordinator_factory: Any
) -> None:
    """Workers given "nothing-listens-here,the-coordinator" join at the second address after
    the per-address wait (3 s), not after their 30 s join timeout."""
    from gradsync_proto.net.launch import free_port

    coordinator = coordinator_factory(2, *HEARTBEAT)
    addresses = f"127.0.0.1:{free_port()},{coordinator.address}"
    started = time.monotonic()
    reports = finish(start_workers(addresses, 2, tmp_path, 3, None, "--timeout-s", "30"), tmp_path)
    took_s = time.monotonic() - started
    for report in reports:
        assert report is not None and report["status"] == "ok", report
    assert took_s < 20, f"{took_s:.1f}s: the dead address held the workers to the join timeout"
    print(f"joined past a dead first address and trained 3 steps in {took_s:.1f}s")
