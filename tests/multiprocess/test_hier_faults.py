"""Hierarchical aggregation under SIGKILL: of a local leader, of a local follower.

The local group's segment is an anonymous file in `$GRADSYNC_SHM_DIR`; these tests
point it at a tmpfs mounted for the test alone (root, as in CI), so that "the
memory is freed after a SIGKILL" is checked on a filesystem nobody else uses:
its usage (statvfs) must be non-zero while the job trains and 0 after it ended,
and /dev/shm must not have gained an entry. (A too-small dir and an elastic job
that loses a follower are in test_hier_training, which shares its processes.)
"""

from __future__ import annotations

import os
import re
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from support.faults import HEARTBEAT, wait_for
from support.hierarchy import (
    DEV_SHM,
    can_mount_tmpfs,
    finish,
    log_of,
    private_tmpfs,
    start_job,
    used_bytes,
)
from support.processes import CoordinatorProcess, reap

pytestmark = pytest.mark.timeout(120)

WORLD = 3
#: From the kill to the survivors' exit: the heartbeat timeout (2 s), one second of
#: slack, the process exit (as in test_fault_tolerance), plus the local group's
#: bounded wait for the coordinator's verdict (3 heartbeat intervals).
FAILURE_BOUND_S = 2 + 1 + 5 + 3 * 0.25


def exit_times(processes: list[subprocess.Popen[bytes]], timeout_s: float) -> list[float]:
    """When (time.monotonic) each process exited; waits for all of them."""
    deadline = time.monotonic() + timeout_s
    ended: dict[int, float] = {}
    while len(ended) < len(processes) and time.monotonic() < deadline:
        for index, process in enumerate(processes):
            if index not in ended and process.poll() is not None:
                ended[index] = time.monotonic()
        time.sleep(0.02)
    return [ended.get(index, float("inf")) for index in range(len(processes))]


def test_sigkill_of_a_local_leader_or_follower_fails_every_survivor_and_frees_the_segment(
    coordinator_factory: Callable[..., CoordinatorProcess], tmp_path: Path
) -> None:
    ok, reason = can_mount_tmpfs(tmp_path)
    if not ok:
        pytest.skip(reason)
    # Two jobs at once on one coordinator: one loses its local leader, one a follower.
    coordinator = coordinator_factory(WORLD, *HEARTBEAT)
    victims = {"leader": 0, "follower": 2}
    dev_shm_before = set(os.listdir(DEV_SHM))
    with (
        private_tmpfs(tmp_path / "shm-leader", "16m") as leader_shm,
        private_tmpfs(tmp_path / "shm-follower", "16m") as follower_shm,
    ):
        shm = {"leader": leader_shm, "follower": follower_shm}
        jobs = {
            role: start_job(
                coordinator.address,
                WORLD,
                tmp_path / f"kill-{role}",
                "--runs",
                "hier+kill",
                "--steps",
                "40",
                "--step-delay-s",
                "0.05",
                hosts=[f"host-{role}"] * WORLD,
                shm_dir=shm[role],
                per_rank={victim: ["--kill-at", "3"]},
            )
            for role, victim in victims.items()
        }
        try:
            # The segment lives in our tmpfs while the group trains (not in /dev/shm).
            for role in victims:
                wait_for(lambda r=role: used_bytes(shm[r]) > 0, 60, f"a segment in {role}'s dir")
            ended = {role: exit_times(jobs[role], 60) for role in victims}
        finally:
            for processes in jobs.values():
                reap(processes)
        for role, victim in victims.items():
            out = tmp_path / f"kill-{role}"
            processes = jobs[role]
            reports = finish(processes, out)
            assert processes[victim].returncode == -9 and reports[victim] is None, role
            for rank in (r for r in range(WORLD) if r != victim):
                runs = reports[rank]
                assert runs is not None, f"{role}: rank {rank}\n{log_of(out, rank)}"
                (run,) = runs
                # The message, less its "[rank r, step s]" prefix, names the killed rank.
                named = re.search(rf"\brank {victim}\b", run["message"].split("]", 1)[-1])
                assert run["status"] != "ok" and named, (
                    f"killed the {role} (rank {victim}); rank {rank} ended with "
                    f"{run['status']}: {run['message']}"
                )
                assert processes[rank].returncode == 3, (role, rank, log_of(out, rank))
                took = ended[role][rank] - ended[role][victim]
                assert took < FAILURE_BOUND_S, (role, rank, took)
            # Nothing of the segment is left: no name, no blocks in use.
            assert os.listdir(shm[role]) == [], role
            assert used_bytes(shm[role]) == 0, role
    assert set(os.listdir(DEV_SHM)) <= dev_shm_before
