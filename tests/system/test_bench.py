"""`gradsync bench` in tiny form: it runs, writes every field, ratios are finite.

Speed is not asserted here (timings on shared machines are noise); the
numbers themselves come from full runs recorded in bench/results/.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from gradsync.arguments import BENCH_LAYOUTS
from gradsync_bench.netns_probe import available
from gradsync_bench.sharded import LAYOUTS, Topology, ring_factor, topologies

SYNC_FIELDS = {
    "median_ms",
    "algbw_mb_s",
    "cpu_s_per_gb",
    "cpu_s_per_sync",
    "cpu_utilisation",
    "server_cores",
    "busiest_server_cores",
}
#: Fields that are 0 for gloo (it has no coordinator processes).
SERVER_FIELDS = {"server_cores", "busiest_server_cores"}


def finite_positive(value: float) -> bool:
    return math.isfinite(value) and value > 0


def assert_sync_stats(row: dict[str, Any]) -> None:
    """Both methods report every field, finite and positive (gloo has no server CPU)."""
    for method in ("gradsync", "gloo"):
        stats = row[method]
        assert set(stats) == SYNC_FIELDS, method
        for key, value in stats.items():
            if method == "gloo" and key in SERVER_FIELDS:
                assert value == 0, (method, key)
            elif key in SERVER_FIELDS:
                # /proc counts CPU in 10 ms ticks: a coordinator's share of a small sync
                # may round to nothing.
                assert math.isfinite(value) and value >= 0, (method, key, value)
            else:
                assert finite_positive(value), (method, key, value)
    server = row["gradsync"]
    assert server["busiest_server_cores"] <= server["server_cores"] + 1e-9


def run_bench(out: Path, *flags: str, timeout_s: float = 280) -> dict[str, Any]:
    """`gradsync bench --out OUT FLAGS...`; its result document."""
    result = subprocess.run(
        [sys.executable, "-m", "gradsync.cli", "bench", "--out", str(out), *flags],
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "latest.json" in result.stdout
    document: dict[str, Any] = json.loads((out / "latest.json").read_text())
    return document


@pytest.mark.timeout(300)
def test_tiny_bench_writes_complete_results(tmp_path: Path) -> None:
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "gradsync.cli",
            "bench",
            "--quick",
            "--out",
            str(tmp_path),
            "--sizes-mb",
            "1",
            "--worlds",
            "2",
            "--reps",  # one rep: the test checks the rows' fields, not their medians
            "1",
            "--train-model-mb",
            "1",
            "--train-steps",
            "2",
            "--netns-rate-mbit",
            "500",
        ],
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    document = json.loads((tmp_path / "latest.json").read_text())
    assert document["schema_version"] == 1
    assert {"cores", "cpu_model", "torch", "grpcio"} <= set(document["machine"])
    loopback = document["suites"]["loopback"]
    assert [(r["world_size"], r["megabytes"]) for r in loopback] == [(2, 1.0)]
    for row in loopback:
        assert row["shards"] == 1
        assert_sync_stats(row)
        assert finite_positive(row["bandwidth_ratio"])
        assert finite_positive(row["local"]["median_ms"])  # the compute inside gradsync's time
        assert finite_positive(row["ddp"]["median_ms"])  # torch DDP on the same compute
    (train,) = document["suites"]["train"]
    assert set(train["samples_per_s"]) == {"local", "gradsync", "sequential", "ddp", "ddp-backend"}
    assert all(finite_positive(v) for v in train["samples_per_s"].values())
    assert finite_positive(train["ratio_to_ddp"]) and finite_positive(train["overlap_gain"])
    assert math.isfinite(train["exposed_comm_ms"])
    assert finite_positive(train["backend_ratio_to_gradsync"])  # stock DDP over "gradsync"
    # The latency suite (--quick: W = 2, one rep; --train-steps sets its steps too).
    (latency,) = document["suites"]["latency"]
    assert (latency["world_size"], latency["steps"]) == (2, 2)
    for mode in ("flat", "default", "ddp", "ddp-backend"):
        assert finite_positive(latency[mode]["steps_per_s"]), mode
    assert finite_positive(latency["ddp-backend_ratio_to_flat"])
    for mode in ("flat", "default", "ddp-backend"):
        assert finite_positive(latency[f"{mode}_ratio_to_ddp"])
        assert latency[mode]["coordinator_peak_rss_mib"] >= latency[mode]["coordinator_rss_mib"] > 0
        # Read by rank 0 over its timed steps (whole /proc ticks: two steps may read 0).
        assert 0 <= latency[mode]["coordinator_cpu_ms_per_step"] < 1e3, mode
    capable, reason = available()
    if capable:
        (row,) = document["suites"]["netns"]
        assert (row["layout"], row["shards"], row["rate_mbit"]) == ("single", 1, 500)
        assert_sync_stats(row)
        for key in ("gloo_of_bound", "gradsync_of_bound", "gloo_bound_ms", "gradsync_bound_ms"):
            assert finite_positive(row[key])
    else:
        assert document["skipped"]["netns"] == reason
    table = (tmp_path / "latest.md").read_text()
    assert "gradsync MB/s" in table and "torchrun DDP" in table and "flat / DDP" in table
    assert (tmp_path / "latest.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "latest.json" in result.stdout


def test_unknown_suite_is_a_flag_error() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "gradsync.cli", "bench", "--suites", "loopback,warp"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2 and "warp" in result.stderr


def test_bounds_follow_the_cost_model() -> None:
    """The analytic bounds (units of N/B) of ARCHITECTURE.md's cost model, per layout."""
    assert BENCH_LAYOUTS == LAYOUTS
    assert ring_factor(4) == 1.5
    assert Topology("single", 4, 1).bound_factor() == 4
    assert Topology("dedicated", 4, 4).bound_factor() == 1  # S >= W: N/B, below the ring
    assert Topology("dedicated", 4, 2).bound_factor() == 2
    assert Topology("dedicated", 8, 4).bound_factor() == 2
    for world_size in (2, 3, 4, 8):  # colocated with S = W: the ring's bound
        colocated = Topology("colocated", world_size, world_size)
        assert math.isclose(colocated.bound_factor(), ring_factor(world_size))
    assert Topology("colocated", 4, 2).bound_factor() == 2  # (4 + 2 - 2) / 2
    assert Topology("colocated", 4, 1).bound_factor() == 3  # leader alone on worker host 0
    # Hosts: dedicated adds S shard hosts, the leader on the first; colocated adds none.
    assert Topology("dedicated", 2, 3).hosts == ["s0", "s1", "s2", "w0", "w1"]
    assert Topology("colocated", 3, 2).shard_hosts == ["w0", "w1"]
    assert Topology("colocated", 3, 2).hosts == ["w0", "w1", "w2"]
    assert Topology("single", 2, 1).hosts == ["coord", "w0", "w1"]
    # No shard counts: S = W; colocated skips S > W.
    found = topologies(["single", "dedicated", "colocated"], [2, 4], [])
    assert [(t.layout, t.world_size, t.shards) for t in found] == [
        ("single", 2, 1),
        ("single", 4, 1),
        ("dedicated", 2, 2),
        ("dedicated", 4, 4),
        ("colocated", 2, 2),
        ("colocated", 4, 4),
    ]
    found = topologies(["colocated"], [2], [2, 3])
    assert [(t.world_size, t.shards) for t in found] == [(2, 2)]
    with pytest.raises(ValueError, match="S=3 > W=2"):
        Topology("colocated", 2, 3)
    with pytest.raises(ValueError, match="unknown layout"):
        Topology("ring", 2, 1)


@pytest.mark.timeout(400)
def test_sharded_layouts_and_loopback_shards_measure_against_their_bounds(tmp_path: Path) -> None:
    """The dedicated and colocated layouts (leader + `gradsync shard` on emulated hosts) and
    loopback with `serve --shards 2`: rows with every field, bounds from the cost model, the
    shard processes' CPU counted, the table and the plot written."""
    document = run_bench(
        tmp_path,
        *("--suites", "loopback,netns", "--layouts", "dedicated,colocated", "--shards", "2"),
        *("--worlds", "2", "--sizes-mb", "1", "--reps", "2", "--netns-rate-mbit", "200"),
        timeout_s=380,
    )
    loopback = document["suites"]["loopback"]
    assert [(r["shards"], r["world_size"]) for r in loopback] == [(1, 2), (2, 2)]
    for row in loopback:
        assert_sync_stats(row)
    capable, reason = available()
    if not capable:
        assert document["skipped"]["netns"] == reason
        return
    netns = document["suites"]["netns"]
    assert [(r["layout"], r["world_size"], r["shards"]) for r in netns] == [
        ("dedicated", 2, 2),
        ("colocated", 2, 2),
    ]
    link_ms = 1 * (1 << 20) / (200e6 / 8) * 1e3
    for row in netns:
        assert_sync_stats(row)
        assert math.isclose(row["link_ms"], link_ms)
        factor = Topology(row["layout"], 2, 2).bound_factor()
        assert math.isclose(row["gradsync_bound_ms"], factor * link_ms)
        assert math.isclose(row["gloo_bound_ms"], ring_factor(2) * link_ms)
        assert math.isclose(
            row["gradsync_to_gloo"], row["gradsync"]["median_ms"] / row["gloo"]["median_ms"]
        )
        for key in ("gloo_of_bound", "gradsync_of_bound"):
            # A 1 MB sync cannot beat its bandwidth bound by more than the shaping's slack:
            # tbf lets a burst of 128 KiB (plus its queue) pass at once after idle time.
            assert 0 < row[key] <= 1.5, (row["layout"], key, row[key])
    table = (tmp_path / "latest.md").read_text()
    assert "| dedicated | 2 | 2 | 1 | 200 |" in table and "| colocated | 2 | 2 | 1 | 200 |" in table
    assert (tmp_path / "latest.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
