"""`round_deadline_s="auto"`: the grace window of real rounds follows a rank that slowed.

Real `gradsync serve` and three real worker processes. Rank 2 sleeps before its upload
in rounds 5-8 (far longer than the others take), then runs at their pace again. So that
its late uploads are for the round right after (not skipped past, which would leave it
rounds behind the others at the end), the others start each round after a slow one
once rank 2 is about to upload (a file it touches). The coordinator's log says when the
window changed and who missed it: the slowed rank misses the window first, the window
widens, and once the rank recovered the window comes back down within 2 rounds; no
round ever closes with fewer than the quorum (2).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from support.diloco_reference import Run
from support.processes import WORKERS, run_ranks

DILOCO_WORKER = WORKERS / "diloco_worker.py"
WORLD = 3
SLOW = 2
SLOW_ROUNDS = range(5, 9)
SLEEP_S = 1.5
ROUNDS = 14


@pytest.mark.timeout(300)
def test_the_window_widens_for_a_slowed_rank_and_settles_after_it_recovered(
    tmp_path: Path, coordinator_factory
) -> None:
    coordinator = coordinator_factory(WORLD)
    run = Run(rounds=ROUNDS, sync_every=2)
    outputs = run_ranks(
        DILOCO_WORKER,
        coordinator.address,
        WORLD,
        tmp_path,
        *run.argv(),
        *("--min-contributors", "2", "--round-deadline-s", "auto"),
        per_rank={
            0: [f for r in SLOW_ROUNDS for f in ("--before-round", f"{r + 1}:{tmp_path / str(r)}")],
            1: [f for r in SLOW_ROUNDS for f in ("--before-round", f"{r + 1}:{tmp_path / str(r)}")],
            SLOW: [
                *(f for r in SLOW_ROUNDS for f in ("--before-round", f"{r}:{SLEEP_S}")),
                *(
                    f
                    for r in SLOW_ROUNDS
                    for f in ("--touch-before-round", f"{r}:{tmp_path / str(r)}")
                ),
            ],
        },
        timeout_s=240,
    )
    _, log = coordinator.stop()
    # Never below the quorum: every round the fast ranks saw had at least 2 contributors.
    for rank in (0, 1):
        counts = [int(outputs[rank][f"contributors/round{n}"]) for n in range(1, ROUNDS + 1)]
        assert min(counts) >= 2, counts
    # The slowed rank missed the window (its round was late) and was named for it.
    late = [n for n in SLOW_ROUNDS if bool(outputs[SLOW][f"late/round{n}"])]
    assert late, "the slowed rank never missed the window"
    assert re.search(r"closed after [0-9.]+ s without rank\(s\) \[2\]", log), log
    windows = [
        (int(step), float(seconds))
        for seconds, step in re.findall(r"grace window ([0-9.]+) s from round (\d+)", log)
    ]
    assert windows, log
    first = windows[0][1]
    widest = max(seconds for _, seconds in windows)
    assert widest > 2 * first, windows  # it widened while the rank was slow
    last_step, last = windows[-1]
    assert last < widest / 2, windows  # and came back down once it recovered
    # The rank recovered after round 8 (the coordinator counts the seed as step 0): the
    # window settled within 2 rounds (a late round can shift the count by one).
    assert last_step <= SLOW_ROUNDS[-1] + 1 + 2 + 1, windows
