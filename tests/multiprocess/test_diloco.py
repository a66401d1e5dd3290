"""`gradsync.DiLoCo` end to end: real `gradsync serve` processes and real worker processes.

The coordinator holds the global parameters and runs the outer optimizer; every
rank's parameters after every round must equal a one-process simulation of W
replicas with `torch.optim.SGD(nesterov=True)` as the outer optimizer
(`support.diloco_reference`), bitwise equal across ranks, unsharded and with
the parameters cut over two shards (each holding its range's global parameters
and momentum), in both layouts (flat, and a local group whose leader uploads the
group's sum). `sync_every=1, outer_lr=1, outer_momentum=0` with an inner SGD is
plain gradient averaging, so it must equal single-process SGD on the global batch.
A 16-bit wire is checked against the same simulation rounding each pseudo-gradient
the same way, with the rounding error fed back; an int8 wire against the simulation
quantizing each chunk of the coordinator's grid with its own scale (told the chunk
size and shard count), at the default chunk size (one chunk per shard range for the
tiny model) and at 4 KiB chunks with a model whose bucket spans several of them.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch
from gradsync import defaults
from gradsync.status import query_status
from gradsync_proto.net.launch import free_port
from support.diloco_reference import Run, batch, make_model, simulate, simulate_streaming
from support.faults import wait_for
from support.processes import WORKERS, CoordinatorProcess, launch_ranks, reap, run_ranks

DILOCO_WORKER = WORKERS / "diloco_worker.py"
NAMES = [name for name, _ in make_model(0).named_parameters()]
WORLD = 2
#: 4 KiB, the smallest chunk a coordinator accepts (--chunk-mb is in MiB; 0.004 MiB
#: would be 4194 bytes, not a whole number of float32 elements).
SMALL_CHUNK_MB, SMALL_CHUNK = "0.00390625", 4096


def rounds_of(saved: dict[str, np.ndarray], run: Run) -> list[list[np.ndarray]]:
    return [[saved[f"round{r}/{name}"] for name in NAMES] for r in range(run.rounds + 1)]


def assert_matches(
    outputs: list[dict[str, np.ndarray]], run: Run, tolerance: float, **grid: int
) -> None:
    """Every rank holds bitwise the same parameters after every round, equal to the simulation.

    `grid`: the coordinator's chunk_bytes and shard_count, for the int8 wire's simulation.
    """
    # Rank 0's model, broadcast at construction.
    expected = simulate(run, WORLD, make_model(100, run.hidden), **grid)
    first = rounds_of(outputs[0], run)
    for other in outputs[1:]:
        for got, want in zip(rounds_of(other, run), first, strict=True):
            for a, b in zip(got, want, strict=True):
                np.testing.assert_array_equal(a, b)  # the ranks adopt the same bytes
    for number, (got, want) in enumerate(zip(first, expected, strict=True)):
        worst = max(float(np.abs(a - b.numpy()).max()) for a, b in zip(got, want, strict=True))
        assert worst <= tolerance, f"round {number}: {worst:.3g} from the simulation"
    moved = max(float(np.abs(a - b).max()) for a, b in zip(first[-1], first[0], strict=True))
    assert moved > 1e-3, "the global parameters did not move: nothing was trained"
    assert all(int(o["inner_steps"]) == run.rounds * run.sync_every for o in outputs)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("shards", [1, 2], ids=["unsharded", "two-shards"])
def test_outer_nesterov_on_the_coordinator_matches_a_one_process_simulation(
    shards: int, layout: str, tmp_path: Path, coordinator_factory
) -> None:
    extra = ("--shards", str(shards)) if shards > 1 else ()
    coordinator = coordinator_factory(WORLD, *extra)
    run = Run()  # AdamW inside, Nesterov outside, H = 4, 3 rounds
    outputs = run_ranks(DILOCO_WORKER, coordinator.address, WORLD, tmp_path, *run.argv())
    assert_matches(outputs, run, 1e-5)


@pytest.mark.timeout(120)
def test_one_inner_step_outer_lr_1_no_momentum_is_plain_gradient_averaging(
    tmp_path: Path, coordinator_factory
) -> None:
    coordinator = coordinator_factory(WORLD)
    run = Run(rounds=4, sync_every=1, outer_lr=1.0, outer_momentum=0.0, inner="sgd")
    outputs = run_ranks(DILOCO_WORKER, coordinator.address, WORLD, tmp_path, *run.argv())
    # Single-process SGD on the global batch (both ranks' batches, mean loss).
    model = make_model(100)
    optimizer = torch.optim.SGD(model.parameters(), lr=run.inner_lr)
    for step in range(run.rounds):
        batches = [batch(run, rank, step) for rank in range(WORLD)]
        x = torch.cat([b[0] for b in batches])
        y = torch.cat([b[1] for b in batches])
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
        got = [outputs[0][f"round{step + 1}/{name}"] for name in NAMES]
        for a, p in zip(got, model.parameters(), strict=True):
            np.testing.assert_allclose(a, p.detach().numpy(), rtol=0, atol=1e-6)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("wire", ["bf16", "fp16"])
def test_a_16_bit_wire_with_error_feedback_matches_its_rounding_reference(
    wire: str, tmp_path: Path, coordinator_factory
) -> None:
    coordinator = coordinator_factory(WORLD)
    run = Run(wire=wire)
    outputs = run_ranks(DILOCO_WORKER, coordinator.address, WORLD, tmp_path, *run.argv())
    assert_matches(outputs, run, 1e-5)
    # Without the residual the result would be another one: the feedback is really used.
    plain = simulate(dataclasses.replace(run, wire="fp32"), WORLD, make_model(100))[-1]
    got = rounds_of(outputs[0], run)[-1]
    assert max(float(np.abs(a - b.numpy()).max()) for a, b in zip(got, plain, strict=True)) > 0
    # Half the bytes of a float32 round go up (the seed, in float32, is not a round).
    fp32_dir = tmp_path / "fp32"
    fp32_dir.mkdir()
    fp32 = run_ranks(
        DILOCO_WORKER,
        coordinator.address,
        WORLD,
        fp32_dir,
        *dataclasses.replace(run, wire="fp32").argv(),
        "--job-id",
        "fp32",
    )
    ratio = int(outputs[0]["last_round_bytes"]) / int(fp32[0]["last_round_bytes"])
    assert 0.4 < ratio < 0.75, ratio  # the presence vector and headers stay full size


@pytest.mark.timeout(120)
def test_a_rank_started_seconds_later_joins_and_the_run_matches(
    tmp_path: Path, coordinator_factory
) -> None:
    coordinator = coordinator_factory(WORLD)
    run = Run(rounds=2)
    processes = launch_ranks(
        DILOCO_WORKER,
        coordinator.address,
        WORLD,
        lambda rank: tmp_path / f"rank{rank}.npz",
        *run.argv(),
        per_rank={1: ["--start-delay-s", "10"]},
    )
    try:
        for process in processes:
            assert process.wait(timeout=90) == 0
    finally:
        reap(processes)
    outputs = [dict(np.load(tmp_path / f"rank{rank}.npz")) for rank in range(WORLD)]
    assert_matches(outputs, run, 1e-5)


@pytest.mark.timeout(180)
def test_a_rank_killed_between_rounds_leaves_the_round_to_the_survivors_under_elastic(
    tmp_path: Path, coordinator_factory, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("GRADSYNC_HIERARCHICAL", "0")  # one rank per host: a rank, not a group
    world = 3
    coordinator = coordinator_factory(
        world, "--on-failure", "elastic", "--min-workers", "2",
        "--heartbeat-interval", "0.2", "--heartbeat-timeout", "2",
    )  # fmt: skip
    run = Run(rounds=3)
    dies_at = run.sync_every + 2  # inside round 2's inner steps
    processes = launch_ranks(
        DILOCO_WORKER,
        coordinator.address,
        world,
        lambda rank: tmp_path / f"rank{rank}.npz",
        *run.argv(),
        per_rank={2: ["--die-at-step", str(dies_at)]},
    )
    try:
        codes = [process.wait(timeout=120) for process in processes]
    finally:
        reap(processes)
    assert codes[:2] == [0, 0] and codes[2] == -9, codes
    outputs = [dict(np.load(tmp_path / f"rank{rank}.npz")) for rank in range(2)]
    expected = simulate(run, world, make_model(100), lost=(2, 2))
    got = rounds_of(outputs[0], run)
    for a, b in zip(got[-1], rounds_of(outputs[1], run)[-1], strict=True):
        np.testing.assert_array_equal(a, b)
    for number, (ours, want) in enumerate(zip(got, expected, strict=True)):
        worst = max(float(np.abs(a - b.numpy()).max()) for a, b in zip(ours, want, strict=True))
        assert worst <= 1e-5, f"round {number}: {worst:.3g} from the simulation"


@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    ("fragments", "overlap"), [(2, 0), (2, 1), (3, 2)], ids=["F2", "F2-tau1", "F3-tau2"]
)
def test_streaming_fragments_at_staggered_steps_match_a_one_process_simulation(
    fragments: int, overlap: int, tmp_path: Path, coordinator_factory
) -> None:
    coordinator = coordinator_factory(WORLD)
    run = Run(rounds=3, sync_every=6, fragments=fragments, overlap_steps=overlap)
    outputs = run_ranks(DILOCO_WORKER, coordinator.address, WORLD, tmp_path, *run.argv())
    split = [int(n) for n in outputs[0]["fragment_sizes"]]
    assert len(split) == fragments and sum(split) == len(NAMES)
    expected = simulate_streaming(run, WORLD, make_model(100), split)
    for rank, output in enumerate(outputs):
        got = [output[f"final/{name}"] for name in NAMES]
        worst = max(
            float(np.abs(a - b.numpy()).max()) for a, b in zip(got, expected[rank], strict=True)
        )
        assert worst <= 1e-5, f"rank {rank}: {worst:.3g} from the simulation"
    # Every fragment ran its rounds: H / F apart, so the link carries one at a time.
    assert int(outputs[0]["inner_steps"]) == run.rounds * run.sync_every


@pytest.mark.timeout(180)
def test_a_rank_that_rejoins_a_running_job_starts_from_the_global_parameters(
    tmp_path: Path, coordinator_factory, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("GRADSYNC_HIERARCHICAL", "0")
    world = 3
    coordinator = coordinator_factory(
        world, "--on-failure", "elastic", "--min-workers", "2",
        "--heartbeat-interval", "0.2", "--heartbeat-timeout", "2",
    )  # fmt: skip
    run = Run(rounds=12)
    slow = ["--step-delay-s", "0.3"]  # ~15 s of training: time for the rank to come back
    processes = launch_ranks(
        DILOCO_WORKER,
        coordinator.address,
        world,
        lambda rank: tmp_path / f"rank{rank}.npz",
        *run.argv(),
        per_rank={0: slow, 1: slow, 2: ["--die-at-step", "2"]},
    )
    rejoined = []
    try:
        assert processes[2].wait(timeout=60) == -9
        # The same rank, started again by hand: it joins the running job for one round.
        rejoined = launch_ranks(
            DILOCO_WORKER,
            coordinator.address,
            world,
            lambda rank: tmp_path / f"rejoined{rank}.npz",
            *dataclasses.replace(run, rounds=1).argv(),
            ranks=[2],
        )
        codes = [processes[0].wait(timeout=120), processes[1].wait(timeout=120)]
        codes.append(rejoined[0].wait(timeout=60))
    finally:
        reap([*processes, *rejoined])
    assert codes == [0, 0, 0], codes
    survivor = rounds_of(dict(np.load(tmp_path / "rank0.npz")), run)
    newcomer = dict(np.load(tmp_path / "rejoined2.npz"))
    start = [newcomer[f"round0/{name}"] for name in NAMES]
    after = [newcomer[f"round1/{name}"] for name in NAMES]
    same = [
        number
        for number, params in enumerate(survivor)
        if number and all(np.array_equal(a, b) for a, b in zip(params, start, strict=True))
    ]
    assert same, "the rejoined rank did not start from any round's global parameters"
    # Its one round was one of the job's: it ends on the same global parameters.
    following = survivor[same[0] + 1]
    for a, b in zip(after, following, strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.timeout(180)
def test_a_coordinator_killed_mid_run_is_seeded_again_and_no_inner_step_is_repeated(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SIGKILL the coordinator during the run and start it again on the same port, with no
    checkpoint store: the ranks hold the global parameters, seed it with them, repeat the
    round that was lost and finish, each having run every inner step exactly once."""
    monkeypatch.setenv("GRADSYNC_HIERARCHICAL", "0")
    port = free_port()
    first = CoordinatorProcess(WORLD, "--port", str(port))
    run = Run(rounds=6)
    processes = launch_ranks(
        DILOCO_WORKER,
        first.address,
        WORLD,
        lambda rank: tmp_path / f"rank{rank}.npz",
        *run.argv(),
        "--step-delay-s",
        "0.2",
    )
    second = None
    try:
        wait_for(lambda: _rounds_at(first.address) >= 2, 60, "two rounds on the first coordinator")
        first.process.kill()
        first.stop(signal_first=False)
        second = CoordinatorProcess(WORLD, "--port", str(port))
        codes = [process.wait(timeout=120) for process in processes]
    finally:
        reap(processes)
        if second is not None:
            second.stop()
    assert codes == [0, 0], codes
    outputs = [dict(np.load(tmp_path / f"rank{rank}.npz")) for rank in range(WORLD)]
    for output in outputs:
        assert int(output["inner_steps"]) == run.rounds * run.sync_every  # nothing recomputed
    final = [[o[f"final/{name}"] for name in NAMES] for o in outputs]
    for a, b in zip(*final, strict=True):
        np.testing.assert_array_equal(a, b)  # one global model after the last round
        assert np.isfinite(a).all()
    start = rounds_of(outputs[0], run)[0]
    moved = max(float(np.abs(a - b).max()) for a, b in zip(final[0], start, strict=True))
    assert moved > 1e-3


def _rounds_at(address: str) -> int:
    """The open step (seed + rounds) of the default job at `address` (0 if none yet)."""
    try:
        jobs = query_status(address, "default", timeout_s=2).jobs
    except ConnectionError:
        return 0
    return int(jobs[0].open_step) if jobs else 0


def largest_difference(got: list[np.ndarray], other: list[torch.Tensor]) -> float:
    return max(float(np.abs(a - b.numpy()).max()) for a, b in zip(got, other, strict=True))


def fp32_round_bytes(run: Run, address: str, out_dir: Path) -> int:
    """Bytes rank 0 uploads in a round of the same run on a float32 wire (another job)."""
    out_dir.mkdir()
    fp32 = dataclasses.replace(run, wire="fp32").argv()
    outputs = run_ranks(DILOCO_WORKER, address, WORLD, out_dir, *fp32, "--job-id", "fp32")
    return int(outputs[0]["last_round_bytes"])


@pytest.mark.timeout(150)
@pytest.mark.parametrize("shards", [1, 2], ids=["unsharded", "two-shards"])
def test_an_int8_wire_with_error_feedback_matches_its_quantizing_reference(
    shards: int, tmp_path: Path, coordinator_factory
) -> None:
    extra = ("--shards", str(shards)) if shards > 1 else ()
    coordinator = coordinator_factory(WORLD, *extra)
    run = Run(wire="int8")
    outputs = run_ranks(DILOCO_WORKER, coordinator.address, WORLD, tmp_path, *run.argv())
    chunk_bytes = defaults.SHARDED_CHUNK_BYTES if shards > 1 else defaults.CHUNK_BYTES
    assert_matches(outputs, run, 1e-5, chunk_bytes=chunk_bytes, shard_count=shards)
    got = rounds_of(outputs[0], run)[-1]
    # 8 bits lose something (the simulation is not the float32 one by accident) ...
    plain = simulate(dataclasses.replace(run, wire="fp32"), WORLD, make_model(100))[-1]
    assert largest_difference(got, plain) > 1e-5
    # ... and the ranks fed the error back: without it the result is another one.
    unfed = simulate(
        run,
        WORLD,
        make_model(100),
        chunk_bytes=chunk_bytes,
        shard_count=shards,
        error_feedback=False,
    )
    assert largest_difference(got, unfed[-1]) > 1e-5
    if shards == 1:
        # A quarter of a float32 round's bytes, plus a scale per chunk and the presence bucket.
        ratio = int(outputs[0]["last_round_bytes"]) / fp32_round_bytes(
            run, coordinator.address, tmp_path / "fp32"
        )
        assert 0.25 < ratio < 0.35, ratio


@pytest.mark.timeout(150)
@pytest.mark.parametrize("shards", [1, 2], ids=["unsharded", "two-shards"])
def test_int8_scales_are_per_chunk_when_a_bucket_spans_many_chunks(
    shards: int, tmp_path: Path, coordinator_factory
) -> None:
    extra = ("--shards", str(shards)) if shards > 1 else ()
    coordinator = coordinator_factory(WORLD, "--chunk-mb", SMALL_CHUNK_MB, *extra)
    # 20483 parameters in one bucket: 5 chunks of int8 unsharded, 3 per shard's range at S=2.
    run = Run(rounds=2, wire="int8", hidden=2048)
    outputs = run_ranks(DILOCO_WORKER, coordinator.address, WORLD, tmp_path, *run.argv())
    assert_matches(outputs, run, 1e-5, chunk_bytes=SMALL_CHUNK, shard_count=shards)
    # One scale per shard range (a chunk as large as the bucket) is another result:
    # the ranks' scales really were per chunk.
    coarse = simulate(
        run, WORLD, make_model(100, run.hidden), chunk_bytes=2**30, shard_count=shards
    )
    assert largest_difference(rounds_of(outputs[0], run)[-1], coarse[-1]) > 1e-4
    if shards == 1:
        ratio = int(outputs[0]["last_round_bytes"]) / fp32_round_bytes(
            run, coordinator.address, tmp_path / "fp32"
        )
        assert 0.25 < ratio < 0.26, ratio  # 20483 + 5 scales of 4 bytes + 16 vs 81948
