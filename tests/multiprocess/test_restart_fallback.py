"""A restarted coordinator refuses to continue from ranks whose states disagree.

Restart without rollback trusts the ranks furthest ahead only when they hold the same
digest (`control/restart.py`). Here rank 1's training loop edits its own weights between
two steps, outside the optimizer (a real user bug: nothing on the gradient path sees it),
so at the restart the two ranks claim the same step with different states. The
coordinator must say so, fall back to the last checkpoint (taken before the edit), and
the job must end exactly where an uninterrupted run ends: the bad edit is undone by the
rollback and not repeated (the worker makes it once per process).
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from gradsync_proto.net.launch import free_port
from support.faults import HEARTBEAT, assert_matches_reference, finish, job_status, wait_for
from support.processes import start_workers
from support.redisserver import RedisServer

#: Steps of the run; a checkpoint every CHECKPOINT_EVERY steps (3, 6, 9).
STEPS, CHECKPOINT_EVERY = 12, 3
#: Rank 1 edits its weights before the forward of this step (after checkpoint 3).
DRIFT_AT = 4
#: Rank 0 stalls before the backward of this step, so the coordinator is killed in it,
#: before the checkpoint of step 6 can make the drifted state durable.
KILLED_IN = 5


@pytest.mark.timeout(240)
def test_ranks_that_disagree_on_their_state_roll_back_to_the_checkpoint(
    redis_server: RedisServer, tmp_path: Path, coordinator_factory: Any
) -> None:
    port = str(free_port())
    flags = (*HEARTBEAT, "--checkpoint-store", redis_server.url)
    flags += ("--checkpoint-every", str(CHECKPOINT_EVERY), "--port", port)
    first = coordinator_factory(2, *flags)
    per_rank = {0: ["--sleep-at", f"{KILLED_IN}:6"], 1: ["--drift-at", str(DRIFT_AT)]}
    processes = start_workers(first.address, 2, tmp_path, STEPS, per_rank, "--step-delay-s", "0.1")

    def stalled_in_step_5() -> bool:
        job = job_status(first.address)
        return bool(job and job.open_step == KILLED_IN and job.last_checkpoint_step == 3)

    wait_for(stalled_in_step_5, 90, f"step {KILLED_IN} open with the checkpoint of step 3")
    first.process.kill()
    first.process.wait()
    time.sleep(1.0)  # the workers notice and start reconnecting
    second = coordinator_factory(2, *flags)

    def restarted() -> bool:
        job = job_status(second.address)
        return bool(job and job.restart)

    wait_for(restarted, 60, "the restarted coordinator to decide how the job goes on")
    job = job_status(second.address)
    assert job is not None
    expected = f"job 'default' rolled back: the ranks at step {KILLED_IN} disagree on their state"
    assert job.restart.startswith(expected), job.restart
    assert "resuming from the checkpoint of step 3" in job.restart, job.restart
    # Both ranks had applied 5 steps; the job goes on from 3: 2 steps each, computed again.
    assert job.steps_recomputed == 2 * (KILLED_IN - 3), job.steps_recomputed
    shown = subprocess.run(
        [sys.executable, "-m", "gradsync.cli", "status", "--coordinator", second.address],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert shown.returncode == 0, shown.stderr
    assert f"restart: {expected}" in shown.stdout, shown.stdout
    assert f"({2 * (KILLED_IN - 3)} steps recomputed)" in shown.stdout, shown.stdout

    reports = finish(processes, tmp_path, timeout_s=150)
    for rank, report in enumerate(reports):
        assert report is not None and report["status"] == "ok", report
        assert report["restarts"] == [3], report["restarts"]  # restored the checkpoint of 3
        assert report["drifted"] == ([DRIFT_AT] if rank == 1 else []), report["drifted"]
        # Steps 3 and 4 (applied, then rolled back) ran twice, and step 5 too where its
        # backward had begun (a forward that lost the coordinator is only retried); the
        # result is still an uninterrupted run's.
        recomputed = report["computed"][0] - STEPS
        assert KILLED_IN - 3 <= recomputed <= KILLED_IN - 3 + 1, report["computed"]
        assert_matches_reference(report, 2, STEPS)
    _, log = second.stop()
    assert expected in log, log[-3000:]
    assert "resuming from the checkpoint of step 3" in log, log[-3000:]
