"""One rank's NaN, end to end: real coordinator (and shard) processes, real workers.

Rank 1 puts a NaN in one element of bucket 1 during the backward of step 2
(`fault_worker.py --nan-at 2`; it lies at the bucket's end, which a sharded
coordinator's shard 1 aggregates). Under `--nonfinite report` training goes
on (the workers skip the one update whose averaged gradient holds the NaN, as
GradScaler would), and the coordinator names rank, step and bucket in its
log, in `gradsync status` and on /metrics. Under `--nonfinite abort` every
rank gets `NonFiniteGradientError` naming rank 1 for step 2, skips it, and
trains on. Under `--nonfinite allow` nothing is checked: the NaN reaches every
rank's average, and nothing is counted.

Every case runs in both layouts: flat, and the default on one host, where both
ranks form a local group and rank 0 uploads their sum (the group finds that
rank 1's share held the NaN and says so, so rank 1 is still the one named).
"""

from __future__ import annotations

import urllib.request
from pathlib import Path

import pytest
from gradsync.status import query_status
from gradsync_proto.net.launch import free_port
from support.faults import HEARTBEAT, finish
from support.processes import start_workers
from support.shards import wait_for_shards

STEPS = 4
NAN_STEP = 2
CULPRIT = 1


def _run(coordinator_factory, tmp_path: Path, policy: str, shards: int, *worker_flags: str):  # type: ignore[no-untyped-def]
    metrics_port = free_port()
    extra = ["--shards", str(shards)] if shards > 1 else []
    coordinator = coordinator_factory(
        2, *HEARTBEAT, "--nonfinite", policy, "--metrics-port", str(metrics_port), *extra
    )
    if shards > 1:
        wait_for_shards(coordinator.address, shards, 60)
    per_rank = {CULPRIT: ["--nan-at", str(NAN_STEP)]}
    processes = start_workers(
        coordinator.address, 2, tmp_path, STEPS, per_rank, "--timeout-s", "30", *worker_flags
    )
    reports = finish(processes, tmp_path, timeout_s=90)
    for report in reports:
        assert report is not None and report["status"] == "ok", report
    return coordinator, metrics_port, reports


@pytest.mark.timeout(120)
@pytest.mark.parametrize("shards", [1, 2])
def test_report_names_the_rank_and_training_goes_on(
    coordinator_factory, tmp_path: Path, shards: int, layout: str
) -> None:
    coordinator, metrics_port, reports = _run(
        coordinator_factory, tmp_path, "report", shards, "--skip-nonfinite"
    )
    for report in reports:
        assert report["step"] == STEPS and report["skipped"] == []
        assert report["nonfinite_steps"] == [NAN_STEP], report  # the average held the NaN
    [job] = query_status(coordinator.address, "default", timeout_s=5).jobs
    assert job.nonfinite_contributions == 1, job
    assert f"rank {CULPRIT} sent non-finite gradients" in job.last_nonfinite
    assert f"bucket 1 of step {NAN_STEP}" in job.last_nonfinite
    if shards > 1:
        assert "shard 1" in job.last_nonfinite  # the shard's range held it, and said so
    # Hierarchical: the NaN came in rank 0's upload of the group's sum, which named rank 1.
    assert ("through its local leader, rank 0" in job.last_nonfinite) == (
        layout == "hierarchical"
    ), job.last_nonfinite
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5) as page:
        exposition = page.read().decode()
    assert f'gradsync_nonfinite_contributions_total{{rank="{CULPRIT}"}} 1.0' in exposition
    _, log = coordinator.stop()
    assert (
        f"rank {CULPRIT} sent non-finite gradients (NaN/Inf) for bucket 1 of step {NAN_STEP}" in log
    )


@pytest.mark.timeout(120)
@pytest.mark.parametrize("shards", [1, 2])
def test_abort_refuses_the_step_for_every_rank_naming_the_culprit(
    coordinator_factory, tmp_path: Path, shards: int, layout: str
) -> None:
    coordinator, _, reports = _run(coordinator_factory, tmp_path, "abort", shards, "--skip-aborted")
    for rank, report in enumerate(reports):
        assert report["step"] == STEPS and report["skipped"] == [NAN_STEP], report
        [abort] = report["aborts"]
        assert abort["class"] == "NonFiniteGradientError", abort
        assert abort["culprit"] == CULPRIT and abort["step"] == NAN_STEP and abort["bucket"] == 1
        assert f"[rank {rank}, step {NAN_STEP}, bucket 1]" in abort["message"]
        assert f"rank {CULPRIT} sent non-finite gradients" in abort["message"]
        if shards > 1:
            assert "shard 1" in abort["message"]
        assert ("through its local leader, rank 0" in abort["message"]) == (
            layout == "hierarchical"
        ), abort["message"]
    [job] = query_status(coordinator.address, "default", timeout_s=5).jobs
    assert job.steps_completed == STEPS - 1  # every step but the aborted one
    assert job.nonfinite_contributions == 1 and f"rank {CULPRIT}" in job.last_nonfinite


@pytest.mark.timeout(120)
def test_allow_checks_nothing_and_the_nan_reaches_every_average(
    coordinator_factory, tmp_path: Path, layout: str
) -> None:
    coordinator, metrics_port, reports = _run(
        coordinator_factory, tmp_path, "allow", 1, "--skip-nonfinite"
    )
    for report in reports:
        assert report["step"] == STEPS and report["nonfinite_steps"] == [NAN_STEP], report
    [job] = query_status(coordinator.address, "default", timeout_s=5).jobs
    assert job.nonfinite_contributions == 0 and job.last_nonfinite == "", job
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5) as page:
        assert "gradsync_nonfinite_contributions_total{" not in page.read().decode()
    _, log = coordinator.stop()
    assert "non-finite" not in log
