"""Collectives, SyncBatchNorm and join() between real worker processes and a real coordinator;
a worker that starts before its coordinator; an unreachable coordinator's reason in the logs.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from gradsync_proto.net.launch import free_port
from support.processes import WORKERS, CoordinatorProcess, launch_ranks, reap

pytestmark = pytest.mark.multiprocess

COLLECTIVES_WORKER = WORKERS / "collectives_worker.py"


def captured(rank: int, argv: list[str]) -> subprocess.Popen[str]:
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def finish(processes: list[subprocess.Popen[str]], timeout_s: float = 120) -> list[str]:
    """Wait for every rank; return their output; fail naming the ranks that failed."""
    try:
        texts = [process.communicate(timeout=timeout_s)[0] for process in processes]
    finally:
        reap(processes)
    failed = [rank for rank, process in enumerate(processes) if process.returncode != 0]
    assert not failed, "\n".join(f"rank {rank}:\n{texts[rank]}" for rank in failed)
    return texts


def load(path: Path) -> dict[str, np.ndarray]:
    with np.load(path) as data:
        return dict(data)


@pytest.fixture(autouse=True)
def _one_rank_per_host(monkeypatch: pytest.MonkeyPatch) -> None:
    """These ranks stand for one per host: join() needs hierarchical=False (README, "Not
    combined (yet)"; under the default a grouped rank's join() raises RuntimeError saying
    so), as the DDP zoo runs its uneven-input cases flat."""
    monkeypatch.setenv("GRADSYNC_HIERARCHICAL", "0")


@pytest.mark.timeout(180)
def test_collectives_syncbn_and_join_across_three_ranks(tmp_path: Path) -> None:
    world = 3
    coordinator = CoordinatorProcess(world)
    try:
        processes = launch_ranks(
            COLLECTIVES_WORKER,
            coordinator.address,
            world,
            lambda rank: tmp_path / f"rank{rank}.npz",
            launch=captured,
        )
        finish(processes)
    finally:
        coordinator.stop()
    outs = [load(tmp_path / f"rank{rank}.npz") for rank in range(world)]
    mine = [np.array([r + 1.0, -2.0 * r, 0.5], dtype=np.float32) for r in range(world)]
    for out in outs:
        np.testing.assert_array_equal(out["sum"], sum(mine))
        np.testing.assert_allclose(out["avg"], sum(mine) / world, rtol=1e-6)
        np.testing.assert_array_equal(out["min"], [0, 8])
        np.testing.assert_array_equal(out["max"], [2, 10])
        np.testing.assert_array_equal(out["big"], [world - 1.0] * 4)
        np.testing.assert_array_equal(out["gather"], np.stack(mine))
    reference: dict[str, Any] = outs[0]
    for out in outs[1:]:
        # Batch statistics were global: every rank tracked the same running stats,
        # although each normalized a batch of a different size and content.
        np.testing.assert_allclose(out["running_mean"], reference["running_mean"], rtol=1e-6)
        np.testing.assert_allclose(out["running_var"], reference["running_var"], rtol=1e-6)
        # join(): rank 2 ran 3 steps, the others fewer; all end equal, at the same step.
        assert int(out["step_after_join"]) == int(reference["step_after_join"])
        for name in reference:
            if name.startswith("state."):
                np.testing.assert_array_equal(out[name], reference[name], err_msg=name)
    assert np.abs(reference["running_mean"]).sum() > 0


@pytest.mark.timeout(180)
def test_workers_started_12_s_before_their_coordinator_train(tmp_path: Path) -> None:
    world, port = 2, free_port()
    address = f"127.0.0.1:{port}"
    processes = launch_ranks(
        COLLECTIVES_WORKER,
        address,
        world,
        lambda rank: tmp_path / f"rank{rank}.npz",
        "--scenario",
        "join-only",
        launch=captured,
    )
    coordinator = None
    try:
        time.sleep(12)
        assert all(process.poll() is None for process in processes), "a worker gave up early"
        coordinator = CoordinatorProcess(world, "--port", str(port))
        texts = finish(processes)
    finally:
        reap(processes)
        if coordinator is not None:
            coordinator.stop()
    assert f"cannot reach the coordinator at {address} (connection refused)" in texts[0]
    states = [load(tmp_path / f"rank{rank}.npz") for rank in range(world)]
    for name in states[0]:
        np.testing.assert_array_equal(states[1][name], states[0][name], err_msg=name)


@pytest.mark.timeout(60)
def test_an_unreachable_coordinator_is_logged_with_its_reason_within_10_s(
    tmp_path: Path,
) -> None:
    with socket.socket() as holder:  # bound, not listening: refused
        holder.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{holder.getsockname()[1]}"
        argv = [
            sys.executable,
            str(COLLECTIVES_WORKER),
            "--coordinator",
            address,
            "--rank",
            "0",
            "--world-size",
            "1",
            "--out",
            str(tmp_path / "rank0.npz"),
            "--join-timeout-s",
            "14",
        ]
        started = time.monotonic()  # lines are stamped as they arrive
        with captured(0, argv) as process:
            try:
                assert process.stdout is not None
                lines = [(time.monotonic() - started, line) for line in process.stdout]
                process.wait(timeout=30)
            finally:
                reap([process])
    # Measured from the start of joining, not of the process (importing torch varies).
    joining = [at for at, line in lines if "joining job" in line]
    warnings = [(at, line) for at, line in lines if "cannot reach the coordinator" in line]
    assert joining and warnings, "".join(line for _, line in lines)
    first_at, first = warnings[0]
    assert first_at - joining[0] < 10, f"first report {first_at - joining[0]:.1f}s after joining"
    assert f"at {address} (connection refused); still trying for" in first
    assert len(warnings) >= 2  # and again ~10 s later
    assert process.returncode == 3
    error = str(load(tmp_path / "rank0.npz")["error"])
    assert f"could not reach the coordinator at {address} within 14s: connection refused" in error
