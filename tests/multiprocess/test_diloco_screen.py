"""Screening DiLoCo contributions, end to end: one rank attacks, the coordinator names it.

Real `gradsync serve` and four real worker processes on the tiny model of
`support.diloco_reference`. From round 3 on rank 3 corrupts its pseudo-gradient
before upload (`diloco_worker.py --attack`): x100, sign-flipped, Gaussian noise or
five rounds stale. The coordinator must name rank 3 in the round the attack
starts, in its log, on /metrics, in `gradsync status` and on rank 3's own worker
(a warning with what was wrong and the thresholds); under "exclude" and
"trimmed_mean" the final model's held-out loss stays close to the honest run's,
under "report" the attack is named and merged (and the loss shows it). An honest
run under the strictest threshold policy flags nothing and ends exactly where
the one-process simulation does.
"""

from __future__ import annotations

import re
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import torch
from gradsync.status import query_status
from gradsync_proto.net.launch import free_port
from support.diloco_reference import OUT, Run, batch, make_model, simulate
from support.processes import WORKERS, run_ranks

DILOCO_WORKER = WORKERS / "diloco_worker.py"
NAMES = [name for name, _ in make_model(0).named_parameters()]
WORLD = 4
CULPRIT = 3
ATTACK_ROUND = 3
RUN = Run(rounds=4, sync_every=8, inner="sgd", inner_lr=0.05, hidden=32, task="teacher")


def held_out_loss(parameters: list[np.ndarray] | list[torch.Tensor]) -> float:
    """MSE of the model with `parameters` on batches no rank trained on."""
    model = make_model(0, RUN.hidden)
    with torch.no_grad():
        for target, values in zip(model.parameters(), parameters, strict=True):
            target.copy_(torch.as_tensor(np.asarray(values)))
        losses = []
        for step in range(8):
            x, y = batch(RUN, 1000, step)
            losses.append(float(torch.nn.functional.mse_loss(model(x), y)))
    assert y.shape[1] == OUT
    return float(np.mean(losses))


def final(saved: dict[str, np.ndarray]) -> list[np.ndarray]:
    return [saved[f"final/{name}"] for name in NAMES]


def screened_run(
    coordinator_factory, tmp_path: Path, screen: str, attack: str | None, *serve: str
) -> tuple[list[dict[str, np.ndarray]], str, str, object]:
    """Run the job; return the ranks' outputs, the metrics page, the log and the status."""
    metrics_port = free_port()
    coordinator = coordinator_factory(WORLD, "--metrics-port", str(metrics_port), *serve)
    per_rank = {CULPRIT: ["--attack", f"{attack}:{ATTACK_ROUND}"]} if attack else {}
    outputs = run_ranks(
        DILOCO_WORKER,
        coordinator.address,
        WORLD,
        tmp_path,
        *RUN.argv(),
        "--screen",
        screen,
        "--flat",
        per_rank=per_rank,
        timeout_s=120,
    )
    [job] = query_status(coordinator.address, "default", timeout_s=5).jobs
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5) as page:
        exposition = page.read().decode()
    _, log = coordinator.stop()
    return outputs, exposition, log, job


def honest_loss() -> float:
    return held_out_loss(simulate(RUN, WORLD, make_model(100, RUN.hidden))[-1])


def first_flagged_round(log: str) -> int:
    steps = [
        int(s) for s in re.findall(rf"rank {CULPRIT} in job 'default' round \(step\) (\d+)", log)
    ]
    assert steps, log
    return min(steps)


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("attack", "screen", "what"),
    [
        ("scaled", "exclude", "the median"),
        ("flipped", "exclude", "cosine"),
        ("random", "trimmed_mean", "cosine"),
        ("scaled", "report", "the median"),
    ],
)
def test_the_attacking_rank_is_named_within_its_first_round(
    coordinator_factory, tmp_path: Path, attack: str, screen: str, what: str
) -> None:
    outputs, exposition, log, job = screened_run(coordinator_factory, tmp_path, screen, attack)
    # The round the attack began in is the one that names it (the seed is step 0).
    assert first_flagged_round(log) == ATTACK_ROUND, log
    line = next(line for line in log.splitlines() if f"rank {CULPRIT} in job" in line)
    assert what in line and "thresholds: norm ratio > 8, cosine < 0.05" in line, line
    action = {"exclude": "excluded", "trimmed_mean": "trimmed", "report": "reported"}[screen]
    assert f": {action} (" in line, line
    assert not re.search(r"rank [012] in job", log), log  # honest ranks are never named
    assert job.screen == screen and job.screened_contributions >= 1, job
    assert job.last_screened.startswith(f"rank {CULPRIT} in job 'default'"), job
    assert f'gradsync_contribution_flagged_total{{rank="{CULPRIT}"}}' in exposition
    assert 'gradsync_contribution_flagged_total{rank="0"}' not in exposition
    assert re.search(rf'gradsync_contribution_norm{{rank="{CULPRIT}"}} \d', exposition)
    excluded = re.search(
        rf'gradsync_contribution_excluded_total{{rank="{CULPRIT}"}} (\S+)', exposition
    )
    if screen == "exclude":
        assert excluded is not None and float(excluded.group(1)) >= 1
    else:
        assert excluded is None
    # The culprit's own worker warned in the round the attack began, with the thresholds.
    for number in range(1, RUN.rounds + 1):
        warned = str(outputs[CULPRIT][f"warnings/round{number}"])
        if number < ATTACK_ROUND:
            assert "screen" not in warned, (number, warned)
        if number == ATTACK_ROUND:
            assert f"rank {CULPRIT}: " in warned and "thresholds: norm ratio > 8" in warned
    for rank in range(CULPRIT):  # the honest ranks' workers are told nothing about themselves
        for number in range(1, RUN.rounds + 1):
            assert "flagged this rank" not in str(outputs[rank][f"warnings/round{number}"])
    honest = honest_loss()
    loss = held_out_loss(final(outputs[0]))
    if screen == "report":  # named and merged: the x100 contribution wrecks the model
        assert loss > 2 * honest, (loss, honest)
    else:
        assert abs(loss - honest) / honest < 0.15, (loss, honest)


@pytest.mark.timeout(300)
def test_a_stale_contribution_is_bounded_by_the_trimmed_mean(
    coordinator_factory, tmp_path: Path
) -> None:
    outputs, _, _, job = screened_run(coordinator_factory, tmp_path, "trimmed_mean", "stale")
    assert job.screen == "trimmed_mean"
    honest = honest_loss()
    loss = held_out_loss(final(outputs[0]))
    assert abs(loss - honest) / honest < 0.15, (loss, honest)


@pytest.mark.timeout(300)
def test_an_honest_run_flags_nothing_and_matches_the_simulation(
    coordinator_factory, tmp_path: Path
) -> None:
    """The job asks for "clip"; the coordinator's floor makes it "exclude"."""
    outputs, exposition, log, job = screened_run(
        coordinator_factory, tmp_path, "clip", None, "--screen", "exclude"
    )
    assert job.screen == "exclude" and job.screened_contributions == 0, job
    assert "screen:" not in log, log
    assert "gradsync_contribution_flagged_total{" not in exposition
    assert 'gradsync_contribution_norm{rank="3"}' in exposition  # measured all the same
    expected = simulate(RUN, WORLD, make_model(100, RUN.hidden))
    for rank, saved in enumerate(outputs):
        for got, want in zip(final(saved), expected[-1], strict=True):
            assert float(np.abs(got - want.numpy()).max()) <= 1e-5, rank
        for number in range(1, RUN.rounds + 1):
            assert "screen" not in str(saved[f"warnings/round{number}"])
