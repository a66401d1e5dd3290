"""Hierarchical aggregation on one emulated host: parity, a too-small segment dir, elastic.

Three ranks share `$GRADSYNC_HOST_ID`, so the coordinator makes them one local group
(rank 0 the local leader): they sum their gradients in shared memory and only rank 0
uploads. To import torch once, each rank process runs six jobs one after the other
on one coordinator (elastic, which changes nothing until a rank dies):

0, 1. hierarchical, twice: summation order is fixed (local ranks ascending, then units
      by ascending leader), so the two agree bitwise;
2.    flat: the order differs (0+1+2 summed locally, then divided), hence 1e-6
      relative, as against single-process training on the global batch;
3.    hierarchical with gradient_as_bucket_view: bitwise the plain hierarchical run;
4.    hierarchical with $GRADSYNC_SHM_DIR on a 64 KiB tmpfs (root only): refused with
      SharedMemoryError on every rank, naming the bytes needed;
5.    hierarchical with a Chrome trace, /metrics (scraped over HTTP) and a checkpoint
      saved through the coordinator's file store: all three still work in a group;
6.    hierarchical, rank 2 (a follower) SIGKILLed at step 2: the others go on as a
      group of two and end equal.
"""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from support import scenarios
from support.faults import HEARTBEAT
from support.hierarchy import (
    assert_ranks_identical,
    can_mount_tmpfs,
    finish,
    log_of,
    max_relative_difference,
    private_tmpfs,
    run_of,
    start_job,
    used_bytes,
)
from support.processes import CoordinatorProcess

#: One parallel worker runs the whole module: the module's runs are trained once (module fixtures).
pytestmark = [pytest.mark.timeout(180), pytest.mark.xdist_group("hier-training")]

WORLD = 3
STEPS = 4
RUNS = ("hier", "hier", "flat", "hier+view", "hier+tiny", "hier+observe", "hier+kill")
HIER, HIER_AGAIN, FLAT, HIER_VIEW, TINY, OBSERVED, ELASTIC = range(len(RUNS))
KILLED, KILL_STEP = 2, 2
ELASTIC_FLAGS = (*HEARTBEAT, "--on-failure", "elastic", "--min-workers", "2")


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """Every run of every rank (runs[index][rank]), trained once for the module; the
    tiny dir's skip reason ("" when it ran) and the coordinator's log."""
    out = tmp_path_factory.mktemp("hier-one-host")
    tiny_ok, tiny_reason = can_mount_tmpfs(out)
    specs = [spec if tiny_ok or "tiny" not in spec else "hier" for spec in RUNS]
    store = out / "checkpoints"
    coordinator = CoordinatorProcess(WORLD, *ELASTIC_FLAGS, "--checkpoint-store", str(store))
    try:
        with private_tmpfs(out / "tiny", "64k") if tiny_ok else contextlib.nullcontext(out) as tiny:
            processes = start_job(
                coordinator.address,
                WORLD,
                out,
                "--runs",
                ",".join(specs),
                "--steps",
                str(STEPS),
                "--tiny-shm-dir",
                str(tiny),
                hosts=["host-a"] * WORLD,
                per_rank={KILLED: ["--kill-at", str(KILL_STEP)]},
            )
            reports = finish(processes, out, timeout_s=150)
            tiny_used = used_bytes(tiny)
    finally:
        _, log = coordinator.stop()
    yield {
        "reports": reports,
        "out": out,
        "tiny_reason": tiny_reason,
        "tiny_used": tiny_used,
        "log": log,
        "store": store,
    }


def _ok(runs: dict[str, Any], index: int) -> list[dict[str, Any]]:
    return run_of(runs["reports"], index, runs["out"])


def test_every_rank_of_a_hierarchical_run_ends_identical(runs: dict[str, Any]) -> None:
    for index in (HIER, HIER_AGAIN, FLAT, HIER_VIEW):
        group = [] if index == FLAT else list(range(WORLD))
        assert all(run["local_ranks"] == group for run in _ok(runs, index)), index
        assert_ranks_identical(_ok(runs, index))
        assert all(run["contributors"] == [WORLD] * STEPS for run in _ok(runs, index)), index


def test_hierarchical_run_repeats_bitwise(runs: dict[str, Any]) -> None:
    for first, again in zip(_ok(runs, HIER), _ok(runs, HIER_AGAIN), strict=True):
        assert max_relative_difference(first, again) == 0.0


def test_hierarchical_matches_flat_and_single_process(runs: dict[str, Any]) -> None:
    hier, flat = _ok(runs, HIER)[0], _ok(runs, FLAT)[0]
    difference = max_relative_difference(hier, flat)
    print(f"hierarchical vs flat, 1 host x {WORLD}: max relative difference {difference:.3g}")
    assert difference <= 1e-6
    reference = scenarios.reference_training(WORLD, STEPS, init_seed=0)
    for name, param in reference.named_parameters():
        expected = param.detach().double().numpy()
        got = np.array(hier["params"][name])
        error = np.linalg.norm(got - expected) / np.linalg.norm(expected)
        assert error <= 1e-6, (name, error)


def test_bucket_view_with_hierarchy_matches_flat(runs: dict[str, Any]) -> None:
    difference = max_relative_difference(_ok(runs, HIER_VIEW)[0], _ok(runs, FLAT)[0])
    print(f"hierarchical + gradient_as_bucket_view vs flat: {difference:.3g}")
    assert difference <= 1e-6
    # Only where gradients live differs, not the arithmetic: bitwise the plain hierarchy.
    assert max_relative_difference(_ok(runs, HIER_VIEW)[0], _ok(runs, HIER)[0]) == 0.0


def test_too_small_shared_memory_dir_is_refused_on_every_rank(runs: dict[str, Any]) -> None:
    if runs["tiny_reason"]:
        pytest.skip(runs["tiny_reason"])
    # Every slot (one per rank) and the result region hold every bucket.
    gradient_bytes = sum(p.numel() * p.element_size() for p in scenarios.MixedModel(0).parameters())
    for rank, ranks_runs in enumerate(runs["reports"]):
        assert ranks_runs is not None, log_of(runs["out"], rank)
        run = ranks_runs[TINY]
        assert run["status"] == "SharedMemoryError", (rank, run["status"], run["message"])
        message = run["message"]
        assert str(runs["out"] / "tiny") in message, message
        needed = re.search(r"needs (\d+) bytes", message)
        assert needed and int(needed.group(1)) >= (WORLD + 1) * gradient_bytes, message
    assert runs["tiny_used"] == 0


def test_elastic_job_goes_on_without_a_killed_follower(runs: dict[str, Any]) -> None:
    reports = runs["reports"]
    killed = reports[KILLED]
    assert killed is not None and len(killed) == ELASTIC, "rank 2 died in the last run"
    survivors = []
    for rank in (0, 1):
        ranks_runs = reports[rank]
        assert ranks_runs is not None, log_of(runs["out"], rank)
        run = ranks_runs[ELASTIC]
        assert run["status"] == "ok", (rank, run["message"], log_of(runs["out"], rank))
        assert run["step"] == STEPS
        contributors = run["contributors"]
        assert contributors[:KILL_STEP] == [WORLD] * KILL_STEP, contributors
        assert contributors[KILL_STEP + 1 :] == [WORLD - 1] * (STEPS - KILL_STEP - 1)
        survivors.append(run)
    for name, value in survivors[0]["params"].items():
        np.testing.assert_array_equal(value, survivors[1]["params"][name], err_msg=name)
    assert "continuing with ranks [0, 1]" in runs["log"]


def test_trace_metrics_and_checkpoints_work_in_a_group(runs: dict[str, Any]) -> None:
    observed = _ok(runs, OBSERVED)
    assert_ranks_identical(observed)
    assert observed[0]["checkpoint_step"] == STEPS
    assert any(runs["store"].rglob("*")), "the coordinator's file store holds no checkpoint"
    for rank, run in enumerate(observed):
        metrics = run["metrics"]
        assert metrics["gradsync_worker_local_group_size"] == WORLD, metrics
        # Only the local leader times the host's sums and uploads them.
        sums = metrics["gradsync_worker_local_reduce_seconds_count"]
        sent = metrics["gradsync_worker_host_sent_bytes_total"]
        assert (sums > 0, sent > 0) == (rank == 0, rank == 0), (rank, metrics)
        (path,) = runs["out"].glob(f"trace-*-{OBSERVED}-{rank}.json")
        trace = json.loads(path.read_text())
        events = trace["traceEvents"] if isinstance(trace, dict) else trace
        local = [e for e in events if str(e.get("name", "")).startswith("local reduce")]
        assert events and bool(local) == (rank == 0), (rank, len(events), len(local))
