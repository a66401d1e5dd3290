"""A local group's leader uploads its host's partial sums to every coordinator shard.

`serve --shards 2` and four ranks on two emulated hosts (two ranks each): only the
two local leaders open data streams that carry gradients, each bucket's ranges go
to their shards with `covered_ranks`, and the result equals the flat run of the
same ranks through the same shards within float32 rounding (the summation order
differs: each host sums first).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from support.hierarchy import (
    assert_ranks_identical,
    finish,
    max_relative_difference,
    run_of,
    start_job,
)
from support.processes import CoordinatorProcess

pytestmark = pytest.mark.timeout(150)

WORLD = 4


def test_hierarchical_through_two_shards_matches_flat(tmp_path: Path) -> None:
    coordinator = CoordinatorProcess(WORLD, "--shards", "2")
    try:
        processes = start_job(
            coordinator.address,
            WORLD,
            tmp_path,
            "--runs",
            "hier,flat",
            "--steps",
            "3",
            hosts=["host-a", "host-a", "host-b", "host-b"],
        )
        reports = finish(processes, tmp_path, timeout_s=120)
    finally:
        coordinator.stop()
    hier, flat = run_of(reports, 0, tmp_path), run_of(reports, 1, tmp_path)
    assert [run["local_ranks"] for run in hier] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert all(run["contributors"] == [WORLD] * 3 for run in hier)
    assert_ranks_identical(hier)
    assert_ranks_identical(flat)
    difference = max_relative_difference(hier[0], flat[0])
    print(f"hierarchical vs flat through 2 shards: max relative difference {difference:.3g}")
    assert difference <= 1e-6
