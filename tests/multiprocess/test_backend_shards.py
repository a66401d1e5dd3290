"""gradsync as a torch.distributed backend on a sharded coordinator, against gloo.

`gradsync serve --shards 2` (the leader and one local shard process) serves a
group of two real rank processes running an unchanged script
(`support/workers/backend_worker.py`, scenario "shards"): stock DDP with one
gradient bucket large enough to be spread over the shards, then an all-reduce
with every reduce op, an all-gather and a reduce-scatter, all spread too. The
same script runs over gloo at the same time. The results must match gloo's
(DDP within 1e-6, the ops bitwise), both shards must have served the group's
bytes (the leader's collective metrics, the shard's bytes in `gradsync
status`), and an all-reduce whose size differs between the ranks must fail on
both, naming both sizes.
"""

from __future__ import annotations

import time
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from gradsync_proto.net.launch import free_port
from prometheus_client.parser import text_string_to_metric_families
from support.backend_launch import finish_backend_runs, start_backend_ranks
from support.processes import WORKERS
from support.shards import shard_statuses

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(240)]

BACKEND_WORKER = WORKERS / "backend_worker.py"


def collective_bytes_received(metrics_port: int) -> float:
    """The leader's `gradsync_collective_bytes_total{direction="received"}`, all ops."""
    url = f"http://127.0.0.1:{metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=5) as response:
        text = response.read().decode()
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "gradsync_collective_bytes_total"
        and sample.labels.get("direction") == "received"
    )


def test_stock_ddp_over_a_sharded_coordinator_equals_gloo_and_uses_every_shard(
    tmp_path: Path, coordinator_factory: Any
) -> None:
    world, metrics_port = 2, free_port()
    leader = coordinator_factory(world, "--shards", "2", "--metrics-port", str(metrics_port))
    # (no wait for the shard: the group's job starts once every shard is registered)
    # The ranks run as on hosts of their own: on one host (the default "auto") their
    # all-reduces up to 4 MiB are summed in shared memory and reach the leader whole.
    runs = [
        start_backend_ranks(
            BACKEND_WORKER,
            backend,
            "shards",
            world,
            tmp_path / backend,
            address,
            "--hierarchical",
            "0",
            start_apart_s=0.0,
        )
        for backend, address in (("gloo", "unused:1"), ("gradsync", leader.address))
    ]
    gloo, ours = finish_backend_runs(*runs, timeout_s=120)
    # A shard reports its byte counts to the leader with its periodic status, so the
    # leader's view of them may lag the run's end by a report.
    deadline = time.monotonic() + 15
    while True:
        shard = {status.index: status for status in shard_statuses(leader.address)}
        if (1 in shard and shard[1].bytes_received > 0) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    leader_bytes = collective_bytes_received(metrics_port)
    _, log = leader.stop()
    assert "job 'default.pg-world': rank 1 joined" in log, log
    # Both shards served the group: the leader's range of every spread all-reduce and
    # the small ones, the shard its range (the shard's only traffic here).
    assert leader_bytes > 0
    assert shard[1].bytes_received > 0, shard
    models = [key for key in gloo[0] if key.startswith("model/")]
    assert len(models) == 4, models
    for rank in range(world):
        assert str(ours[rank]["backend"]) == "gradsync"
        # DDP's bucket and the 80 KB tensors went to the shards (DDP's 3 steps, 6
        # all-reduces, the all-gather and the reduce-scatter: one range each on shard 1).
        assert int(ours[rank]["ranges_sent"]) == 3 + 6 + 2, int(ours[rank]["ranges_sent"])
        for key in models:
            difference = float(np.abs(ours[rank][key] - gloo[rank][key]).max())
            assert difference <= 1e-6, f"{key} on rank {rank}: {difference:.3g} from gloo"
        for key in (
            *(f"all_reduce_{name}" for name in ("sum", "min", "max", "product")),
            "all_gather_into_tensor",
            "reduce_scatter_tensor",
        ):
            np.testing.assert_array_equal(ours[rank][key], gloo[rank][key], err_msg=key)
        sums = gloo[rank]["all_reduce_sum"]
        np.testing.assert_array_equal(ours[rank]["all_reduce_avg"], sums / world)
        np.testing.assert_array_equal(ours[rank]["all_reduce_premul_sum"], sums / 2)
        # Sizes that differ fail every rank, naming both (those of the leader's range).
        error = str(ours[rank]["mismatch_error"])
        assert str(ours[rank]["mismatch_error_type"]) == "DistBackendError", error
        assert f"allreduce(sum, [{20_000 + rank}] float32)" in error, error
        assert "40004 bytes" in error and "40000 bytes" in error, error
