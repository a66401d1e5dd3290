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

import pytest
from gradsync.bench.netns import available

SYNC_FIELDS = {"median_ms", "algbw_mb_s", "cpu_s_per_gb", "cpu_utilisation"}


def finite_positive(value: float) -> bool:
    return math.isfinite(value) and value > 0


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
            "--reps",
            "2",
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
        for method in ("gradsync", "gloo"):
            assert set(row[method]) == SYNC_FIELDS
            assert all(finite_positive(v) for v in row[method].values())
        assert finite_positive(row["bandwidth_ratio"])
    (train,) = document["suites"]["train"]
    assert set(train["samples_per_s"]) == {"local", "gradsync", "sequential", "ddp"}
    assert all(finite_positive(v) for v in train["samples_per_s"].values())
    assert finite_positive(train["ratio_to_ddp"]) and finite_positive(train["overlap_gain"])
    assert math.isfinite(train["exposed_comm_ms"])
    capable, reason = available()
    if capable:
        (row,) = document["suites"]["netns"]
        assert row["rate_mbit"] == 500
        for key in ("gloo_of_bound", "gradsync_of_bound", "gloo_bound_ms", "gradsync_bound_ms"):
            assert finite_positive(row[key])
    else:
        assert document["skipped"]["netns"] == reason
    table = (tmp_path / "latest.md").read_text()
    assert "gradsync MB/s" in table and "torchrun DDP" in table
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
