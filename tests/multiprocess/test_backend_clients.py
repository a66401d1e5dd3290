"""Real clients of torch.distributed over the "gradsync" backend against gloo.

FSDP2, HSDP on a 2-D DeviceMesh, a PyTorch Lightning `Trainer` with `DDPStrategy`
and a Hugging Face Accelerate loop (`support/workers/clients_worker.py`) each run
once over "gloo" and once over "gradsync" (a real `gradsync serve` coordinator),
in real processes started apart, the highest rank first. The parameters they
train to must match gloo's within 1e-6, and the coordinator's log must show that
the groups' jobs ran there.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from gradsync_proto.net.launch import free_port
from support.processes import WORKERS, CoordinatorProcess, reap

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(240)]

CLIENTS_WORKER = WORKERS / "clients_worker.py"
#: Ranks start this far apart, the highest first.
START_APART_S = 0.5


def run(
    backend: str, scenario: str, world: int, out: Path, coordinator: str
) -> list[dict[str, Any]]:
    """Run every rank of `scenario`; return what each saved."""
    out.mkdir(parents=True, exist_ok=True)
    master_port = free_port()
    processes: dict[int, subprocess.Popen[str]] = {}
    try:
        for rank in reversed(range(world)):
            argv = [
                sys.executable,
                str(CLIENTS_WORKER),
                "--backend",
                backend,
                "--scenario",
                scenario,
                "--rank",
                str(rank),
                "--world-size",
                str(world),
                "--coordinator",
                coordinator,
                "--master-port",
                str(master_port),
                "--start-delay-s",
                str(START_APART_S * (world - 1 - rank)),
                "--out",
                str(out / f"rank{rank}.npz"),
            ]
            processes[rank] = subprocess.Popen(
                argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
            )
        texts = {rank: p.communicate(timeout=180)[0] for rank, p in processes.items()}
    finally:
        reap(processes.values())
    failed = {rank: texts[rank] for rank, p in processes.items() if p.returncode != 0}
    assert not failed, "\n".join(f"{backend} rank {r}:\n{text}" for r, text in failed.items())
    results = []
    for rank in range(world):
        with np.load(out / f"rank{rank}.npz") as data:
            results.append(dict(data))
    return results


def assert_same_parameters(
    ours: list[dict[str, Any]], gloo: list[dict[str, Any]], world: int
) -> None:
    keys = sorted(k for k in gloo[0] if k.startswith("param/"))
    assert keys, gloo[0].keys()
    for rank in range(world):
        assert str(ours[rank]["backend_seen"]) == "gradsync"
        assert str(gloo[rank]["backend_seen"]) == "gloo"
        assert sorted(k for k in ours[rank] if k.startswith("param/")) == keys
        for key in keys:
            difference = float(np.abs(ours[rank][key] - gloo[rank][key]).max(initial=0.0))
            assert difference <= 1e-6, f"{key} on rank {rank}: {difference:.3g} from gloo"
        # Training moved the parameters: the comparison is not of two initial models.
        # (rank 0 of gloo against the initial values is not saved; ranks agree instead)
        for key in keys:
            np.testing.assert_array_equal(ours[rank][key], ours[0][key], err_msg=key)


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
    gloo = run("gloo", "fsdp", world, tmp_path / "gloo", "unused:1")
    ours = run("gradsync", "fsdp", world, tmp_path / "ours", coordinator.address)
    assert_same_parameters(ours, gloo, world)
    jobs = joined_jobs(coordinator)
    assert jobs.get("default.pg-world") == {0, 1}, jobs


def test_hsdp_on_a_2d_mesh_with_both_dimensions_over_gradsync_equals_gloo(
    tmp_path: Path, coordinator_factory: Any
) -> None:
    world = 4
    coordinator = coordinator_factory(world)
    gloo = run("gloo", "hsdp", world, tmp_path / "gloo", "unused:1")
    ours = run("gradsync", "hsdp", world, tmp_path / "ours", coordinator.address)
    assert_same_parameters(ours, gloo, world)
    for rank in range(world):
        np.testing.assert_array_equal(ours[rank]["mesh_groups"], [2, 2])
    jobs = joined_jobs(coordinator)
    assert jobs.pop("default.pg-world") == set(range(world)), jobs
    # Two rows (shard) and two columns (replicate) of the mesh: a job of two ranks each.
    mesh_jobs = {job: ranks for job, ranks in jobs.items() if job.startswith("default.pg-")}
    assert len(mesh_jobs) == 4 and all(r == {0, 1} for r in mesh_jobs.values()), jobs


def test_a_lightning_trainer_with_ddp_strategy_over_gradsync_equals_gloo(
    tmp_path: Path, coordinator_factory: Any
) -> None:
    pytest.importorskip("lightning", reason="the lightning package is not installed: gradsync[test]")
    world = 2
    coordinator = coordinator_factory(world)
    gloo = run("gloo", "lightning", world, tmp_path / "gloo", "unused:1")
    ours = run("gradsync", "lightning", world, tmp_path / "ours", coordinator.address)
    assert_same_parameters(ours, gloo, world)
    for rank in range(world):
        assert int(ours[rank]["world_seen"]) == world
    jobs = joined_jobs(coordinator)
    assert jobs.get("default.pg-world") == {0, 1}, jobs


def test_an_accelerate_loop_over_gradsync_equals_gloo(
    tmp_path: Path, coordinator_factory: Any
) -> None:
    pytest.importorskip("accelerate", reason="the accelerate package is not installed: gradsync[test]")
    world = 2
    coordinator = coordinator_factory(world)
    gloo = run("gloo", "accelerate", world, tmp_path / "gloo", "unused:1")
    ours = run("gradsync", "accelerate", world, tmp_path / "ours", coordinator.address)
    assert_same_parameters(ours, gloo, world)
    for rank in range(world):
        assert int(ours[rank]["world_seen"]) == world
        np.testing.assert_array_equal(ours[rank]["metric"], [3.0])
    jobs = joined_jobs(coordinator)
    assert jobs.get("default.pg-world") == {0, 1}, jobs
