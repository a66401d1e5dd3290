"""Screening a per-step DDP job, end to end: one rank's x100 gradients, named and left out.

A real `gradsync serve` and three real worker processes training
`support.scenarios.MixedModel` (a float32 and a float64 bucket) under
`DistributedDataParallel(screen="exclude")`. Rank 2 multiplies its loss by 100
from step 3 on (`screen_worker.py --scale-from 3`). The coordinator must name it
in step 3 (its log, /metrics and `gradsync status`), its own worker must warn, no honest
rank is ever named and nothing is flagged before the attack; and every rank
ends where one process ends that averages all three ranks' gradients for steps
0-2 and only the honest two's (divisor 2) from step 3 on.
"""

from __future__ import annotations

import re
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from gradsync.status import query_status
from gradsync_proto.net.launch import free_port
from support import scenarios
from support.processes import WORKERS, run_ranks

SCREEN_WORKER = WORKERS / "screen_worker.py"
WORLD = 3
CULPRIT = 2
ATTACK_STEP = 3
STEPS = 5


def _reference() -> dict[str, np.ndarray]:
    """One process: each step's per-rank gradients, averaged over the ranks the screen keeps."""
    model = scenarios.MixedModel(seed=0)
    optimizer = scenarios.make_optimizer(model)
    for step in range(STEPS):
        kept = range(WORLD) if step < ATTACK_STEP else [r for r in range(WORLD) if r != CULPRIT]
        per_rank = []
        for rank in kept:
            model.zero_grad(set_to_none=True)
            x, y = scenarios.rank_batch(step, WORLD, rank)
            scenarios.loss_fn(model(x), y).backward()
            per_rank.append(
                {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
            )
        for name, parameter in model.named_parameters():
            if name not in per_rank[0]:
                parameter.grad = None  # used by no rank: left alone, as DDP does
                continue
            total = per_rank[0][name].clone()
            for grads in per_rank[1:]:
                total += grads[name]  # in rank order, as the coordinator sums
            parameter.grad = total / len(per_rank)
        optimizer.step()
    return {name: p.detach().numpy().copy() for name, p in model.named_parameters()}


@pytest.mark.timeout(120)
def test_exclude_names_the_scaled_rank_in_its_step_and_averages_the_honest_ones(
    coordinator_factory, tmp_path: Path
) -> None:
    metrics_port = free_port()
    coordinator = coordinator_factory(WORLD, "--metrics-port", str(metrics_port))
    outputs = run_ranks(
        SCREEN_WORKER,
        coordinator.address,
        WORLD,
        tmp_path,
        "--screen",
        "exclude",
        "--steps",
        str(STEPS),
        per_rank={CULPRIT: ["--scale-from", str(ATTACK_STEP)]},
        timeout_s=90,
    )
    [job] = query_status(coordinator.address, "default", timeout_s=5).jobs
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5) as page:
        exposition = page.read().decode()
    _, log = coordinator.stop()
    flagged = [
        int(s) for s in re.findall(rf"rank {CULPRIT} in job 'default' round \(step\) (\d+)", log)
    ]
    assert flagged and min(flagged) == ATTACK_STEP, log
    assert not re.search(r"rank [01] in job", log), log  # the honest ranks are never named
    line = next(line for line in log.splitlines() if f"round (step) {ATTACK_STEP}:" in line)
    assert "norm" in line and "x the median" in line and ": excluded (" in line, line
    assert "thresholds: norm ratio > 8" in line, line
    assert job.screen == "exclude" and job.screened_contributions >= 1, job
    assert job.last_screened.startswith(f"rank {CULPRIT} in job 'default'"), job
    excluded = re.search(
        rf'gradsync_contribution_excluded_total{{rank="{CULPRIT}"}} (\S+)', exposition
    )
    assert excluded is not None and float(excluded.group(1)) == STEPS - ATTACK_STEP, exposition
    assert 'gradsync_contribution_flagged_total{rank="0"}' not in exposition
    assert 'gradsync_contribution_norm{rank="0"}' in exposition  # every rank measured
    # The culprit's worker warned in the step the attack began; nobody warned before.
    for rank, saved in enumerate(outputs):
        for step in range(STEPS):
            warned = str(saved[f"warnings/step{step}"])
            if rank == CULPRIT and step == ATTACK_STEP:
                assert f"flagged this rank's gradients in step {ATTACK_STEP}" in warned, warned
                assert f"rank {CULPRIT}: norm" in warned and "screen exclude" in warned, warned
            elif rank != CULPRIT or step < ATTACK_STEP:
                assert "screen" not in warned, (rank, step, warned)
    expected = _reference()
    for rank, saved in enumerate(outputs):
        for name, want in expected.items():
            got = saved[f"final/{name}"]
            scale = max(float(np.abs(want).max()), 1e-12)
            assert float(np.abs(got - want).max()) / scale <= 1e-5, (rank, name)
