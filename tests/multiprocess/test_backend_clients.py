"""Real clients of torch.distributed over the "gradsync" backend against gloo.

FSDP2, HSDP on a 2-D DeviceMesh, a PyTorch Lightning `Trainer` with `DDPStrategy`
and a Hugging Face Accelerate loop (`support/workers/clients_worker.py`) each run
once over "gloo" and once over "gradsync" (a real `gradsync serve` coordinator),
in real processes started apart, the highest rank first. The parameters they
train to must match gloo's within 1e-6, and the coordinator's log must show that
the groups' jobs ran there.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from support.backend_launch import finish_backend_runs, start_backend_ranks
from support.components import MISSING_COMPONENT
from support.processes import WORKERS, CoordinatorProcess

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(240)]

CLIENTS_WORKER = WORKERS / "clients_worker.py"
#: Ranks start this far apart, the highest first.
START_APART_S = 0.5


def run_both(
    scenario: str, world: int, tmp_path: Path, coordinator: str
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Run `scenario` over gloo and over gradsync side by side (two separate groups of
    processes, each with its own rendezvous); return what the ranks of each saved."""
    gloo, ours = finish_backend_runs(
        *(
            start_backend_ranks(
                CLIENTS_WORKER,
                backend,
                scenario,
                world,
                tmp_path / backend,
                address,
                start_apart_s=START_APART_S,
            )
            for backend, address in (("gloo", "unused:1"), ("gradsync", coordinator))
        )
    )
    return ours, gloo


def assert_same_parameters(
    ours: list[dict[str, Any]], gloo: list[dict[str, Any]], world: int, groups: tuple[str, ...]
) -> None:
    """Every rank's parameters equal gloo's, every group ran on its backend, and training
    moved the parameters (two untrained models would agree too)."""
    keys = sorted(k for k in gloo[0] if k.startswith("param/"))
    assert keys, sorted(gloo[0])
    for rank in range(world):
        for group in groups:
            assert str(ours[rank][f"backend/{group}"]) == "gradsync", group
            assert str(gloo[rank][f"backend/{group}"]) == "gloo", group
        assert sorted(k for k in ours[rank] if k.startswith("param/")) == keys
        for key in keys:
            difference = float(np.abs(ours[rank][key] - gloo[rank][key]).max(initial=0.0))
            assert difference <= 1e-6, f"{key} on rank {rank}: {difference:.3g} from gloo"
            np.testing.assert_array_equal(ours[rank][key], ours[0][key], err_msg=key)
        moved = [
            key
            for key in keys
            if not np.array_equal(ours[rank][key], ours[rank]["init/" + key[len("param/") :]])
        ]
        assert len(moved) == len(keys), sorted(set(keys) - set(moved))


def needs(package: str) -> None:
    """Skip unless `package` is installed (found without importing it here: only the
    ranks import it)."""
    if importlib.util.find_spec(package) is None:
        pytest.skip(
            f"{MISSING_COMPONENT}: the Python package {package} not installed "
            "(pip install -e .[test])"
        )


def joined_jobs(coordinator: CoordinatorProcess) -> dict[str, set[int]]:
    """Stop the coordinator; return each job its log shows ranks joining, with the ranks."""
    _, log = coordinator.stop()
    jobs: dict[str, set[int]] = {}
    for job, rank in re.findall(r"job '([^']+)': rank (\d+) joined", log):
        jobs.setdefault(job, set()).add(int(rank))
    return jobs


def test_fsdp2_of_a_transformer_over_gradsync_equals_gloo(
    tmp_path: Path, coordinator_factory: Any
) -> None:
    world = 2
    coordinator = coordinator_factory(world)
    ours, gloo = run_both("fsdp", world, tmp_path, coordinator.address)
    assert_same_parameters(ours, gloo, world, ("world",))
    for rank in range(world):
        assert str(ours[rank]["job/world"]) == "default.pg-world"
        # Per step: an all-gather per unit forward and backward, a reduce-scatter per unit.
        assert int(ours[rank]["ops/world"]) >= 3 * 3 * 2, int(ours[rank]["ops/world"])
    jobs = joined_jobs(coordinator)
    assert jobs.get("default.pg-world") == {0, 1}, jobs


def test_hsdp_on_a_2d_mesh_with_both_dimensions_over_gradsync_equals_gloo(
    tmp_path: Path, coordinator_factory: Any
) -> None:
    world = 4
    coordinator = coordinator_factory(world)
    ours, gloo = run_both("hsdp", world, tmp_path, coordinator.address)
    assert_same_parameters(ours, gloo, world, ("replicate", "shard"))
    for rank in range(world):
        np.testing.assert_array_equal(ours[rank]["mesh_groups"], [2, 2])
        for dimension in ("replicate", "shard"):
            assert int(ours[rank][f"ops/{dimension}"]) >= 3, dimension
    jobs = joined_jobs(coordinator)
    assert jobs.pop("default.pg-world") == set(range(world)), jobs
    # Two rows (shard) and two columns (replicate) of the mesh: a job of two ranks each.
    mesh_jobs = {
        str(ours[rank][f"job/{d}"]) for rank in range(world) for d in ("replicate", "shard")
    }
    assert len(mesh_jobs) == 4, mesh_jobs
    assert {job: jobs.get(job) for job in mesh_jobs} == {job: {0, 1} for job in mesh_jobs}, jobs


def test_a_lightning_trainer_with_ddp_strategy_over_gradsync_equals_gloo(
    tmp_path: Path, coordinator_factory: Any
) -> None:
    needs("lightning")
    world = 2
    coordinator = coordinator_factory(world)
    ours, gloo = run_both("lightning", world, tmp_path, coordinator.address)
    assert_same_parameters(ours, gloo, world, ("world",))
    for rank in range(world):
        assert int(ours[rank]["world_seen"]) == world
        assert str(ours[rank]["wrapped"]) == "DistributedDataParallel"
        # DDP's start and a gradient all-reduce per step (2 epochs of 4 steps), at least.
        assert int(ours[rank]["ops/world"]) >= 8, int(ours[rank]["ops/world"])
    jobs = joined_jobs(coordinator)
    assert jobs.get("default.pg-world") == {0, 1}, jobs


def test_an_accelerate_loop_over_gradsync_equals_gloo(
    tmp_path: Path, coordinator_factory: Any
) -> None:
    needs("accelerate")
    world = 2
    coordinator = coordinator_factory(world)
    ours, gloo = run_both("accelerate", world, tmp_path, coordinator.address)
    assert_same_parameters(ours, gloo, world, ("world",))
    for rank in range(world):
        assert int(ours[rank]["world_seen"]) == world
        assert str(ours[rank]["distributed_type"]) == "MULTI_CPU"
        assert str(ours[rank]["wrapped"]) == "DistributedDataParallel"
        np.testing.assert_array_equal(ours[rank]["metric"], [3.0])  # 1 + 2, summed
        # A gradient all-reduce per step (4 steps), at least.
        assert int(ours[rank]["ops/world"]) >= 4, int(ours[rank]["ops/world"])
    jobs = joined_jobs(coordinator)
    assert jobs.get("default.pg-world") == {0, 1}, jobs
