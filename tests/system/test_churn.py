"""A short churn soak: one failure of each kind, real processes, real Redis, real signals.

Four elastic workers train through an active coordinator and a standby (both leased on a
real redis-server, each with one local shard: `--shards 2`) while `gradsync_bench.churn`
SIGKILLs a worker, SIGSTOPs one, SIGKILLs the active coordinator, SIGKILLs a shard and
restarts Redis, one after another; the supervisor restarts what died. At the end every
live replica must be bitwise identical, no step applied twice, no step aborted, and the
final parameters bitwise equal to a replay of the contributions the workers recorded
(a rank lost during a step is counted in it where the step's logged digest says its
gradients were in). The full soak (10 minutes, against a churn-free run) is
`gradsync bench --suites churn`.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from gradsync.arguments import BENCH_CHURN_KINDS, build_parser
from gradsync_bench import churn
from gradsync_bench.churn_cluster import ClusterConfig
from gradsync_bench.churn_schedule import KINDS
from gradsync_bench.plan_args import plan_from_args
from support.components import REDIS_SERVER


def test_the_churn_flags_reach_the_plan(tmp_path: Path) -> None:
    assert BENCH_CHURN_KINDS == KINDS
    argv = ["bench", "--suites", "churn", "--churn-duration-s", "30", "--churn-interval-s", "4"]
    argv += ["--churn-kinds", "worker-kill,redis-restart", "--churn-work-dir", str(tmp_path)]
    args = build_parser().parse_args(argv)
    plan = plan_from_args(args)
    assert plan.suites == ("churn",)
    assert plan.churn.duration_s == 30 and plan.churn.interval_s == 4
    assert plan.churn.kinds == ("worker-kill", "redis-restart")
    assert plan.churn.work_dir == str(tmp_path)


@pytest.mark.timeout(180)
def test_one_failure_of_each_kind_leaves_identical_replicas_equal_to_the_replay(
    tmp_path: Path,
) -> None:
    if REDIS_SERVER is None:
        pytest.skip("no redis-server on PATH")
    # The SIGSTOP holds its injection 4 s: the fifth failure (Redis) comes at ~24 s, and no
    # sixth (a worker SIGKILL at ~28 s, whose new process the end would wait for).
    plan = churn.ChurnPlan(duration_s=26.5, interval_s=4.0, kinds=KINDS, shards=2)
    run = churn.run_once(tmp_path, ClusterConfig(shards=2), plan, kinds=KINDS)
    summary = json.dumps({k: v for k, v in run.items() if k != "failures"}, default=str)
    assert run["injection_errors"] == [], summary
    assert [f["kind"] for f in run["failures"]][: len(KINDS)] == list(KINDS), summary
    assert run["replicas"]["ok"], summary
    assert run["applied_once"]["ok"], summary
    # No rejoin (two, after the worker kills) aborted a step.
    assert run["applied_once"]["aborted_steps"] == [], summary
    # Every step's contributors were recorded, and the replay of them is bitwise equal.
    assert run["replay"]["unresolved_count"] == 0, summary
    assert run["replay"]["first_divergence"] is None, summary
    assert run["replay"]["bitwise"], summary
    for row in run["failures"]:
        assert row["recover_s"] is not None, row  # training went on after every failure
    # Each process exit was a failure the schedule injected (or a woken rank's error).
    assert run["coordinator_incarnations"]["coordinator0"] >= 2, summary
    assert all(code in (-9, 3) for codes in run["worker_exit_codes"].values() for code in codes)
