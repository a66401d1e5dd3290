"""The hub's per-rank collectives through `gradsync.collectives.Collectives`, between real
worker processes and a real coordinator: reduce_scatter, gather, scatter, all_to_all and
the product all_reduce against numpy, and a rank that disagrees failing every rank with
both values named.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from support.processes import WORKERS, CoordinatorProcess, launch_ranks, reap

pytestmark = pytest.mark.multiprocess

WORKER = WORKERS / "hub_collectives_worker.py"
WORLD = 3
ROWS = [[1, 0, 3], [2, 5, 0], [0, 2, 4]]


def captured(rank: int, argv: list[str]) -> subprocess.Popen[str]:
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def run_job(tmp_path: Path, *extra: str) -> tuple[list[int], list[str]]:
    coordinator = CoordinatorProcess(WORLD)
    try:
        processes = launch_ranks(
            WORKER,
            coordinator.address,
            WORLD,
            lambda rank: tmp_path / f"rank{rank}.npz",
            *extra,
            launch=captured,
        )
        try:
            texts = [process.communicate(timeout=120)[0] for process in processes]
        finally:
            reap(processes)
    finally:
        coordinator.stop()
    return [process.returncode for process in processes], texts


def values(rank: int, count: int) -> np.ndarray:
    return (np.arange(count) % 7 + 1 + rank).astype(np.float64)


@pytest.mark.timeout(180)
def test_per_rank_collectives_match_numpy_across_three_processes(tmp_path: Path) -> None:
    codes, texts = run_job(tmp_path)
    assert codes == [0] * WORLD, "\n".join(texts)
    outs = [dict(np.load(tmp_path / f"rank{rank}.npz")) for rank in range(WORLD)]
    summed = sum(values(r, 5 * WORLD) for r in range(WORLD))
    bf16 = [torch.from_numpy(values(r, 3 * WORLD)).to(torch.bfloat16) / 3 for r in range(WORLD)]
    averaged = ((bf16[0].float() + bf16[1].float() + bf16[2].float()) / WORLD).to(torch.bfloat16)
    product = np.prod([values(r, 2 * WORLD) for r in range(WORLD)], axis=0)
    for rank, out in enumerate(outs):
        np.testing.assert_array_equal(out["reduce_scatter_sum"], summed[rank * 5 : rank * 5 + 5])
        np.testing.assert_array_equal(
            out["reduce_scatter_avg_bf16"], averaged[rank * 3 : rank * 3 + 3].float().numpy()
        )
        np.testing.assert_array_equal(
            out["reduce_scatter_product"], product[rank * 2 : rank * 2 + 2].astype(np.int64)
        )
        np.testing.assert_array_equal(
            out["all_reduce_product"],
            np.prod([values(r, 4) for r in range(WORLD)], axis=0).astype(np.float32),
        )
        assert bool(out["gather_is_none"]) == (rank != 1)
        np.testing.assert_array_equal(out["scatter"], values(10 * rank, 4).astype(np.float32))
        expected = np.concatenate(
            [np.full((ROWS[s][rank], 2), 100.0 * s + rank) for s in range(WORLD)]
        )
        np.testing.assert_array_equal(out["all_to_all"], expected)
    np.testing.assert_array_equal(
        outs[1]["gather"], np.stack([values(r, 3) for r in range(WORLD)]).astype(np.float32)
    )


@pytest.mark.timeout(180)
def test_a_gather_to_another_root_fails_every_rank_naming_both_roots(tmp_path: Path) -> None:
    codes, texts = run_job(tmp_path, "--mismatch")
    assert codes == [3] * WORLD, "\n".join(texts)
    for rank in range(WORLD):
        error = str(np.load(tmp_path / f"rank{rank}.npz")["error"])
        # Whichever of ranks 0 and 1 arrived first is the one the error compares with.
        assert re.search(
            r"rank 2 sent collective \d+ \(gather\) from root 1, but rank [01] named root 0", error
        ), (rank, error)
