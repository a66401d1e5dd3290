"""A short churn soak: one failure of each kind, real processes, real Redis, real signals.

Four elastic workers train through an active coordinator and a standby (both leased on a
real redis-server) while `gradsync_bench.churn` SIGKILLs a worker, SIGSTOPs one, SIGKILLs
the active coordinator and restarts Redis, one after another (no shards here, so no
shard SIGKILL: see the test); the supervisor restarts what died. At the end
every live replica must be bitwise identical and no step applied twice; the final
parameters are compared with a replay of the contributions the workers recorded (equal
unless a rank was lost in the middle of a step: see the test). The full soak
(10 minutes, against a churn-free run) is `gradsync bench --suites churn`.
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
    # Without shards (and so without shard-kill): a rank rejoining a sharded job aborts
    # the open step at the shard, and the replicas or the replay then disagree now and
    # then (bench/results/churn/FINDINGS.md, 1 and 2); the soak runs them, --shards 2.
    kinds = tuple(kind for kind in KINDS if kind != "shard-kill")
    plan = churn.ChurnPlan(duration_s=24.0, interval_s=4.0, kinds=kinds, shards=1)
    run = churn.run_once(tmp_path, ClusterConfig(shards=1), plan, kinds=kinds)
    summary = json.dumps({k: v for k, v in run.items() if k != "failures"}, default=str)
    assert run["injection_errors"] == [], summary
    assert [f["kind"] for f in run["failures"]][: len(kinds)] == list(kinds), summary
    assert run["replicas"]["ok"], summary
    assert run["applied_once"]["ok"], summary
    # Every step's contributors were recorded (the replay could be formed)...
    assert run["replay"]["unresolved_count"] == 0, summary
    # ...but equality with it is reported, not asserted: a rank lost in the middle of a
    # step leaves its contribution in the chunks already summed (README, Known limits:
    # one step can mix divisors), which a replay by whole steps cannot reproduce; about
    # one run in seven loses a rank there (bench/results/churn/FINDINGS.md, 5).
    print(f"replay: {json.dumps(run['replay'], default=str)}")
    for row in run["failures"]:
        assert row["recover_s"] is not None, row  # training went on after every failure
    # Each process exit was a failure the schedule injected (or a woken rank's error).
    assert run["coordinator_incarnations"]["coordinator0"] >= 2, summary
    assert all(code in (-9, 3) for codes in run["worker_exit_codes"].values() for code in codes)
    assert run["replicas"]["ok"] and run["applied_once"]["ok"], summary
