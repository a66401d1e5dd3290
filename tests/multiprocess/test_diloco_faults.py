"""A DiLoCo rank lost in the middle of an outer round, under both failure policies.

Real `gradsync serve`, real worker processes, a real SIGKILL. The rank dies inside
round R's upload: the first bucket autograd handed over has reached the coordinator
(and completed there with every rank's copy), the others never will.

- `--on-failure elastic`: the round must not block. The other buckets complete over
  the survivors, the delivered one keeps the average it completed with, every later round
  averages over the survivors, and the run finishes with both survivors bitwise
  equal and equal to a one-process simulation of exactly that (each inner step
  run once).
- `--on-failure abort` (the default): the survivors fail within seconds of the
  heartbeat timeout, with an error that names the lost rank, instead of hanging.
"""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
from support.diloco_reference import Run, make_model, simulate
from support.processes import WORKERS, launch_ranks, reap

DILOCO_WORKER = WORKERS / "diloco_worker.py"
#: One parameter per bucket for the test model (its largest is 12 x 6 float32).
BUCKET_MB = "0.00001"
HEARTBEAT = ("--heartbeat-interval", "0.2", "--heartbeat-timeout", "2")


def _captured(rank: int, argv: list[str]) -> subprocess.Popen[str]:
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


@pytest.mark.timeout(180)
def test_a_rank_killed_mid_round_is_dropped_from_what_it_never_sent_under_elastic(
    tmp_path: Path, coordinator_factory, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("GRADSYNC_HIERARCHICAL", "0")  # one rank per host: a rank, not a group
    world, dies_in = 3, 2
    coordinator = coordinator_factory(
        world, "--on-failure", "elastic", "--min-workers", "2", *HEARTBEAT
    )
    run = Run(rounds=3)
    processes = launch_ranks(
        DILOCO_WORKER,
        coordinator.address,
        world,
        lambda rank: tmp_path / f"rank{rank}.npz",
        *run.argv(),
        "--bucket-mb",
        BUCKET_MB,
        per_rank={2: ["--die-mid-round", str(dies_in)]},
    )
    try:
        codes = [process.wait(timeout=150) for process in processes]
    finally:
        reap(processes)
    assert codes == [0, 0, -9], codes
    outputs = [dict(np.load(tmp_path / f"rank{rank}.npz")) for rank in range(2)]
    names = [name for name, _ in make_model(0, run.hidden).named_parameters()]
    report = json.loads((tmp_path / "rank2.died.json").read_text())
    delivered = [int(i) for i in outputs[0][f"bucket{report['delivered_bucket']}"]]
    assert 0 < len(delivered) < len(names), "the model must span several buckets"
    expected = simulate(run, world, make_model(100), lost=(2, dies_in), partial=delivered)
    for number in range(run.rounds + 1):
        for index, name in enumerate(names):
            ours = outputs[0][f"round{number}/{name}"]
            np.testing.assert_array_equal(ours, outputs[1][f"round{number}/{name}"])
            worst = float(np.abs(ours - expected[number][index].numpy()).max())
            assert worst <= 1e-5, f"round {number}, {name}: {worst:.3g} from the simulation"
    # Had the bucket it delivered been dropped too, round 2 would differ: the test can tell.
    dropped = simulate(run, world, make_model(100), lost=(2, dies_in))
    index = delivered[0]
    gap = float((expected[dies_in][index] - dropped[dies_in][index]).abs().max())
    assert gap > 1e-4, gap
    assert all(int(o["inner_steps"]) == run.rounds * run.sync_every for o in outputs)


@pytest.mark.timeout(120)
def test_a_rank_killed_mid_round_fails_the_others_naming_it_under_abort(
    tmp_path: Path, coordinator_factory, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("GRADSYNC_HIERARCHICAL", "0")
    world = 2
    coordinator = coordinator_factory(world, "--on-failure", "abort", *HEARTBEAT)
    run = Run(rounds=3)
    processes = launch_ranks(
        DILOCO_WORKER,
        coordinator.address,
        world,
        lambda rank: tmp_path / f"rank{rank}.npz",
        *run.argv(),
        "--bucket-mb",
        BUCKET_MB,
        per_rank={1: ["--die-mid-round", "2"]},
        launch=_captured,
    )
    try:
        processes[1].communicate(timeout=90)  # (read to the end: its pipe is closed)
        assert processes[1].returncode == -9
        killed_at = time.monotonic()
        text, _ = processes[0].communicate(timeout=60)
        failed_after = time.monotonic() - killed_at
    finally:
        reap(processes)
    assert processes[0].returncode not in (0, None), text
    # Named: the lost rank, and the round (the fragment job's step 2: the seed was step 0).
    assert "PeerLostError" in text and "rank 1 disconnected" in text, text[-3000:]
    assert "at step 2" in text, text[-3000:]
    assert failed_after < 30, f"the survivor took {failed_after:.1f}s to fail"
