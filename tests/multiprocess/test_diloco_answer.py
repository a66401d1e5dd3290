"""`gradsync.DiLoCo(answer_dtype=...)`: the compact answer, end to end over real processes.

With an int8 (bfloat16) answer the coordinator answers every outer round with
the change of the public copy of the global parameters, quantized, and every
rank adds it to the copy it holds (`gradsync_server.dataplane.outer_answer`).
Checked here with real `gradsync serve` processes (unsharded and two shards)
and real worker processes: every rank holds bitwise the same parameters after
every round; they equal, bitwise, the one-process simulation of the public-copy
rule (`support.diloco_reference.simulate` with `Run.answer`); the rule is really
used (the simulation of an exact answer is another result) yet the result
stays close to it and the training loss still falls; and a rank whose
answer_dtype differs from the others' is refused at join, naming both.
"""

from __future__ import annotations

import dataclasses
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from gradsync import defaults
from support.diloco_reference import Run, batch, make_model, simulate
from support.processes import WORKERS, launch_ranks, reap, run_ranks

DILOCO_WORKER = WORKERS / "diloco_worker.py"
NAMES = [name for name, _ in make_model(0).named_parameters()]
WORLD = 2


def rounds_of(saved: dict[str, np.ndarray], run: Run) -> list[list[np.ndarray]]:
    return [[saved[f"round{r}/{name}"] for name in NAMES] for r in range(run.rounds + 1)]


def largest_difference(got: list[np.ndarray], other: list[torch.Tensor]) -> float:
    return max(float(np.abs(a - b.numpy()).max()) for a, b in zip(got, other, strict=True))


def assert_bitwise(got: list[list[np.ndarray]], expected: list[list[torch.Tensor]]) -> None:
    """The ranks' parameters after every round are bitwise the simulation's.

    Bitwise, not within a tolerance: the simulation runs the very same float32
    operations elementwise in the same order (the inner steps, global - local, the
    int8 rule or the bfloat16 rounding, the coordinator's outer step op by op, then
    public + change), and each is correctly rounded, so nothing may differ.
    """
    for number, (ours, theirs) in enumerate(zip(got, expected, strict=True)):
        for name, a, b in zip(NAMES, ours, theirs, strict=True):
            assert np.array_equal(a, b.numpy()), (
                f"round {number}, {name}: {float(np.abs(a - b.numpy()).max()):.3g} "
                "from the public-copy simulation"
            )


def training_loss(run: Run, params: list[np.ndarray]) -> float:
    """The mean loss of `params` over every batch every rank trained on."""
    model = make_model(0, run.hidden)
    with torch.no_grad():
        for p, value in zip(model.parameters(), params, strict=True):
            p.copy_(torch.from_numpy(value))
        losses = [
            torch.nn.functional.mse_loss(model(x), y).item()
            for rank in range(WORLD)
            for x, y in (batch(run, rank, step) for step in range(run.rounds * run.sync_every))
        ]
    return sum(losses) / len(losses)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("shards", [1, 2], ids=["unsharded", "two-shards"])
def test_an_int8_answer_keeps_the_ranks_bitwise_equal_and_matches_the_public_copy_rule(
    shards: int, tmp_path: Path, coordinator_factory
) -> None:
    extra = ("--shards", str(shards)) if shards > 1 else ()
    coordinator = coordinator_factory(WORLD, *extra)
    run = Run(rounds=4, wire="int8", answer="int8")  # AdamW inside, Nesterov 0.9, H = 4
    outputs = run_ranks(DILOCO_WORKER, coordinator.address, WORLD, tmp_path, *run.argv())
    chunk_bytes = defaults.SHARDED_CHUNK_BYTES if shards > 1 else defaults.CHUNK_BYTES
    grid = {"chunk_bytes": chunk_bytes, "shard_count": shards}
    first = rounds_of(outputs[0], run)
    for other in outputs[1:]:
        for got, want in zip(rounds_of(other, run), first, strict=True):
            for a, b in zip(got, want, strict=True):
                np.testing.assert_array_equal(a, b)  # every rank adds the same bits
    exact_history: list[list[torch.Tensor]] = []
    expected = simulate(run, WORLD, make_model(100), exact_history=exact_history, **grid)
    assert_bitwise(first, expected)
    # The answers really were quantized changes: an exact answer is another result ...
    exact_answer = simulate(dataclasses.replace(run, answer="fp32"), WORLD, make_model(100), **grid)
    assert largest_difference(first[-1], exact_answer[-1]) > 1e-5
    # ... yet close to it (the error is carried forward, never accumulated), and the
    # public copy the ranks hold is within one quantum of the exact parameters.
    assert largest_difference(first[-1], exact_answer[-1]) < 0.05
    for public, exact in zip(expected, exact_history, strict=True):
        for p, e in zip(public, exact, strict=True):
            assert float((p - e).abs().max()) <= float(e.abs().max()) / 127 + 1e-6
    # A quarter of the float32 answer's bytes came down (plus a scale per chunk).
    elements = sum(p.size for p in first[0])
    received = int(outputs[0]["last_round_received"])
    assert elements < received <= elements + 4 * 2 * shards, (received, elements)
    # Training still works: the loss over the batches trained on falls, as with the exact answer.
    start, end = training_loss(run, first[0]), training_loss(run, first[-1])
    exact_end = training_loss(run, [p.numpy() for p in exact_answer[-1]])
    assert end < start, (start, end)
    assert abs(end - exact_end) <= 0.02 * exact_end, (end, exact_end)


@pytest.mark.timeout(150)
def test_a_bfloat16_answer_keeps_the_ranks_bitwise_equal_and_matches_the_public_copy_rule(
    tmp_path: Path, coordinator_factory
) -> None:
    coordinator = coordinator_factory(WORLD)
    run = Run(rounds=3, wire="bf16", answer="bf16")
    outputs = run_ranks(DILOCO_WORKER, coordinator.address, WORLD, tmp_path, *run.argv())
    first = rounds_of(outputs[0], run)
    for got, want in zip(rounds_of(outputs[1], run), first, strict=True):
        for a, b in zip(got, want, strict=True):
            np.testing.assert_array_equal(a, b)
    expected = simulate(run, WORLD, make_model(100))
    assert_bitwise(first, expected)
    exact_answer = simulate(dataclasses.replace(run, answer="fp32"), WORLD, make_model(100))
    assert 0 < largest_difference(first[-1], exact_answer[-1]) < 0.01


def captured(rank: int, argv: list[str]) -> subprocess.Popen[str]:
    """Start a rank; rank 1's output is kept (its refusal is read from it)."""
    output = subprocess.PIPE if rank == 1 else subprocess.DEVNULL
    return subprocess.Popen(argv, stdout=output, stderr=subprocess.STDOUT, text=True)


@pytest.mark.timeout(120)
def test_a_rank_with_another_answer_dtype_is_refused_at_join_naming_both(
    tmp_path: Path, coordinator_factory
) -> None:
    coordinator = coordinator_factory(WORLD)
    processes = launch_ranks(
        DILOCO_WORKER,
        coordinator.address,
        WORLD,
        lambda rank: tmp_path / f"rank{rank}.npz",
        *Run(wire="int8", answer="int8").argv(),
        per_rank={1: ["--answer", "fp32"]},  # the last flag wins: an exact answer
        launch=captured,
    )
    try:
        refused = processes[1].communicate(timeout=90)[0]  # rank 0 would wait for it in vain
    finally:
        reap(processes)
    assert processes[1].returncode != 0, refused
    assert "JoinRefusedError" in refused, refused
    assert "answer_dtype int8" in refused and "answer_dtype float32" in refused, refused
