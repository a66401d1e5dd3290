"""A DiLoCo coordinator SIGKILLed mid-run and restarted on its store resumes the outer state.

Real `gradsync serve` processes, real worker processes, a real file store and a
real redis-server. The coordinator saves its global parameters, Nesterov
momentum and round after every committed step; the restarted one restores
them and replays its last committed step. The run must then end exactly where
an uninterrupted run ends (the one-process simulation of `support.diloco_reference`,
momentum 0.9: a restarted momentum would be visibly off), every rank having run
each planned inner step exactly once, and the record must really be in the
store. With no record, or one written for another job layout, the coordinator
reseeds (momentum from zero) and says so in its log and `gradsync status`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import signal
from pathlib import Path

import numpy as np
import pytest
from gradsync.status import query_status
from gradsync_proto.auth import derive_key
from gradsync_proto.net.channels import ChannelSecurity
from gradsync_proto.net.launch import free_port
from gradsync_server.dataplane.outer_snapshot import decode_snapshot
from support.diloco_reference import Run, make_model, simulate
from support.faults import wait_for
from support.processes import WORKERS, CoordinatorProcess, launch_ranks, reap, run_ranks
from support.redisserver import RedisServer

DILOCO_WORKER = WORKERS / "diloco_worker.py"
TOKEN = "diloco-restart-test-token-0123456789"
NAMES = [name for name, _ in make_model(0).named_parameters()]
WORLD = 2


def record(shard: int) -> str:
    return f"outer-state-shard{shard}"


def _security() -> ChannelSecurity:
    """The token of the test's coordinators, if it runs them with one."""
    return ChannelSecurity(token=os.environ.get("GRADSYNC_TOKEN"))


def _open_step(address: str) -> int:
    """The open step (seed + rounds) of the default job at `address` (0 if none yet)."""
    try:
        jobs = query_status(address, "default", timeout_s=2, security=_security()).jobs
    except ConnectionError:
        return 0
    return int(jobs[0].open_step) if jobs else 0


def _outer_state(address: str) -> str:
    """The default job's outer-state line in `gradsync status` ("" if none yet)."""
    try:
        jobs = query_status(address, "default", timeout_s=2, security=_security()).jobs
    except ConnectionError:
        return ""
    return jobs[0].outer_state if jobs else ""


def _kill_with_children(coordinator: CoordinatorProcess) -> None:
    """SIGKILL the coordinator and its local shard processes at once (a lost host)."""
    pid = coordinator.process.pid
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    coordinator.process.kill()
    for child in children:
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(child), signal.SIGKILL)
    coordinator.stop(signal_first=False)


def _record_exists(kind: str, store: str, shard: int = 0) -> bool:
    """Plane `shard`'s outer-state record of the default job is in the store (it was used)."""
    if kind == "file":
        return (Path(store) / "default" / record(shard)).is_file()
    import redis

    client = redis.Redis.from_url(store, socket_timeout=5)
    try:
        return bool(client.exists(f"gradsync:ckpt:default:{record(shard)}"))
    finally:
        client.close()


def assert_equals_uninterrupted(outputs: list[dict[str, np.ndarray]], run: Run) -> None:
    """Every round's parameters on every rank equal the uninterrupted simulation's."""
    expected = simulate(run, WORLD, make_model(100, run.hidden))
    for output in outputs:
        assert int(output["inner_steps"]) == run.rounds * run.sync_every  # none recomputed
        for number, want in enumerate(expected):
            got = [output[f"round{number}/{name}"] for name in NAMES]
            worst = max(float(np.abs(a - b.numpy()).max()) for a, b in zip(got, want, strict=True))
            assert worst <= 1e-5, f"round {number}: {worst:.3g} from the uninterrupted simulation"
    for name in NAMES:
        np.testing.assert_array_equal(outputs[0][f"final/{name}"], outputs[1][f"final/{name}"])


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    ("kind", "shards", "token"),
    [("file", 1, ""), ("redis", 1, ""), ("file", 2, ""), ("redis", 2, ""), ("file", 2, TOKEN)],
    ids=["file", "redis", "file-two-shards", "redis-two-shards", "file-two-shards-token"],
)
def test_a_coordinator_killed_mid_run_resumes_its_outer_state_from_the_store(
    kind: str,
    shards: int,
    token: str,
    tmp_path: Path,
    request: pytest.FixtureRequest,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """SIGKILL in the middle of a momentum-0.9 run (with `--shards 2`: the leader and its
    shard process at once), restart on the same port and store: the run ends where the
    uninterrupted simulation ends, no inner step run twice. Every plane saved its range
    (with a token: sealed, every plane's record verifying under the outer-state key)."""
    monkeypatch.setenv("GRADSYNC_HIERARCHICAL", "0")
    monkeypatch.delenv("GRADSYNC_TOKEN_FILE", raising=False)
    if token:
        monkeypatch.setenv("GRADSYNC_TOKEN", token)
    else:
        monkeypatch.delenv("GRADSYNC_TOKEN", raising=False)
    if kind == "redis":
        store = request.getfixturevalue("redis_server").url
    else:
        store = str(tmp_path / "store")
    port = free_port()
    serve = ("--port", str(port), "--checkpoint-store", store, "--shards", str(shards))
    first = CoordinatorProcess(WORLD, *serve)
    run = Run(rounds=6)
    processes = launch_ranks(
        DILOCO_WORKER,
        first.address,
        WORLD,
        lambda rank: tmp_path / f"rank{rank}.npz",
        *run.argv(),
        "--step-delay-s",
        "0.2",
    )
    second = None
    try:
        wait_for(lambda: _open_step(first.address) >= 3, 90, "two rounds on the first coordinator")
        for shard in range(shards):
            assert _record_exists(kind, store, shard), f"no record of plane {shard} in the store"
            if token:
                blob = (Path(store) / "default" / record(shard)).read_bytes()
                key = derive_key(token, "outer-state")  # `--shards`' own children: the token's
                assert decode_snapshot(blob, "default", key).sealed
        _kill_with_children(first)
        second = CoordinatorProcess(WORLD, *serve)
        wait_for(lambda: _outer_state(second.address) != "", 90, "the restarted job's outer state")
        line = _outer_state(second.address)
        codes = [process.wait(timeout=150) for process in processes]
    finally:
        reap(processes)
        log = second.stop()[1] if second is not None else ""
    assert codes == [0, 0], codes
    outputs = [dict(np.load(tmp_path / f"rank{rank}.npz")) for rank in range(WORLD)]
    assert_equals_uninterrupted(outputs, run)
    assert re.match(r"restored round \d+ \(step \d+\) from the store", line), line
    assert "outer state restored round" in log, log[-3000:]
    if shards > 1:
        assert "(2 planes)" in line
        assert "outer state of shard 1 restored" in log, log[-3000:]


@pytest.mark.timeout(300)
def test_an_empty_store_or_another_layout_reseeds_and_says_so(
    tmp_path: Path, redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fresh store has no record: the job seeds as always (status says "reseeded"). A later
    job of the same id with another outer learning rate finds a record of another layout: it
    is not restored (its global parameters would be the other run's), it reseeds. That job
    started a third time finds its own record: its fresh ranks take the stored parameters."""
    monkeypatch.setenv("GRADSYNC_HIERARCHICAL", "0")
    serve = ("--checkpoint-store", redis_server.url)
    run = Run(rounds=2)
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    first = CoordinatorProcess(WORLD, *serve)
    try:
        outputs = run_ranks(DILOCO_WORKER, first.address, WORLD, tmp_path / "a", *run.argv())
    finally:
        log = first.stop()[1]
    assert "outer state reseeded (" in log and "holds no outer state of job 'default'" in log, log
    assert _record_exists("redis", redis_server.url)
    assert_equals_uninterrupted(outputs, run)
    other = dataclasses.replace(run, outer_lr=0.5)
    second = CoordinatorProcess(WORLD, *serve)
    try:
        outputs = run_ranks(DILOCO_WORKER, second.address, WORLD, tmp_path / "b", *other.argv())
    finally:
        log = second.stop()[1]
    assert "outer state reseeded (the stored outer state of round 2 (step 2)" in log, log
    assert "written for another model, outer optimizer or shard count" in log, log
    assert_equals_uninterrupted(outputs, other)  # its own run, from its own seed
    # The same job started again on the same store: its new ranks resume from the stored
    # global parameters (the end of the second run), not from their own.
    (tmp_path / "c").mkdir()
    third = CoordinatorProcess(WORLD, *serve)
    try:
        again = run_ranks(DILOCO_WORKER, third.address, WORLD, tmp_path / "c", *other.argv())
    finally:
        log = third.stop()[1]
    assert "outer state restored round 2 (step 2) from the store" in log, log
    for output in again:
        assert int(output["inner_steps"]) == other.rounds * other.sync_every
        for name in NAMES:
            np.testing.assert_array_equal(output[f"round0/{name}"], outputs[0][f"final/{name}"])
