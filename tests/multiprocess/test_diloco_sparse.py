"""`gradsync.DiLoCo(wire_dtype=gradsync.SparseWire(...))`: the sparse 2-bit wire end to end.

Real `gradsync serve` processes and real worker processes (three ranks):
every rank uploads each chunk's top-k of its pseudo-gradient plus residual
in 2 bits, the coordinator sums them in float32, takes the outer step and
answers with the top-k of the change of its public copy. Checked: every rank
holds bitwise the same parameters after every round, bitwise those of the
one-process simulation written from the rule (`support.sparse_reference`);
the rule is really used (an exact run is another result); the bytes down per
rank do not grow with the number of ranks; and a rank with another answer
density is refused at join.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch
from gradsync import defaults
from support.diloco_reference import Run, make_model, simulate
from support.processes import WORKERS, run_ranks

DILOCO_WORKER = WORKERS / "diloco_worker.py"
NAMES = [name for name, _ in make_model(0).named_parameters()]
SPARSE = Run(rounds=4, wire="topk2", answer="topk2", density=0.1)


def rounds_of(saved: dict[str, np.ndarray], run: Run) -> list[list[np.ndarray]]:
    return [[saved[f"round{r}/{name}"] for name in NAMES] for r in range(run.rounds + 1)]


def largest_difference(got: list[np.ndarray], other: list[torch.Tensor]) -> float:
    return max(float(np.abs(a - b.numpy()).max()) for a, b in zip(got, other, strict=True))


@pytest.mark.timeout(180)
@pytest.mark.parametrize("shards", [1, 2], ids=["unsharded", "two-shards"])
def test_the_sparse_wire_keeps_three_ranks_bitwise_equal_to_the_simulation(
    shards: int, tmp_path: Path, coordinator_factory
) -> None:
    world = 3
    extra = ("--shards", str(shards)) if shards > 1 else ()
    coordinator = coordinator_factory(world, *extra)
    outputs = run_ranks(DILOCO_WORKER, coordinator.address, world, tmp_path, *SPARSE.argv())
    chunk_bytes = defaults.SHARDED_CHUNK_BYTES if shards > 1 else defaults.CHUNK_BYTES
    grid = {"chunk_bytes": chunk_bytes, "shard_count": shards}
    first = rounds_of(outputs[0], SPARSE)
    for other in outputs[1:]:
        for got, want in zip(rounds_of(other, SPARSE), first, strict=True):
            for a, b in zip(got, want, strict=True):
                np.testing.assert_array_equal(a, b)  # every rank adds the same bits
    expected = simulate(SPARSE, world, make_model(100), **grid)
    for number, (ours, theirs) in enumerate(zip(first, expected, strict=True)):
        for name, a, b in zip(NAMES, ours, theirs, strict=True):
            assert np.array_equal(a, b.numpy()), (
                f"round {number}, {name}: {float(np.abs(a - b.numpy()).max()):.3g} "
                "from the simulation of the sparse rule"
            )
    # The rule was really used: an exact float32 run ends elsewhere, and so does a
    # sparse run of another density.
    exact = simulate(Run(rounds=SPARSE.rounds), world, make_model(100), **grid)
    assert largest_difference(first[-1], exact[-1]) > 1e-4
    denser = simulate(dataclasses.replace(SPARSE, density=0.2), world, make_model(100), **grid)
    assert largest_difference(first[-1], denser[-1]) > 0
    # Bytes each way: far below float32's (4 per element) even on this tiny model.
    elements = sum(p.size for p in first[0])
    for saved in outputs:
        up, down = int(saved["last_round_bytes"]), int(saved["last_round_received"])
        assert 0 < up < elements, (up, elements)
        assert 0 < down < elements, (down, elements)


@pytest.mark.timeout(240)
def test_the_bytes_down_per_rank_do_not_grow_with_the_world(
    tmp_path: Path, coordinator_factory
) -> None:
    run = dataclasses.replace(SPARSE, rounds=2, hidden=200)
    down: dict[int, list[int]] = {}
    for world in (2, 4):
        coordinator = coordinator_factory(world)
        out = tmp_path / f"w{world}"
        out.mkdir()
        outputs = run_ranks(DILOCO_WORKER, coordinator.address, world, out, *run.argv())
        down[world] = [int(saved["last_round_received"]) for saved in outputs]
    elements = sum(p.numel() for p in make_model(0, run.hidden).parameters())
    # k = ceil(0.1 n) per chunk, about 1.25 bytes each plus a few bytes a chunk, whatever W.
    for world, received in down.items():
        assert all(0 < r <= 0.2 * elements for r in received), (world, received, elements)
    assert max(down[4]) <= 1.1 * min(down[2]), down
