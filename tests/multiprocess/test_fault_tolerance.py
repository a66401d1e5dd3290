"""Fault tolerance with real processes, real signals and a real Redis.

Each scenario asserts where the ranks end up (parameters, errors, timing
bounds), not just that nothing crashed.
"""

from __future__ import annotations

import contextlib
import json
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from gradsync_bench.netns import Cluster
from gradsync_proto.net.launch import free_port
from support import scenarios
from support.components import netns_available
from support.faults import (
    HEARTBEAT,
    assert_matches_reference,
    finish,
    job_status,
    params_of,
    wait_for,
)
from support.processes import start_workers
from support.redisserver import RedisServer


@pytest.mark.timeout(120)
def test_killed_worker_aborts_the_step_for_survivors(
    coordinator_factory, tmp_path: Path, layout: str
) -> None:
    coordinator = coordinator_factory(3, *HEARTBEAT)
    processes = start_workers(
        coordinator.address, 3, tmp_path, steps=6, per_rank={2: ["--kill-at", "2"]}
    )
    wait_for(lambda: processes[2].poll() is not None, 60, "rank 2 to kill itself")
    died_at = time.monotonic()
    reports = finish(processes, tmp_path)
    assert processes[2].returncode == -9 and reports[2] is None
    for rank in (0, 1):
        report = reports[rank]
        assert report is not None
        assert report["status"] == "PeerLostError", report["message"]
        assert "rank 2" in report["message"] and report["step"] == 2
        # Survivors applied steps 0 and 1 only: no partial average of step 2.
        assert_matches_reference(report, 3, 2)
    # Both survivors ended on their own with a GradSyncError (exit status 3; `finish`
    # would have killed a hung one, -9), within heartbeat timeout + 1 s (plus process exit).
    assert [p.returncode for p in processes[:2]] == [3, 3]
    assert time.monotonic() - died_at < 2 + 1 + 5


@pytest.mark.timeout(120)
def test_straggler_is_named_in_the_log_and_in_status(
    coordinator_factory, tmp_path: Path, layout: str
) -> None:
    # Hierarchical: both ranks are one local group and only rank 0 uploads; rank 1 is
    # still named, from the LocalPosted notice rank 0 sends and rank 1 does not.
    coordinator = coordinator_factory(2, *HEARTBEAT, "--stall-warning", "1")
    processes = start_workers(
        coordinator.address, 2, tmp_path, steps=4, per_rank={1: ["--sleep-at", "2:4"]}
    )

    def rank_1_reported_late() -> bool:
        job = job_status(coordinator.address)
        return bool(
            job
            and [late.rank for late in job.late] == [1]  # type: ignore[attr-defined]
            and job.step_age_s > 1
        )  # type: ignore[attr-defined]

    wait_for(rank_1_reported_late, 60, "status to show rank 1 late")
    job = job_status(coordinator.address)
    assert job is not None and job.open_step == 2  # type: ignore[attr-defined]
    assert list(job.late[0].bucket_indices)  # type: ignore[attr-defined]
    reports = finish(processes, tmp_path)
    assert [r["status"] for r in reports if r] == ["ok", "ok"]
    cli = subprocess.run(
        [sys.executable, "-m", "gradsync.cli", "status", "--coordinator", coordinator.address],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert cli.returncode == 0
    _, log = coordinator.stop()
    assert "step 2 has been waiting" in log and "rank 1 (buckets [" in log


@pytest.mark.timeout(120)
@pytest.mark.skipif(not netns_available()[0], reason=netns_available()[1])
def test_partitioned_worker_is_declared_dead(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Beyond loopback a coordinator needs a token (protected mode): every process started
    # here (coordinator, workers, status) inherits it from the environment.
    monkeypatch.delenv("GRADSYNC_TOKEN_FILE", raising=False)
    monkeypatch.setenv("GRADSYNC_TOKEN", "fault-tolerance-test-token")
    with contextlib.ExitStack() as logs, Cluster(["coord", "w0", "w1"]) as cluster:
        worker_logs = [logs.enter_context((tmp_path / f"w{r}.log").open("w")) for r in range(2)]
        coordinator = cluster.popen(
            "coord",
            [
                sys.executable,
                "-m",
                "gradsync.cli",
                "serve",
                "--world-size",
                "2",
                "--host",
                "0.0.0.0",
                "--port",
                "50051",
                *HEARTBEAT,
            ],
            stderr=subprocess.PIPE,
            text=True,
        )
        address = f"{cluster.address('coord')}:50051"
        processes = start_workers(
            address,
            2,
            tmp_path,
            200,
            None,
            "--step-delay-s",
            "0.2",
            "--timeout-s",
            "60",
            launch=lambda rank, argv: cluster.popen(
                f"w{rank}", argv, stdout=subprocess.DEVNULL, stderr=worker_logs[rank]
            ),
        )
        status_address = address

        def past_step_2() -> bool:
            result = subprocess.run(
                cluster.command(
                    "w0",
                    [
                        sys.executable,
                        "-m",
                        "gradsync.cli",
                        "status",
                        "--coordinator",
                        status_address,
                        "--json",
                    ],
                ),
                capture_output=True,
                text=True,
                timeout=20,
            )
            if result.returncode != 0:
                return False
            jobs = json.loads(result.stdout)["jobs"]
            return any(job["openStep"] >= 3 for job in jobs)  # --json prints integers as numbers

        try:
            wait_for(past_step_2, 60, "training to pass step 2")
        except AssertionError as stuck:
            coordinator.terminate()
            _, log = coordinator.communicate(timeout=30)
            workers = "".join(
                f"\n--- w{r} ---\n" + (tmp_path / f"w{r}.log").read_text()[-3000:] for r in range(2)
            )
            raise AssertionError(f"{stuck}\n--- coordinator ---\n{log[-3000:]}{workers}") from None
        cluster.set_link("w1", False)
        cut_at = time.monotonic()
        processes[0].wait(timeout=30)
        detected_after = time.monotonic() - cut_at
        report = json.loads((tmp_path / "rank0.json").read_text())
        assert report["status"] == "PeerLostError"
        assert "rank 1" in report["message"] and "heartbeat" in report["message"]
        # The 2 s heartbeat timeout, not the 60 s sync timeout, ended it. The margin covers
        # the worker writing its report and exiting, several seconds on a loaded machine.
        assert detected_after < 2 + 13, detected_after
        coordinator.terminate()
        _, log = coordinator.communicate(timeout=30)
        assert "declared dead" in log


def run_to_completion(address: str, out: Path, steps: int, *extra: str) -> list[dict]:
    reports = finish(start_workers(address, 2, out, steps, None, *extra), out)
    assert all(r is not None for r in reports)
    return [r for r in reports if r is not None]


@pytest.fixture(params=["file", "redis"])
def checkpoint_store(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A --checkpoint-store: a folder under tmp_path, or a real redis-server's URL."""
    if request.param == "file":
        return str(tmp_path / "checkpoints")
    redis_server_factory: Callable[..., RedisServer] = request.getfixturevalue(
        "redis_server_factory"
    )
    return redis_server_factory().url


@pytest.mark.timeout(180)
def test_coordinator_killed_and_restarted_resumes_from_the_checkpoint(
    checkpoint_store: str, tmp_path: Path, coordinator_factory
) -> None:
    flags = (*HEARTBEAT, "--checkpoint-store", checkpoint_store, "--checkpoint-every", "2")
    first = coordinator_factory(2, *flags)
    run1 = tmp_path / "run1"
    run1.mkdir()
    processes = start_workers(
        first.address, 2, run1, 10, None, "--step-delay-s", "0.3", "--reconnect-timeout-s", "0"
    )

    def checkpoint_at_least_4() -> bool:
        job = job_status(first.address)
        return bool(job and job.last_checkpoint_step >= 4)  # type: ignore[attr-defined]

    wait_for(checkpoint_at_least_4, 90, "a durable checkpoint of step >= 4")
    first.process.kill()  # SIGKILL: no drain, no goodbye
    first.process.wait()
    interrupted = finish(processes, run1)
    # --reconnect-timeout-s 0: no reconnect attempt, the lost coordinator is reported as such.
    assert [r and r["status"] for r in interrupted] == ["CoordinatorUnavailableError"] * 2, [
        r and (r["status"], r["message"]) for r in interrupted
    ]
    # Restart on the same store; brand-new worker processes resume from it.
    second = coordinator_factory(2, *flags, "--resume")
    run2 = tmp_path / "run2"
    run2.mkdir()
    reports = run_to_completion(second.address, run2, 10)
    for report in reports:
        assert report["status"] == "ok", report["message"]
        assert_matches_reference(report, 2, 10)
    _, log = second.stop()
    assert "RESUMES from the checkpoint of step" in log


@pytest.mark.timeout(60)
def test_resume_without_a_checkpoint_is_refused(coordinator_factory, tmp_path: Path) -> None:
    coordinator = coordinator_factory(2, "--checkpoint-store", str(tmp_path / "empty"), "--resume")
    reports = finish(start_workers(coordinator.address, 2, tmp_path, 2), tmp_path)
    for report in reports:
        assert report is not None and report["status"] == "JoinRefusedError"
        assert "--resume is set" in report["message"] and "from scratch" in report["message"]


@pytest.mark.timeout(180)
def test_redis_outage_does_not_stop_training(
    tmp_path: Path,
    redis_server_factory: Callable[..., RedisServer],
    coordinator_factory,
) -> None:
    redis = redis_server_factory()
    coordinator = coordinator_factory(
        2, *HEARTBEAT, "--checkpoint-store", redis.url, "--checkpoint-every", "1"
    )
    processes = start_workers(coordinator.address, 2, tmp_path, 30, None, "--step-delay-s", "0.2")
    wait_for(
        lambda: bool((j := job_status(coordinator.address)) and j.last_checkpoint_step >= 2),  # type: ignore[attr-defined]
        60,
        "a first checkpoint",
    )
    redis.stop()  # Redis goes away mid-run
    time.sleep(2)
    before_restart = job_status(coordinator.address)
    assert before_restart is not None
    redis.start(same_port=True)  # and comes back with its append-only file
    wait_for(
        lambda: bool(
            (j := job_status(coordinator.address))
            and j.last_checkpoint_step > before_restart.last_checkpoint_step + 1
        ),  # type: ignore[attr-defined]
        60,
        "checkpoints to succeed again after Redis restarted",
    )
    reports = finish(processes, tmp_path)
    assert [r["status"] for r in reports if r] == ["ok", "ok"]
    for report in reports:
        assert report is not None
        assert_matches_reference(report, 2, 30)
    _, log = coordinator.stop()
    assert "FAILED" in log and "failures so far" in log


@pytest.mark.timeout(90)
def test_require_checkpoint_fails_fast_when_the_store_is_down_at_start(
    tmp_path: Path, redis_server_factory: Callable[..., RedisServer], coordinator_factory
) -> None:
    redis = redis_server_factory()
    url = redis.url
    redis.stop()
    coordinator = coordinator_factory(
        2, *HEARTBEAT, "--checkpoint-store", url, "--checkpoint-every", "2", "--require-checkpoint"
    )
    reports = finish(start_workers(coordinator.address, 2, tmp_path, 20), tmp_path)
    for report in reports:
        assert report is not None and report["status"] == "JoinRefusedError"
        assert "--require-checkpoint is set" in report["message"], report["message"]
        assert "Connection refused" in report["message"]
        assert "from scratch" in report["message"]


@pytest.mark.timeout(120)
def test_require_checkpoint_fails_fast_when_the_store_dies_mid_run(
    tmp_path: Path, redis_server_factory: Callable[..., RedisServer], coordinator_factory
) -> None:
    redis = redis_server_factory()
    coordinator = coordinator_factory(
        2,
        *HEARTBEAT,
        "--checkpoint-store",
        redis.url,
        "--checkpoint-every",
        "1",
        "--require-checkpoint",
    )
    processes = start_workers(coordinator.address, 2, tmp_path, 200, None, "--step-delay-s", "0.1")
    wait_for(
        lambda: bool((j := job_status(coordinator.address)) and j.last_checkpoint_step >= 1),  # type: ignore[attr-defined]
        60,
        "a first checkpoint",
    )
    redis.stop()
    stopped_at = time.monotonic()
    reports = finish(processes, tmp_path, timeout_s=60)
    assert time.monotonic() - stopped_at < 30
    for report in reports:
        # Its own error, not CoordinatorUnavailableError (which would start reconnecting).
        assert report is not None and report["status"] == "CheckpointFailedError", report
        assert report["step"] is None or report["step"] < 200
        assert "--require-checkpoint is set" in report["message"], report["message"]


ELASTIC = (*HEARTBEAT, "--on-failure", "elastic", "--min-workers", "2")


def reference_with_members(
    steps: int, members: Callable[[int], list[int]]
) -> dict[str, np.ndarray]:
    """Single-process training where step s averages over the ranks in members(s)."""
    import torch

    model = scenarios.MixedModel(0)
    optimizer = scenarios.make_optimizer(model)
    for step in range(steps):
        optimizer.zero_grad()
        ranks = members(step)
        rows = [scenarios.rank_batch(step, 3, rank) for rank in ranks]
        x = torch.cat([r[0] for r in rows])
        y = torch.cat([r[1] for r in rows])
        scenarios.loss_fn(model(x), y).backward()
        optimizer.step()
    return {name: p.detach().double().numpy() for name, p in model.named_parameters()}


def kill_when_late(address: str, process: subprocess.Popen[bytes], rank: int, step: int) -> None:
    """SIGKILL `rank` once the others delivered `step` and it has not (a clean cut)."""

    def late() -> bool:
        job = job_status(address)
        return bool(
            job
            and job.open_step == step  # type: ignore[attr-defined]
            and [late.rank for late in job.late] == [rank]
        )  # type: ignore[attr-defined]

    wait_for(late, 60, f"rank {rank} to be the only one late at step {step}")
    process.kill()


@pytest.mark.timeout(120)
def test_elastic_goes_on_with_the_live_ranks_after_a_kill_mid_step(
    coordinator_factory, tmp_path: Path, layout: str
) -> None:
    coordinator = coordinator_factory(3, *ELASTIC)
    reports = finish(
        start_workers(coordinator.address, 3, tmp_path, steps=6, per_rank={2: ["--kill-at", "2"]}),
        tmp_path,
    )
    assert reports[2] is None
    survivors = [r for r in reports[:2] if r is not None]
    assert [r["status"] for r in survivors] == ["ok", "ok"], survivors
    for report in survivors:
        assert report["step"] == 6
        contributors = report["contributors"]
        assert contributors[:2] == [3, 3] and contributors[3:] == [2, 2, 2], contributors
        assert contributors[2] in (2, 3)
    for name, value in params_of(survivors[0]).items():
        np.testing.assert_array_equal(value, params_of(survivors[1])[name])
    _, log = coordinator.stop()
    assert "continuing with ranks [0, 1]" in log


@pytest.mark.timeout(120)
def test_elastic_divisor_is_the_number_of_live_ranks(
    coordinator_factory, tmp_path: Path, layout: str
) -> None:
    coordinator = coordinator_factory(3, *ELASTIC)
    processes = start_workers(coordinator.address, 3, tmp_path, 6, {2: ["--sleep-at", "2:60"]})
    kill_when_late(coordinator.address, processes[2], 2, 2)
    reports = finish(processes, tmp_path)
    expected = reference_with_members(6, lambda step: [0, 1, 2] if step < 2 else [0, 1])
    for report in reports[:2]:
        assert report is not None and report["status"] == "ok", report
        assert report["contributors"] == [3, 3, 2, 2, 2, 2]
        for name, value in params_of(report).items():
            error = np.linalg.norm(value - expected[name]) / np.linalg.norm(expected[name])
            assert error <= 1e-6, (name, error)


def reference_with_bucket_members(
    steps: int, members: Callable[[int, int], list[int]], buckets: list[list[int]]
) -> dict[str, np.ndarray]:
    """Single-process training where bucket b of step s averages over members(s, b).

    What the coordinator does when a rank is lost mid-step under the elastic policy:
    a bucket it had delivered keeps its gradient (and counts it in the divisor), the
    others average over the live ranks. Each rank's gradient is computed on its own.
    """
    import torch

    model = scenarios.MixedModel(0)
    optimizer = scenarios.make_optimizer(model)
    parameters = list(model.parameters())
    bucket_of = {index: b for b, indices in enumerate(buckets) for index in indices}
    for step in range(steps):
        grads: dict[int, list[torch.Tensor | None]] = {}
        for rank in range(3):
            model.zero_grad()
            x, y = scenarios.rank_batch(step, 3, rank)
            scenarios.loss_fn(model(x), y).backward()
            grads[rank] = [None if p.grad is None else p.grad.clone() for p in parameters]
        optimizer.zero_grad()
        for index, parameter in enumerate(parameters):
            ranks = members(step, bucket_of[index])
            taken = [g for rank in ranks if (g := grads[rank][index]) is not None]
            if taken:
                parameter.grad = torch.stack(taken).sum(0) / len(ranks)
        optimizer.step()
    return {name: p.detach().double().numpy() for name, p in model.named_parameters()}


def is_stopped(pid: int) -> bool:
    """Whether process `pid` is stopped by a signal (state T in /proc/<pid>/stat)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] == "T"


@pytest.mark.timeout(150)
def test_elastic_goes_on_past_a_rank_frozen_mid_step_and_ignores_it_when_it_wakes(
    coordinator_factory, tmp_path: Path, layout: str
) -> None:
    # Rank 2 SIGSTOPs itself in step 3 once bucket 1 is delivered (flat: uploaded;
    # hierarchical: posted in its slot, and, rank 0 being 1.5 s late, a REDUCE of
    # bucket 1 waits unread in its socket). Its streams stay open; only its heartbeats
    # stop. The survivors go on over [0, 1] (bucket 0 of step 3 keeps its gradient).
    # Woken 3 steps later, it must not write into the group's shared memory (the
    # leader summed its share itself) and must end with an error, not a hang.
    coordinator = coordinator_factory(3, *ELASTIC)
    processes = start_workers(
        coordinator.address,
        3,
        tmp_path,
        10,
        {0: ["--sleep-at", "3:1.5"], 2: ["--stop-at", "3"]},
        "--step-delay-s",
        "0.2",
    )
    try:
        wait_for(lambda: is_stopped(processes[2].pid), 60, "rank 2 to freeze itself")
        stopped_at = time.monotonic()
        wait_for(
            lambda: bool((j := job_status(coordinator.address)) and j.open_step >= 6),  # type: ignore[attr-defined]
            30,
            "the survivors to reach step 6 without rank 2",
        )
        went_on_after = time.monotonic() - stopped_at
    finally:
        processes[2].send_signal(signal.SIGCONT)
    reports = finish(processes, tmp_path)
    # Heartbeat timeout (2 s), rank 0's 1.5 s sleep and three steps.
    assert went_on_after < 2 + 1.5 + 6, went_on_after
    woken = reports[2]
    assert woken is not None and woken["status"] != "ok", woken
    assert processes[2].returncode == 3, woken
    survivors = reports[:2]
    for report in survivors:
        assert report is not None and report["status"] == "ok", report
        assert report["step"] == 10
        assert report["contributors"][:3] == [3, 3, 3], report["contributors"]
        assert report["contributors"][4:] == [2] * 6, report["contributors"]
    assert survivors[0] is not None and survivors[1] is not None
    # Delivered before the freeze: bucket 1, whose last gradient runs the freezing hook
    # (gradsync's own hook runs first), and the float64 bucket of `scale`, the first
    # gradient of the backward pass. Bucket 0 holds the unused `extra` layer, settled
    # only when the backward pass ends.
    buckets = survivors[0]["buckets"]
    delivered = {1, next(b for b, indices in enumerate(buckets) if indices == [0])}
    expected = reference_with_bucket_members(
        10,
        lambda step, bucket: (
            [0, 1, 2] if step < 3 or (step == 3 and bucket in delivered) else [0, 1]
        ),
        buckets,
    )
    for report in survivors:
        for name, value in params_of(report).items():
            error = np.linalg.norm(value - expected[name]) / np.linalg.norm(expected[name])
            assert error <= 1e-6, (layout, name, error)
    _, log = coordinator.stop()
    assert "continuing with ranks [0, 1]" in log


@pytest.mark.timeout(120)
def test_elastic_frozen_local_leader_takes_its_followers_out_naming_it(
    coordinator_factory, tmp_path: Path
) -> None:
    # The default layout on one host: rank 0 leads the local group of all three ranks.
    # Its followers' gradients went through it, so when it freezes they cannot go on
    # (README: "A lost leader takes its followers out with it"): they must be told,
    # within the heartbeat timeout, and not wait for their step timeout (60 s here).
    coordinator = coordinator_factory(3, *ELASTIC)
    processes = start_workers(
        coordinator.address, 3, tmp_path, 10, {0: ["--stop-at", "3"]}, "--timeout-s", "60"
    )
    try:
        wait_for(lambda: is_stopped(processes[0].pid), 60, "rank 0 to freeze itself")
        stopped_at = time.monotonic()
        for process in processes[1:]:
            process.wait(timeout=30)
        told_after = time.monotonic() - stopped_at
    finally:
        processes[0].kill()
    reports = finish(processes, tmp_path)
    assert told_after < 2 + 1 + 5, told_after
    for report in reports[1:]:
        assert report is not None and report["status"] == "PeerLostError", report
        assert "rank 0 was declared dead" in report["message"] and report["step"] == 3, report
    _, log = coordinator.stop()
    assert "rank 0 was declared dead" in log


@pytest.mark.timeout(180)
def test_restarted_rank_rejoins_and_is_healed(
    coordinator_factory, tmp_path: Path, layout: str
) -> None:
    coordinator = coordinator_factory(3, *ELASTIC)
    steps = 30  # long enough for a restarted process to import torch and rejoin under load
    processes = start_workers(
        coordinator.address,
        3,
        tmp_path,
        steps,
        {2: ["--sleep-at", "2:60"]},
        "--step-delay-s",
        "0.3",
    )
    kill_when_late(coordinator.address, processes[2], 2, 2)
    processes[2].wait()
    # A new incarnation of rank 2 (different initial weights) rejoins the running job.
    restarted = tmp_path / "restarted"
    restarted.mkdir()
    (again,) = start_workers(
        coordinator.address, 3, restarted, steps, None, "--step-delay-s", "0.3", ranks=[2]
    )
    reports = finish(processes[:2], tmp_path)
    try:
        again.wait(timeout=60)
    finally:
        if again.poll() is None:
            again.kill()
            again.wait()
    healed = json.loads((restarted / "rank2.json").read_text())
    assert healed is not None and healed["status"] == "ok", healed
    assert healed["step"] == steps
    assert 0 < len(healed["contributors"]) < steps  # it joined mid-run
    assert healed["contributors"][-1] == 3
    for report in reports:
        assert report is not None and report["status"] == "ok", report
        for name, value in params_of(report).items():
            np.testing.assert_array_equal(value, params_of(healed)[name])
    _, log = coordinator.stop()
    assert "rejoined job 'default'" in log


@pytest.mark.timeout(180)
def test_workers_reconnect_to_a_restarted_coordinator_and_continue_without_rollback(
    checkpoint_store: str, tmp_path: Path, coordinator_factory
) -> None:
    port = str(free_port())
    flags = (*HEARTBEAT, "--checkpoint-store", checkpoint_store, "--checkpoint-every", "3")
    flags += ("--port", port)
    first = coordinator_factory(2, *flags)
    processes = start_workers(first.address, 2, tmp_path, 12, None, "--step-delay-s", "0.3")

    def checkpoint_at_least_3() -> bool:
        job = job_status(first.address)
        return bool(job and job.last_checkpoint_step >= 3 and job.open_step >= 5)  # type: ignore[attr-defined]

    wait_for(checkpoint_at_least_3, 90, "a durable checkpoint and two more steps")
    first.process.kill()
    first.process.wait()
    time.sleep(1.0)  # the workers notice and start reconnecting
    second = coordinator_factory(2, *flags)
    reports = finish(processes, tmp_path, timeout_s=120)
    for report in reports:
        assert report is not None and report["status"] == "ok", report
        # The ranks agreed on their position: the job went on from there, not from
        # the checkpoint (which would have recomputed >= 2 steps), and the step in
        # flight was uploaded again, not computed again. A rank whose last answer
        # never came took a rank ahead's state (one restart, nothing recomputed).
        assert len(report["restarts"]) <= 1, report["restarts"]
        assert report["computed"][0] == 12, report  # no step computed twice
        # No step applied twice, none skipped: exactly the uninterrupted result.
        assert_matches_reference(report, 2, 12)
    _, log = second.stop()
    continued = re.search(r"continued at step (\d+) from the ranks' own state", log)
    assert continued is not None and int(continued.group(1)) >= 5, log[-3000:]


@pytest.mark.timeout(90)
def test_exception_inside_backward_abandons_the_step_for_every_rank(
    coordinator_factory, tmp_path: Path, layout: str
) -> None:
    coordinator = coordinator_factory(2, *HEARTBEAT)
    reports = finish(
        start_workers(
            coordinator.address, 2, tmp_path, 5, {1: ["--raise-at", "2"]}, "--skip-aborted"
        ),
        tmp_path,
    )
    for report in reports:
        assert report is not None and report["status"] == "ok", report
        assert report["skipped"] == [2] and report["step"] == 5
    # Step 2 was skipped by both ranks: the same as training on steps 0, 1, 3, 4.
    model = scenarios.MixedModel(0)
    optimizer = scenarios.make_optimizer(model)
    for step in (0, 1, 3, 4):
        optimizer.zero_grad()
        x, y = scenarios.global_batch(step, 2)
        scenarios.loss_fn(model(x), y).backward()
        optimizer.step()
    for report in reports:
        assert report is not None
        for name, param in model.named_parameters():
            expected = param.detach().double().numpy()
            got = params_of(report)[name]
            assert np.linalg.norm(got - expected) / np.linalg.norm(expected) <= 1e-6, name
    _, log = coordinator.stop()
    # The worker's free-text reason is relayed and logged quoted (a newline cannot forge a line).
    assert "rank 1 abandoned step 2: 'simulated out of memory'" in log
