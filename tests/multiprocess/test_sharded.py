"""Sharded coordinators end to end: real leader, real shard processes, real workers, real signals.

What a user does (issue 10): `gradsync serve --shards S` on one host, or a leader with
`--wait-for-shards K` plus `gradsync shard --leader ...` elsewhere; workers know only
the leader. These tests check that sharding changes nothing numerically (bitwise equal
to one coordinator), that every shard really carries bytes, that ranks and shards may
start at human pace in any order, and that a shard killed with SIGKILL is named to every
rank and the job resumes from the leader's checkpoint once it is back, without
restarting the workers.
"""

from __future__ import annotations

import re
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from gradsync_proto.net.launch import free_port
from support.faults import (
    HEARTBEAT,
    assert_matches_reference,
    finish,
    job_status,
    params_of,
    wait_for,
)
from support.processes import reap, start_workers
from support.redisserver import RedisServer
from support.shards import ShardProcess, shard_statuses, wait_for_shard_bytes, wait_for_shards


def _train(address: str, world_size: int, out: Path, steps: int, *extra: str) -> list[dict]:
    out.mkdir()
    reports = finish(start_workers(address, world_size, out, steps, None, *extra), out)
    for report in reports:
        assert report is not None and report["status"] == "ok", report
    return [r for r in reports if r is not None]


@pytest.mark.timeout(180)
def test_sharding_changes_no_bit_of_the_result(coordinator_factory, tmp_path: Path) -> None:
    """W = 3 over three local shards: the same bytes as one coordinator, every shard used."""
    single = coordinator_factory(3, *HEARTBEAT)
    unsharded = _train(single.address, 3, tmp_path / "one", 5)
    sharded_leader = coordinator_factory(3, *HEARTBEAT, "--shards", "3")
    shards = wait_for_shards(sharded_leader.address, 3, 60)
    assert [s.index for s in shards] == [0, 1, 2]
    sharded = _train(sharded_leader.address, 3, tmp_path / "three", 5)
    for a, b in zip(unsharded, sharded, strict=True):
        for name, value in params_of(a).items():
            np.testing.assert_array_equal(value, params_of(b)[name], err_msg=name)
    assert_matches_reference(sharded[0], 3, 5)
    # Every shard averaged its part of every bucket: received and sent real bytes.
    assert len(wait_for_shard_bytes(sharded_leader.address)) == 3


@pytest.mark.timeout(180)
def test_ranks_shard_and_leader_start_at_human_pace_in_any_order(
    coordinator_factory, tmp_path: Path
) -> None:
    """Workers first, a remote shard 3 s later, the leader last, 10 s after the workers."""
    port = free_port()
    leader = f"127.0.0.1:{port}"
    shard_port = free_port()
    processes = start_workers(leader, 2, tmp_path, 4, None, "--timeout-s", "60")
    shard: ShardProcess | None = None
    try:
        time.sleep(3)
        shard = ShardProcess(leader, shard_port, tmp_path / "shard.log")
        time.sleep(7)
        assert shard.process.poll() is None, shard.log()  # it keeps trying to register
        started = coordinator_factory(2, *HEARTBEAT, "--port", str(port), "--wait-for-shards", "1")
        reports = finish(processes, tmp_path, timeout_s=120)
        for report in reports:
            assert report is not None and report["status"] == "ok", report
            assert_matches_reference(report, 2, 4)
        statuses = wait_for_shard_bytes(started.address)
        assert [s.address for s in statuses][1:] == [f"127.0.0.1:{shard_port}"], statuses
    finally:
        reap(processes)
        if shard is not None:
            shard.stop()


def _checkpoint_at_least(address: str, step: int) -> bool:
    job = job_status(address)
    return bool(job and job.last_checkpoint_step >= step and job.open_step >= step + 2)  # type: ignore[attr-defined]


@pytest.mark.timeout(240)
def test_killed_shard_is_named_and_the_job_resumes_once_it_is_back(
    redis_server_factory: Callable[..., RedisServer], coordinator_factory, tmp_path: Path
) -> None:
    """SIGKILL a remote shard mid-run, restart it at the same address: the workers go on.

    Checkpoints go to a real Redis: the resume point must come from it.
    """
    redis = redis_server_factory()
    checkpoint_store = redis.url
    leader = coordinator_factory(
        2,
        *HEARTBEAT,
        "--wait-for-shards",
        "1",
        "--checkpoint-store",
        checkpoint_store,
        "--checkpoint-every",
        "3",
    )
    shard = ShardProcess(leader.address, free_port(), tmp_path / "shard.log")
    processes: list[subprocess.Popen[bytes]] = []
    try:
        wait_for_shards(leader.address, 2, 60)
        processes = start_workers(leader.address, 2, tmp_path, 12, None, "--step-delay-s", "0.3")
        wait_for(lambda: _checkpoint_at_least(leader.address, 3), 90, "a checkpoint of step 3")
        killed_at = time.monotonic()
        shard.process.kill()
        shard.process.wait()
        wait_for(
            lambda: any(not s.alive for s in shard_statuses(leader.address)[1:]),
            10,
            "the leader to notice the lost shard",
        )
        detected_s = time.monotonic() - killed_at
        time.sleep(2)  # the workers are told and wait to reconnect
        shard.restart()
        reports = finish(processes, tmp_path, timeout_s=150)
    finally:
        reap(processes)
        shard.stop()
    assert detected_s < 2.0 + 1.0  # within the heartbeat timeout (2 s), with slack
    for report in reports:
        assert report is not None and report["status"] == "ok", report
        # The ranks went on from their own state (no rollback to the checkpoint) and
        # uploaded the step in flight again; a rank behind names the lost shard.
        assert len(report["restarts"]) <= 1, report
        assert report["computed"][0] == 12, report  # no step computed twice
        for cause in report["restart_causes"]:
            assert "shard 1" in cause and shard.address in cause, cause
        assert_matches_reference(report, 2, 12)  # no step applied twice, none skipped
    _, log = leader.stop()
    assert f"shard 1 at {shard.address}" in log
    # What the leader says will happen is what happens: the job stops at step N and goes
    # on from the ranks' own state (it used to announce a rollback to the checkpoint), at
    # N, or at N - 1 when the shard died before its range of step N - 1 reached the ranks.
    announced = re.search(
        r"job 'default' stops at step (\d+); once every shard is registered again it goes on "
        r"from the ranks' own state if they agree on it, else from its last checkpoint",
        log,
    )
    continued = re.search(r"continued at step (\d+) from the ranks' own state", log)
    assert announced is not None and continued is not None, log[-3000:]
    stopped_at, went_on_at = int(announced.group(1)), int(continued.group(1))
    assert stopped_at - 1 <= went_on_at <= stopped_at, (announced.group(0), continued.group(0))


@pytest.mark.timeout(240)
def test_a_local_shard_that_dies_is_restarted_by_the_leader(
    coordinator_factory, tmp_path: Path
) -> None:
    """`serve --shards 2`: the leader supervises its shard process and restarts it."""
    checkpoint_store = str(tmp_path / "checkpoints")
    leader = coordinator_factory(
        2,
        *HEARTBEAT,
        "--shards",
        "2",
        "--checkpoint-store",
        checkpoint_store,
        "--checkpoint-every",
        "3",
    )
    shards = wait_for_shards(leader.address, 2, 60)
    shard_port = shards[1].address.rsplit(":", 1)[1]
    processes = start_workers(leader.address, 2, tmp_path, 10, None, "--step-delay-s", "0.3")
    try:
        wait_for(lambda: _checkpoint_at_least(leader.address, 3), 90, "a checkpoint of step 3")
        found = subprocess.run(
            ["pgrep", "-f", f"shard --leader {leader.address}"],
            capture_output=True,
            text=True,
            check=False,
        )
        pids = [int(p) for p in found.stdout.split()]
        assert len(pids) == 1, found
        subprocess.run(["kill", "-9", str(pids[0])], check=True)
        reports = finish(processes, tmp_path, timeout_s=150)
    finally:
        reap(processes)
    for report in reports:
        assert report is not None and report["status"] == "ok", report
        # No rollback, nothing computed twice; a rank behind names the shard.
        assert len(report["restarts"]) <= 1, report
        assert report["computed"][0] == 10, report  # no step computed twice
        for cause in report["restart_causes"]:
            assert f":{shard_port}" in cause, report
        assert_matches_reference(report, 2, 10)
    _, log = leader.stop()
    assert "restart" in log.lower() and f":{shard_port}" in log


@pytest.mark.timeout(240)
def test_killed_leader_is_restarted_and_workers_and_shard_rejoin_it(
    coordinator_factory, tmp_path: Path
) -> None:
    """The leader dies (SIGKILL): workers reconnect to its successor, the shard re-registers."""
    port = str(free_port())
    flags = (
        *HEARTBEAT,
        "--port",
        port,
        "--wait-for-shards",
        "1",
        "--checkpoint-store",
        str(tmp_path / "checkpoints"),
        "--checkpoint-every",
        "3",
    )
    first = coordinator_factory(2, *flags)
    shard = ShardProcess(first.address, free_port(), tmp_path / "shard.log")
    processes: list[subprocess.Popen[bytes]] = []
    try:
        wait_for_shards(first.address, 2, 60)
        processes = start_workers(first.address, 2, tmp_path, 12, None, "--step-delay-s", "0.3")
        wait_for(lambda: _checkpoint_at_least(first.address, 3), 90, "a checkpoint of step 3")
        first.process.kill()
        first.process.wait()
        time.sleep(1.0)  # workers and shard notice the loss
        second = coordinator_factory(2, *flags)
        wait_for_shards(second.address, 2, 60)  # the same shard process registered again
        reports = finish(processes, tmp_path, timeout_s=150)
    finally:
        reap(processes)
        shard.stop()
    for report in reports:
        assert report is not None and report["status"] == "ok", report
        assert len(report["restarts"]) <= 1, report
        assert report["computed"][0] == 12, report  # no step computed twice
        assert_matches_reference(report, 2, 12)
    # One shard process all along: it lost the first leader and registered with the second.
    assert f"lost the leader {first.address}" in shard.log()
    _, log = second.stop()
    assert "from the ranks' own state" in log, log[-3000:]
