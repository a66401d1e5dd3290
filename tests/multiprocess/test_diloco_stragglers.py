"""`gradsync.DiLoCo` with stragglers: partial rounds, late contributions, weighted averages.

Real `gradsync serve` and real worker processes. A slow rank sleeps, or waits for a
file another rank touches after a given round, before it starts a round, so which
round closes without it is decided by the test, not by timing luck; the other ranks
never wait for it (the round closes at its deadline with k of n). Every rank's
parameters after every round must equal `support.diloco_reference.simulate_stragglers`
run on the same schedule (who contributed in time, which late contribution was
dropped or merged where), and all ranks must end bitwise equal: the late rank was
answered with the global parameters and continued from them.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from support.diloco_reference import (
    BATCH,
    LocalRound,
    Run,
    make_model,
    on_time_rounds,
    simulate,
    simulate_stragglers,
)
from support.processes import WORKERS, run_ranks

DILOCO_WORKER = WORKERS / "diloco_worker.py"
NAMES = [name for name, _ in make_model(0).named_parameters()]
WORLD = 3
SLOW = 2
#: The round deadline: long against a few tiny inner steps, short against the slow rank.
DEADLINE_S = 3.0


def params_at(saved: dict[str, np.ndarray], number: int | str) -> list[np.ndarray]:
    key = number if isinstance(number, str) else f"round{number}"
    return [saved[f"{key}/{name}"] for name in NAMES]


def worst(got: list[np.ndarray], want: list) -> float:
    return max(float(np.abs(a - b.numpy()).max()) for a, b in zip(got, want, strict=True))


def assert_all_equal_at_the_end(outputs: list[dict[str, np.ndarray]]) -> None:
    """The late rank ends with the global parameters: every rank holds the same bytes."""
    for other in outputs[1:]:
        for a, b in zip(params_at(other, "final"), params_at(outputs[0], "final"), strict=True):
            np.testing.assert_array_equal(a, b)


def partial_flags(late: str, *extra: str) -> tuple[str, ...]:
    return (
        "--min-contributors",
        "2",
        "--round-deadline-s",
        str(DEADLINE_S),
        "--late",
        late,
        *extra,
    )


@pytest.mark.timeout(300)
@pytest.mark.parametrize("late", ["drop", "merge"])
def test_a_round_closes_without_a_sleeping_rank_and_its_late_contribution_is_dropped_or_merged(
    late: str, tmp_path: Path, coordinator_factory
) -> None:
    """Round 1 closes with ranks 0 and 1 at the deadline while rank 2 sleeps; rank 2's
    round-1 upload is late: dropped, or merged into round 2 (which waits for it to have
    arrived, then has all three on time plus the late one, staleness 1)."""
    coordinator = coordinator_factory(WORLD)
    run = Run(rounds=3)
    sleep_s = DEADLINE_S + 4.0
    caught_up = tmp_path / "rank2-uploads-round2"
    outputs = run_ranks(
        DILOCO_WORKER,
        coordinator.address,
        WORLD,
        tmp_path,
        *run.argv(),
        *partial_flags(late),
        per_rank={
            0: ["--before-round", f"2:{caught_up}"],
            1: ["--before-round", f"2:{caught_up}"],
            SLOW: ["--before-round", f"1:{sleep_s}", "--touch-before-round", f"2:{caught_up}"],
        },
        timeout_s=240,
    )
    merged = 2 if late == "merge" else None
    schedule = {
        0: on_time_rounds(3),
        1: on_time_rounds(3),
        SLOW: [LocalRound(0, None, merged), LocalRound(1, 2), LocalRound(2, 3)],
    }
    expected = simulate_stragglers(run, WORLD, make_model(100), schedule, rounds=3)
    for rank in (0, 1):
        assert int(outputs[rank]["contributors/round1"]) == 2  # closed without rank 2
        assert not bool(outputs[rank]["late/round1"])
        # It did not wait for the sleeping rank (it sleeps far longer than the deadline).
        assert float(outputs[rank]["seconds/round1"]) < sleep_s
        assert int(outputs[rank]["contributors/round2"]) == 3
        assert int(outputs[rank]["merged/round2"]) == (1 if merged else 0)
        assert int(outputs[rank]["staleness/round2"]) == (1 if merged else 0)
        for number in range(4):
            error = worst(params_at(outputs[rank], number), expected[number])
            assert error <= 1e-5, f"rank {rank}, round {number}: {error:.3g} from the simulation"
    # Rank 2's round 1 was late: answered with the global parameters of round 1.
    assert bool(outputs[SLOW]["late/round1"])
    assert int(outputs[SLOW]["contributors/round1"]) == 0
    for a, b in zip(params_at(outputs[SLOW], 1), params_at(outputs[0], 1), strict=True):
        np.testing.assert_array_equal(a, b)
    assert_all_equal_at_the_end(outputs)
    # The schedule matters: the run without the straggler is another one.
    everyone = simulate(run, WORLD, make_model(100))
    assert worst(params_at(outputs[0], 3), everyone[3]) > 1e-4
    if merged:  # and merging the late contribution is not the same as dropping it
        dropped = {**schedule, SLOW: [LocalRound(0, None), *schedule[SLOW][1:]]}
        other = simulate_stragglers(run, WORLD, make_model(100), dropped, rounds=3)
        assert worst(params_at(outputs[0], 3), other[3]) > 1e-4


@pytest.mark.timeout(300)
def test_a_late_contribution_older_than_the_staleness_bound_is_dropped(
    tmp_path: Path, coordinator_factory
) -> None:
    """Rank 2 waits until rounds 1 and 2 closed without it; its round-1 upload then is
    two rounds old when round 3 starts, past max_staleness=1: dropped. It continues
    from round 2's global parameters and makes round 3 in time."""
    coordinator = coordinator_factory(WORLD)
    run = Run(rounds=3)
    round2_done, caught_up = tmp_path / "round2-done", tmp_path / "rank2-uploads-its-round2"
    slow_run = Run(rounds=2)  # one round behind the coordinator: it does one round less
    slow_flags = [*slow_run.argv(), "--before-round", f"1:{round2_done}"]
    outputs = run_ranks(
        DILOCO_WORKER,
        coordinator.address,
        WORLD,
        tmp_path,
        *run.argv(),
        *partial_flags("merge", "--max-staleness", "1"),
        per_rank={
            0: ["--after-round", f"2:{round2_done}", "--before-round", f"3:{caught_up}"],
            1: ["--before-round", f"3:{caught_up}"],
            SLOW: [*slow_flags, "--touch-before-round", f"2:{caught_up}"],
        },
        timeout_s=240,
    )
    schedule = {
        0: on_time_rounds(3),
        1: on_time_rounds(3),
        SLOW: [LocalRound(0, None, None), LocalRound(2, 3)],
    }
    expected = simulate_stragglers(run, WORLD, make_model(100), schedule, rounds=3)
    for rank in (0, 1):
        assert [int(outputs[rank][f"contributors/round{n}"]) for n in (1, 2, 3)] == [2, 2, 3]
        assert int(outputs[rank]["merged/round3"]) == 0  # too stale: dropped
        for number in range(4):
            error = worst(params_at(outputs[rank], number), expected[number])
            assert error <= 1e-5, f"rank {rank}, round {number}: {error:.3g} from the simulation"
    # Its late answer came when round 2 had closed: it holds round 2's global parameters.
    assert bool(outputs[SLOW]["late/round1"])
    for a, b in zip(params_at(outputs[SLOW], 1), params_at(outputs[0], 2), strict=True):
        np.testing.assert_array_equal(a, b)
    assert_all_equal_at_the_end(outputs)
    # Had the bound let it in, round 3 would differ.
    merged = {**schedule, SLOW: [LocalRound(0, None, 3), LocalRound(2, 3)]}
    other = simulate_stragglers(run, WORLD, make_model(100), merged, rounds=3)
    assert worst(params_at(outputs[0], 3), other[3]) > 1e-4


@pytest.mark.timeout(300)
def test_weighted_rounds_average_by_the_samples_each_rank_processed(
    tmp_path: Path, coordinator_factory
) -> None:
    """Ranks claim 1, 2 and 4 batches' worth of samples per inner step: every round is
    sum(w_i g_i) / sum(w_i) with w_i = H * samples_i, not the plain mean."""
    coordinator = coordinator_factory(WORLD)
    run = Run(rounds=3)
    per_step = {rank: float(BATCH * 2**rank) for rank in range(WORLD)}
    outputs = run_ranks(
        DILOCO_WORKER,
        coordinator.address,
        WORLD,
        tmp_path,
        *run.argv(),
        "--weighted",
        per_rank={rank: ["--samples", repr(per_step[rank])] for rank in range(WORLD)},
        timeout_s=240,
    )
    weights = {rank: run.sync_every * samples for rank, samples in per_step.items()}
    schedule = {rank: on_time_rounds(3) for rank in range(WORLD)}
    expected = simulate_stragglers(run, WORLD, make_model(100), schedule, 3, weights)
    for rank, saved in enumerate(outputs):
        for number in range(4):
            error = worst(params_at(saved, number), expected[number])
            assert error <= 1e-5, f"rank {rank}, round {number}: {error:.3g} from the simulation"
        assert int(saved["contributors/round3"]) == WORLD
    assert_all_equal_at_the_end(outputs)
    plain = simulate(run, WORLD, make_model(100))
    assert worst(params_at(outputs[0], 3), plain[3]) > 1e-4, "the weights changed nothing"
