"""Ranks started at human pace: seconds apart, in any order, the coordinator last.

The README's multi-host recipe is typed by a person on several hosts, so the
processes start seconds apart. These tests run the real `gradsync serve` and
`gradsync worker` commands that way and check what that person sees: the job
finishes with equal parameters on every rank, the waiting is explained in the
logs ("waiting for ranks [2] of 3", "connection refused") instead of looking
like a hang, and a mistyped address fails at once.
"""

from __future__ import annotations

import re
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from gradsync_proto.net.launch import free_port
from support.logwatch import WatchedProcess, assert_quiet
from support.processes import CoordinatorProcess

GRADSYNC = [sys.executable, "-m", "gradsync.cli"]
#: How late the last rank comes: more than twice the heartbeat timeout (5 s), so a
#: waiting rank that were not kept alive would be declared dead meanwhile.
LATE_RANK_S = 12.0
#: How long the workers run before their coordinator starts.
LATE_COORDINATOR_S = 10.0
#: The worker logs why it cannot reach the coordinator within this many seconds.
REASON_WITHIN_S = 10.0


@pytest.fixture
def watched() -> Iterator[list[WatchedProcess]]:
    """Processes a test starts; any still running at the end is killed."""
    processes: list[WatchedProcess] = []
    yield processes
    for process in processes:
        process.kill()


def start_worker(
    watched: list[WatchedProcess], address: str, rank: int, world_size: int, out: Path
) -> WatchedProcess:
    worker = WatchedProcess(
        [
            *GRADSYNC,
            "worker",
            "--coordinator",
            address,
            "--rank",
            str(rank),
            "--world-size",
            str(world_size),
            "--epochs",
            "1",
            "--timeout-s",
            "60",
            "--no-progress",
            "--save",
            str(out / "rank{rank}.npz"),
        ],
        name=f"worker rank {rank}",
    )
    watched.append(worker)
    return worker


def assert_reason_logged(worker: WatchedProcess, address: str, reason: str) -> None:
    """The worker logs the address and why it cannot reach it within 10 s of trying.

    Counted from the worker's first connection attempt (its "joining job" line),
    not from the process start: importing torch alone takes seconds on a busy host.
    """
    joining_at, _ = worker.wait_for(r"joining job", timeout_s=60)
    at, line = worker.wait_for(
        rf"{re.escape(address)}.*{reason}", timeout_s=joining_at + REASON_WITHIN_S + 10
    )
    assert at - joining_at < REASON_WITHIN_S, (
        f"{worker.name} logged the reason {at - joining_at:.1f}s after it started to connect: "
        f"{line}"
    )


def finish_all(workers: list[WatchedProcess], timeout_s: float) -> list[str]:
    """Wait for every worker to exit 0 (each output checked for noise); return the outputs."""
    texts = []
    for worker in workers:
        code, text = worker.finish(timeout_s)
        assert code == 0, f"{worker.name} exited with {code}:\n{text}"
        assert_quiet(text, worker.name)
        texts.append(text)
    return texts


def assert_equal_parameters(out: Path, world_size: int) -> None:
    """Every rank saved bitwise the same parameters (rank 0's start, averaged steps)."""
    saved = [dict(np.load(out / f"rank{rank}.npz")) for rank in range(world_size)]
    names = [name for name in saved[0] if not name.startswith("__")]
    assert names
    for rank in range(1, world_size):
        for name in names:
            np.testing.assert_array_equal(saved[rank][name], saved[0][name], err_msg=name)


@pytest.mark.timeout(60)
def test_a_rank_twelve_seconds_late_joins_and_the_job_finishes(
    watched: list[WatchedProcess], tmp_path: Path
) -> None:
    coordinator = CoordinatorProcess(3, "--heartbeat-timeout", "5")
    try:
        early = [start_worker(watched, coordinator.address, rank, 3, tmp_path) for rank in (0, 1)]
        for worker in early:
            # The coordinator's first AssemblyProgress: the waiting rank says whom it waits for.
            worker.wait_for(r"waiting for ranks \[2\] of 3", timeout_s=30)
        time.sleep(max(0.0, LATE_RANK_S - (time.monotonic() - early[0].started)))
        for worker in early:
            assert worker.process.poll() is None, f"{worker.name} gave up:\n{worker.text}"
        late = start_worker(watched, coordinator.address, 2, 3, tmp_path)
        finish_all([*early, late], timeout_s=40)
    finally:
        code, log = coordinator.stop()
    assert code == 0, log
    assert "waiting for ranks [2] of 3" in log, log
    assert "declared dead" not in log, log
    assert_quiet(log, "the coordinator")
    assert_equal_parameters(tmp_path, 3)


@pytest.mark.timeout(60)
def test_workers_first_and_the_coordinator_ten_seconds_later(
    watched: list[WatchedProcess], tmp_path: Path
) -> None:
    port = free_port()
    address = f"127.0.0.1:{port}"
    workers = [start_worker(watched, address, rank, 2, tmp_path) for rank in (0, 1)]
    for worker in workers:
        # Nothing listens yet: within 10 s the worker names the address and the reason.
        assert_reason_logged(worker, address, "connection refused")
    time.sleep(max(0.0, LATE_COORDINATOR_S - (time.monotonic() - workers[0].started)))
    coordinator = CoordinatorProcess(2, "--port", str(port))
    try:
        finish_all(workers, timeout_s=40)
    finally:
        code, log = coordinator.stop()
    assert code == 0, log
    assert_quiet(log, "the coordinator")
    assert_equal_parameters(tmp_path, 2)


@pytest.mark.parametrize(
    ("address", "reason"),
    [
        ("http://127.0.0.1:50051", "has a scheme"),
        ("127.0.0.1:0", "outside 1..65535"),
        ("127.0.0.1:65536", "outside 1..65535"),
        ("127.0.0.1", "has no port"),
        (":50051", "empty host"),
    ],
)
def test_a_malformed_address_exits_2_at_once_naming_the_flag(
    watched: list[WatchedProcess], tmp_path: Path, address: str, reason: str
) -> None:
    started = time.monotonic()
    code, text = start_worker(watched, address, 0, 2, tmp_path).finish(timeout_s=20)
    assert code == 2, text
    assert "argument --coordinator" in text and reason in text and repr(address) in text
    assert_quiet(text, "the worker")
    assert time.monotonic() - started < 5


@pytest.mark.timeout(60)
def test_an_unreachable_address_is_explained_within_ten_seconds(
    watched: list[WatchedProcess], tmp_path: Path
) -> None:
    address = f"127.0.0.1:{free_port()}"  # nothing listens there
    worker = start_worker(watched, address, 0, 2, tmp_path)
    assert_reason_logged(worker, address, "connection refused")
    assert worker.process.poll() is None, "the worker must keep waiting for its coordinator"
