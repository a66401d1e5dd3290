"""gradsync on a real Ray cluster: coordinator actors, worker actors, restarts, Ray Train.

No mocks: one `ray start --head` cluster (support.ray_cluster) serves the module, and
every scenario is a driver process of its own (support.ray_jobs) that joins it by
address, as a user's script would, and writes what it saw to JSON for the test to
check. The ranks train the same tiny models as a single process does in the driver, so
parity is checked exactly (float32 rounding, 1e-6), and a killed rank's actor really
dies (SIGKILL) and is restarted by Ray. The cluster is torn down after the module and
no process of it may survive.
"""

from __future__ import annotations

import subprocess
import sys
import uuid
from collections.abc import Iterator, Sequence
from itertools import groupby
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from support.ray_cluster import RayCluster, run_driver
from support.ray_jobs import wait_gone

#: The most a driver may take (each finishes in 3-25 s on two cores).
DRIVER_TIMEOUT_S = 120.0
#: Float32 rounding between averaged gradients and the single-process gradient.
PARITY_TOLERANCE = 1e-6

#: One parallel worker runs the whole module: one Ray cluster serves the module (module fixtures).
pytestmark = [pytest.mark.timeout(180), pytest.mark.xdist_group("ray-cluster")]


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[RayCluster]:
    """One real two-node Ray cluster for the module; nothing of it may outlive the module."""
    cluster = RayCluster(num_cpus=4, host_id="ray-node-1")
    try:
        # Two nodes on one machine, each a host of its own for gradsync (its
        # GRADSYNC_HOST_ID), as two machines would be: ranks and shards spread over both.
        cluster.add_node(num_cpus=2, host_id="ray-node-2")
        yield cluster
    finally:
        left = cluster.stop()
    assert not left, f"processes of the Ray cluster survived its teardown: {left}"


def max_relative_difference(got: Sequence[Any], expected: Sequence[Any]) -> float:
    """The largest ||got - expected|| / ||expected|| over the parameters."""
    assert len(got) == len(expected)
    return max(
        float(
            np.linalg.norm(np.asarray(a, dtype=np.float64) - np.asarray(b, dtype=np.float64))
            / np.linalg.norm(np.asarray(b, dtype=np.float64))
        )
        for a, b in zip(got, expected, strict=True)
    )


def reports_of(outcome: dict[str, Any], rank: int) -> list[dict[str, Any]]:
    """Rank `rank`'s reports, in the order the driver received them."""
    return [row for row in outcome["reports"] if row["rank"] == rank]


def test_sharded_coordinator_and_ranks_on_two_nodes_match_single_process(
    ray_cluster: RayCluster, tmp_path: Path
) -> None:
    outcome = run_driver(ray_cluster, tmp_path, "parity", timeout_s=DRIVER_TIMEOUT_S)
    steps, world = 6, 2

    # Training: the average over two ranks equals one process on the whole global batch,
    # and both ranks end with the very same bytes.
    rank0, rank1 = outcome["results"]
    assert rank0 == rank1, "ranks ended with different parameters"
    assert max_relative_difference(rank0, outcome["reference"]) <= PARITY_TOLERANCE
    assert outcome["restarts"] == [0, 0]
    assert outcome["run_coordinator"] == outcome["address"]

    # Reports streamed back: one per step per rank, in step order, each from the first
    # attempt, with torchrun's variables as the training function saw them. "SPREAD" put
    # the ranks on the cluster's two nodes, so each is local rank 0 of 1; each node being
    # a host of its own, neither formed a local group under hierarchical "auto" (the
    # coordinator refuses a LOCAL_WORLD_SIZE that differs from the ranks on the host).
    nodes = set()
    for rank in range(world):
        rows = reports_of(outcome, rank)
        assert [row["metrics"]["step"] for row in rows] == list(range(1, steps + 1))
        assert {row["attempt"] for row in rows} == {1}
        assert {row["metrics"]["contributors"] for row in rows} == {world}
        assert all(row["metrics"]["local_ranks"] == [] for row in rows)
        nodes |= {row["metrics"]["node"] for row in rows}
        for row in rows:
            assert row["metrics"]["env"] == {
                "RANK": str(rank),
                "WORLD_SIZE": str(world),
                "LOCAL_RANK": "0",
                "LOCAL_WORLD_SIZE": "1",
            }
    assert len(nodes) == world, "the ranks did not run on two nodes"

    # The coordinator's status, over its own gRPC address: the job's steps, and both
    # shards alive and averaging (each bucket is split between the shards by elements).
    job = outcome["status"]["jobs"][outcome["job_id"]]
    assert job == {"steps_completed": steps, "world_size": world}
    shards = outcome["status"]["shards"]
    assert [shard["index"] for shard in shards] == [0, 1]
    assert all(shard["alive"] for shard in shards)
    assert shards[1]["buckets"] == shards[0]["buckets"] > 0, shards

    # stop(): every actor of it (leader and shard) is gone, by name and by process.
    assert sorted(outcome["pids"]) == ["leader", "shard 1"]
    assert len(outcome["actors_running"]) == 2
    assert outcome["actors_after_stop"] == []
    assert outcome["pids_alive_after_stop"] == []
    assert wait_gone(list(outcome["pids"].values()), 10.0) == []


def test_killed_rank_restarts_and_rejoins_with_the_survivors_state(
    ray_cluster: RayCluster, tmp_path: Path
) -> None:
    outcome = run_driver(ray_cluster, tmp_path, "kill", timeout_s=DRIVER_TIMEOUT_S)
    hold_step = 3

    # Ray restarted rank 1's actor once (after the driver's SIGKILL), never rank 0's.
    assert len(outcome["killed"]) == 1
    assert outcome["restarts"] == [0, 1]
    first, second = outcome["results"]
    assert (first["attempt"], second["attempt"]) == (1, 2)

    # Rank 1 reported steps 1..3 on its first attempt (then held until killed), and the
    # restarted actor reported again, as attempt 2, from the job's step onwards.
    rank1 = reports_of(outcome, 1)
    attempt1 = [row["metrics"]["step"] for row in rank1 if row["attempt"] == 1]
    attempt2 = [row["metrics"]["step"] for row in rank1 if row["attempt"] == 2]
    assert attempt1 == list(range(1, hold_step + 1))
    assert attempt2 and attempt2[0] > hold_step
    assert outcome["killed"][0]["pid"] == rank1[0]["metrics"]["pid"]
    restarted_pids = {row["metrics"]["pid"] for row in rank1 if row["attempt"] == 2}
    assert outcome["killed"][0]["pid"] not in restarted_pids

    # Rank 0 never stopped: consecutive steps, averaged over 2 ranks, then over itself
    # alone while rank 1 was lost, then over 2 again once it rejoined.
    rank0 = [row["metrics"] for row in reports_of(outcome, 0)]
    assert [row["step"] for row in rank0] == list(range(1, len(rank0) + 1))
    runs = [value for value, _ in groupby(row["contributors"] for row in rank0)]
    assert runs == [2, 1, 2], runs
    assert all(row["contributors"] == 2 for row in rank0[:hold_step])

    # Both end at the same step with the same bytes: the restarted rank received the
    # survivor's parameters and momentum.
    assert first["step"] == second["step"] == rank0[-1]["step"]
    assert first["parameters"] == second["parameters"]

    # Stronger: replaying rank 0's steps in one process (the whole global batch where
    # both ranks contributed, rank 0's half where it was alone) gives those parameters.
    # The model is one bucket, so a step's contributor count holds for all its gradients.
    # The replay averages the two halves' gradients as the coordinator does rather than
    # taking one pass over the batch: over the survivor's ~60 solo steps momentum SGD
    # can grow that float32 rounding difference to ~1e-6 (6.4e-7 measured with 130).
    replay_error = max_relative_difference(first["parameters"], outcome["reference"])
    assert replay_error <= PARITY_TOLERANCE
    assert outcome["run_coordinators_left"] == []


def test_detached_coordinator_is_found_and_stopped_by_another_driver(
    ray_cluster: RayCluster, tmp_path: Path
) -> None:
    name = f"named-{uuid.uuid4().hex[:8]}"
    started = run_driver(
        ray_cluster, tmp_path, "named-start", "--name", name, timeout_s=DRIVER_TIMEOUT_S
    )
    # Driver A has exited; its detached coordinator still runs.
    assert sorted(started["pids"]) == ["leader"]
    leader_pid = started["pids"]["leader"]
    assert wait_gone([leader_pid], 0.0) == [leader_pid]

    stopped = run_driver(
        ray_cluster, tmp_path, "named-stop", "--name", name, timeout_s=DRIVER_TIMEOUT_S
    )
    assert stopped["address"] == started["address"]
    assert stopped["world_size"] == 2
    assert stopped["status"]["jobs"] == {}  # reachable, and no job ran on it
    actor = f"gradsync-coordinator:{name}"
    assert actor in stopped["actors_before_stop"]
    assert actor not in stopped["actors_after_stop"]
    assert wait_gone([leader_pid], 15.0) == []

    unknown, taken = stopped["errors"]["unknown"], stopped["errors"]["taken"]
    assert unknown["type"] == "LookupError" and f"{name}-unknown" in unknown["message"]
    assert taken["type"] == "ValueError" and repr(name) in taken["message"]
    assert started["address"] in taken["message"]

    # A rank whose function raises ends the run at once, naming it; the other rank,
    # waiting in its join, is stopped rather than left to its 300 s join timeout.
    failed = stopped["errors"]["failed_run"]
    assert failed["type"] == "WorkerFailedError" and failed["rank"] == 1
    assert "rank 1 fails on purpose" in failed["message"]
    assert failed["seconds"] < 60
    assert len(stopped["failed_run_pids"]) == 2
    assert stopped["failed_run_pids_left"] == []


def test_ray_train_data_parallel_trainer_with_the_gradsync_backend(
    ray_cluster: RayCluster, tmp_path: Path
) -> None:
    storage = tmp_path / "ray-train"
    outcome = run_driver(
        ray_cluster, tmp_path, "train", "--storage", str(storage), timeout_s=DRIVER_TIMEOUT_S
    )
    assert outcome["error"] is None
    metrics = outcome["metrics"]
    assert metrics["step"] == 5
    # Ray Train's ranks became torchrun's variables (rank 0 reports the metrics), and
    # with them the two workers of this node formed one local group.
    assert metrics["env"] == {
        "RANK": "0",
        "WORLD_SIZE": "2",
        "LOCAL_RANK": "0",
        "LOCAL_WORLD_SIZE": "2",
    }
    assert metrics["local_ranks"] == [0, 1]

    # Ray Train kept rank 0's checkpoint under the run's storage path, and it holds the
    # parameters of single-process training on the whole global batch.
    checkpoint = Path(outcome["checkpoint"])
    assert checkpoint.is_relative_to(storage)
    state = torch.load(checkpoint / "model.pt", weights_only=True)
    saved = [state[key].tolist() for key in ("0.weight", "0.bias", "2.weight", "2.bias")]
    assert max_relative_difference(saved, outcome["reference"]) <= PARITY_TOLERANCE

    # The backend stopped the coordinator it started for the worker group.
    assert outcome["coordinators_left"] == []


@pytest.mark.parametrize("sync", [[], ["--diloco", "5"]], ids=["every-step", "diloco"])
def test_demo_runs_on_the_cluster(ray_cluster: RayCluster, tmp_path: Path, sync: list[str]) -> None:
    argv = [
        sys.executable,
        "-m",
        "gradsync.cli",
        "demo",
        "--ray",
        "--ray-address",
        ray_cluster.address,
        "--workers",
        "2",
        "--epochs",
        "1",
        *sync,
    ]
    done = subprocess.run(
        argv,
        capture_output=True,
        text=True,
        env=ray_cluster.driver_environment(),
        cwd=tmp_path,
        timeout=DRIVER_TIMEOUT_S,
    )
    assert done.returncode == 0, f"{done.stdout}\n{done.stderr[-6000:]}"
    assert "OK:" in done.stdout, done.stdout
    # The banner says which mode ran, and rank 0's reports came back through Ray.
    assert ("DiLoCo, a round every 5 steps" in done.stdout) == bool(sync), done.stdout
    assert "rank 0: {'step':" in done.stdout, done.stdout
