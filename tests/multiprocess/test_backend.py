"""gradsync as a torch.distributed backend against gloo, in real processes.

The same unchanged scripts (`support/workers/backend_worker.py`) run once over
"gloo" and once over "gradsync" (a real `gradsync serve` coordinator; torch's
TCPStore for the rendezvous): stock DDP on zoo models, a loop with
`DistributedSampler()`, a metric all-reduce and barriers, and every
collective. Their results must match gloo's. A shape mismatch fails every
rank naming both shapes; a killed rank fails the others' pending Work with
`DistBackendError` naming it, within the heartbeat timeout. Each test checks in
the coordinator's log that the group's job really ran there.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from support.backend_launch import finish_backend_runs, start_backend_ranks
from support.processes import WORKERS, CoordinatorProcess

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(240)]

BACKEND_WORKER = WORKERS / "backend_worker.py"
#: Zoo cases for stock DDP: plain, BatchNorm buffers, unused parameters, no_sync, and
#: uneven inputs under DDP's join().
DDP_CASES = "mlp,cnn_batchnorm,unused_branch_adam,sometimes_unused,no_sync,join_uneven"
#: Ranks start this far apart, the highest first.
START_APART_S = 0.7


def run(
    backend: str,
    scenario: str,
    world: int,
    out: Path,
    coordinator: str,
    *extra: str,
    timeout_s: float = 180,
    expect_exit: dict[int, int] | None = None,
) -> list[dict[str, Any]]:
    """Run every rank of `scenario` (the highest rank first, each started apart);
    return what each saved (an empty dict for a rank that saved nothing)."""
    started = start_backend_ranks(
        BACKEND_WORKER,
        backend,
        scenario,
        world,
        out,
        coordinator,
        *extra,
        start_apart_s=START_APART_S,
    )
    return finish_backend_runs(started, timeout_s=timeout_s, expect_exit=expect_exit)[0]


def assert_job_ran(coordinator: CoordinatorProcess, world: int) -> tuple[int, str]:
    """The coordinator's own log shows the group's job assembled with every rank;
    return how it stopped (exit status, the rest of its log)."""
    code, log = coordinator.stop()
    for rank in range(world):
        assert f"job 'default.pg-world': rank {rank} joined" in log, log
    return code, log


@pytest.mark.parametrize("world", [pytest.param(w, id=f"W{w}") for w in (2, 3)])
def test_stock_ddp_over_gradsync_equals_gloo(
    world: int, tmp_path: Path, coordinator_factory: Any
) -> None:
    coordinator = coordinator_factory(world)
    extra = ("--cases", DDP_CASES)
    gloo = run("gloo", "ddp", world, tmp_path / "gloo", "unused:1", *extra)
    ours = run("gradsync", "ddp", world, tmp_path / "ours", coordinator.address, *extra)
    assert_job_ran(coordinator, world)
    keys = sorted(k for k in gloo[0] if "/" in k)
    assert {k.split("/")[0] for k in keys} == set(DDP_CASES.split(","))
    for rank in range(world):
        assert str(ours[rank]["backend"]) == "gradsync"
        assert sorted(k for k in ours[rank] if "/" in k) == keys
        for key in keys:
            difference = float(np.abs(ours[rank][key] - gloo[rank][key]).max(initial=0.0))
            assert difference <= 1e-6, f"{key} on rank {rank}: {difference:.3g} from gloo"
    # The ranks hold one model (BatchNorm's running statistics are each rank's own
    # after the last forward pass, as under DDP: broadcast before a forward, not after).
    for key in (k for k in keys if "running_" not in k and "num_batches" not in k):
        np.testing.assert_array_equal(ours[1][key], ours[0][key], err_msg=key)


def test_a_script_with_sampler_metric_and_barrier_and_every_op_match_gloo(
    tmp_path: Path, coordinator_factory: Any
) -> None:
    world = 3
    coordinator = coordinator_factory(world)
    gloo = run("gloo", "usage", world, tmp_path / "gloo", "unused:1")
    ours = run("gradsync", "usage", world, tmp_path / "ours", coordinator.address)
    coordinator_log = assert_job_ran(coordinator, world)
    for rank in range(world):
        # The script: DistributedSampler() split by the group, the summed metric, the model.
        np.testing.assert_array_equal(ours[rank]["indices"], gloo[rank]["indices"])
        np.testing.assert_array_equal(ours[rank]["samples_seen"], [24.0, 24.0])  # 22 padded
        np.testing.assert_allclose(ours[rank]["losses"], gloo[rank]["losses"], rtol=1e-6)
        for key in (k for k in gloo[rank] if k.startswith("model/")):
            np.testing.assert_allclose(ours[rank][key], gloo[rank][key], rtol=0, atol=1e-6)
        # Every op gloo has, bitwise (small integers in float32: every order sums exactly).
        ops = [
            k
            for k in gloo[rank]
            if k.startswith(("all_", "broadcast", "reduce", "gather", "scatter"))
        ]
        assert len(ops) == (16 if rank == 0 else 14), ops
        for key in ops:
            np.testing.assert_array_equal(ours[rank][key], gloo[rank][key], err_msg=key)
        sums = ours[rank]["all_reduce_sum"]
        np.testing.assert_allclose(ours[rank]["gradsync_avg"], sums / world, rtol=1e-6)
        np.testing.assert_allclose(ours[rank]["gradsync_premul_sum"], sums / 2, rtol=1e-6)
        np.testing.assert_array_equal(ours[rank]["gradsync_bf16"], [-3.0, 3.0, 9.0, 15.0])
        assert "BAND is not supported" in str(ours[rank]["gradsync_band_error"])
        assert "send is not supported" in str(ours[rank]["gradsync_send_error"])
        assert "point-to-point" in str(ours[rank]["gradsync_send_error"])
        # 17 ops both backends run, AVG, PREMUL_SUM and bf16, after the script's own
        # (DDP's start, 11 buckets, 2 metric sums, 2 barriers); BAND and send were
        # refused before queueing.
        assert int(ours[rank]["operations_completed"]) >= 20 + 4
        assert str(ours[rank]["job_id"]) == "default.pg-world"
        # Two new_groups of two ranks: each its own job, beside the default group's.
        groups = [k for k in gloo[rank] if k.startswith(("head_", "tail_", "world_after"))]
        assert len(groups) == (8 if rank == 1 else 5), groups
        for key in groups:
            np.testing.assert_array_equal(ours[rank][key], gloo[rank][key], err_msg=key)
    _, log = coordinator_log
    subgroup_jobs = set(re.findall(r"job '(default\.pg-[0-9a-f]{12})': rank \d joined", log))
    assert len(subgroup_jobs) == 2, log


def test_the_gradsync_rendezvous_needs_no_listener_on_rank_0(
    tmp_path: Path, coordinator_factory: Any
) -> None:
    """init_method="gradsync://host:port": the coordinator serves c10d's store too."""
    pytest.importorskip("gradsync.distributed.store", reason="needs the coordinator's store")
    world = 2
    coordinator = coordinator_factory(world)
    extra = ("--cases", "mlp", "--rendezvous", "gradsync")
    gloo = run("gloo", "ddp", world, tmp_path / "gloo", "unused:1", "--cases", "mlp")
    ours = run("gradsync", "ddp", world, tmp_path / "ours", coordinator.address, *extra)
    assert_job_ran(coordinator, world)
    for rank in range(world):
        for key in (k for k in gloo[rank] if k.startswith("mlp/")):
            np.testing.assert_array_equal(ours[rank][key], gloo[rank][key], err_msg=key)


def test_a_shape_mismatch_fails_every_rank_naming_both_shapes(
    tmp_path: Path, coordinator_factory: Any
) -> None:
    world = 2
    coordinator = coordinator_factory(world)
    ours = run("gradsync", "mismatch", world, tmp_path / "ours", coordinator.address)
    assert_job_ran(coordinator, world)
    for rank in range(world):
        error = str(ours[rank]["error"])
        assert str(ours[rank]["error_type"]) == "DistBackendError", error
        assert f"rank {rank} of group" in error and "allreduce" in error, error
        assert "8" in error and "12" in error, error  # 2 and 3 float32s, in bytes


@pytest.mark.parametrize(
    ("policy", "says"),
    [
        ("abort", "rank 1 disconnected"),
        # Elastic: the coordinator goes on over rank 0 alone, but a c10d group's size is
        # fixed, so the backend fails the Work instead of returning a partial sum.
        ("elastic", "only 1 of the group's 2 ranks took part (the coordinator lost ranks [1]"),
    ],
)
def test_a_killed_rank_fails_the_pending_work_within_the_heartbeat_timeout(
    policy: str, says: str, tmp_path: Path, coordinator_factory: Any
) -> None:
    world = 2
    coordinator = coordinator_factory(
        world, "--heartbeat-timeout", "3", "--on-failure", policy, "--min-workers", "1"
    )
    ours = run(
        "gradsync", "kill", world, tmp_path / "ours", coordinator.address, expect_exit={1: -9}
    )
    assert_job_ran(coordinator, world)
    error = str(ours[0]["error"])
    assert str(ours[0]["error_type"]) == "DistBackendError", error
    assert "rank 0 of group '0'" in error and "allreduce" in error and says in error, error
    assert float(ours[0]["failed_after_s"]) < 3 + 2, error


def test_a_killed_rank_makes_stock_ddps_backward_raise_naming_it(
    tmp_path: Path, coordinator_factory: Any
) -> None:
    world = 2
    coordinator = coordinator_factory(world, "--heartbeat-timeout", "3")
    ours = run(
        "gradsync", "ddp_kill", world, tmp_path / "ours", coordinator.address, expect_exit={1: -9}
    )
    assert_job_ran(coordinator, world)
    error = str(ours[0]["error"])
    # DDP's reducer reads the Work's future: the failure reaches backward() from C++.
    assert int(ours[0]["failed_at_step"]) == 2, error
    assert "DistBackendError" in error and "rank 0 of group '0'" in error, error
    assert "allreduce" in error and "rank 1 disconnected" in error, error
    assert float(ours[0]["failed_after_s"]) < 3 + 2, error
