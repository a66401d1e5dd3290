"""A coordinator lost while a step is in flight costs that step's upload, not its compute.

Rank 1 stalls before the backward of step 5 while rank 0 has uploaded all of
it and waits for the averages; the coordinator is SIGKILLed right then and a
new one started at the same address. Both ranks still hold their gradients of
step 5, so they upload step 5 again instead of running it again.

Over TCP a bucket's average lands over the bytes it uploaded as soon as the
bucket completes, so a rank whose bucket 0 was averaged before the loss must
upload its own gradient again, restored from the messages it sent
(`BucketBuffer.record_sent`): the second test stalls rank 1 in the middle of
its backward (bucket 0 uploaded and averaged everywhere, the rest not) when the
coordinator dies, so the resend restores bucket 0 over a real transport. (Had
every rank re-sent bucket 0's average instead, the average of equal averages is
that average again: the unit tests in `test_resend_copy` catch a restore that
does nothing; this one catches one that restores anything but what was sent.)
"""

from __future__ import annotations

import re
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest
from gradsync.status import format_status, query_status
from gradsync_proto.net.launch import free_port
from support.faults import HEARTBEAT, assert_matches_reference, finish, job_status, wait_for
from support.processes import start_workers

STEPS = 10
STALL_STEP = 5


def rank_1_late_at_stall(address: str) -> Callable[[], bool]:
    """Whether the coordinator at `address` has step STALL_STEP open with only rank 1 late."""

    def only_rank_1_late() -> bool:
        job = job_status(address)
        return bool(
            job
            and job.open_step == STALL_STEP  # type: ignore[attr-defined]
            and [late.rank for late in job.late] == [1]  # type: ignore[attr-defined]
        )

    return only_rank_1_late


@pytest.mark.timeout(180)
def test_the_step_in_flight_is_uploaded_again_not_computed_again(
    tmp_path: Path, coordinator_factory, layout: str
) -> None:
    store = str(tmp_path / "checkpoints")
    flags = (*HEARTBEAT, "--checkpoint-store", store, "--checkpoint-every", "3")
    flags += ("--port", str(free_port()))
    first = coordinator_factory(2, *flags)
    processes = start_workers(
        first.address, 2, tmp_path, STEPS, {1: ["--sleep-at", f"{STALL_STEP}:4"]}
    )

    wait_for(
        rank_1_late_at_stall(first.address), 90, f"rank 0 to wait in the backward of {STALL_STEP}"
    )
    first.process.kill()
    first.process.wait()
    metrics_port = free_port()
    second = coordinator_factory(2, *flags, "--metrics-port", str(metrics_port))
    reports = finish(processes, tmp_path, timeout_s=120)
    for rank, report in enumerate(reports):
        assert report is not None and report["status"] == "ok", report
        assert report["restarts"] == [], report  # no CoordinatorRestartedError raised
        assert report["computed"][0] == STEPS, report  # every step computed once
        assert_matches_reference(report, 2, STEPS)  # none applied twice, none skipped
        if rank == 0:  # it was waiting for the averages of the stalled step
            assert report["resent"] == [STALL_STEP], report
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5) as page:
        exposition = page.read().decode()
    assert 'gradsync_restarts_total{outcome="continued"} 1.0' in exposition, exposition
    assert 'gradsync_restarts_total{outcome="checkpoint"} 0.0' in exposition
    assert "gradsync_steps_recomputed_total 0.0" in exposition
    # From the second coordinator's start to the job's first step on it.
    recovered = re.search(
        r'gradsync_failure_recover_seconds_sum\{kind="coordinator"\} ([0-9.e+-]+)', exposition
    )
    assert 'gradsync_failure_recover_seconds_count{kind="coordinator"} 1.0' in exposition
    assert recovered is not None and 0 < float(recovered.group(1)) < 60, exposition
    shown = format_status(query_status(second.address))
    assert "recovery: 1 restarts (1 continued, 0 from a checkpoint; 0 steps recomputed" in shown
    _, log = second.stop()
    continued = re.search(r"continued at step (\d+) from the ranks' own state", log)
    assert continued is not None and int(continued.group(1)) == STALL_STEP, log[-3000:]


@pytest.mark.timeout(180)
def test_averages_that_landed_before_the_loss_are_not_what_is_uploaded_again(
    tmp_path: Path, coordinator_factory, layout: str
) -> None:
    flags = (*HEARTBEAT, "--port", str(free_port()))
    first = coordinator_factory(2, *flags)
    stall = {1: ["--stall-mid-backward", f"{STALL_STEP}:6"]}
    processes = start_workers(first.address, 2, tmp_path, STEPS, stall)

    wait_for(
        rank_1_late_at_stall(first.address), 90, f"rank 1 to stall in the backward of {STALL_STEP}"
    )
    time.sleep(1.0)  # bucket 0, uploaded by both, is averaged and lands on both
    first.process.kill()
    first.process.wait()
    coordinator_factory(2, *flags)
    reports = finish(processes, tmp_path, timeout_s=120)
    for report in reports:
        assert report is not None and report["status"] == "ok", report
        assert report["restarts"] == [], report  # the step went on, nothing restored
        assert report["resent"] == [STALL_STEP], report
        # An average uploaded in place of a gradient would average it again: off.
        assert_matches_reference(report, 2, STEPS)
