"""`gradsync bench --suites churn`: W = 4 elastic workers trained under continuous failures.

Two runs of the same length in one bench run, on the same cluster shape
(`churn_cluster`: a redis-server, an active coordinator and a standby on it,
each with --shards local shard processes, the workers given both addresses):
a churn-free one, then one with a failure every interval (`churn_schedule`).
Each run ends the same way: once every rank is training again, a stop step
is written, every rank stops there and saves its parameters, and the checks
of `churn_checks` run on its logs. The suite's row holds both runs' steps/s,
their ratio (the issue's goal: at least 0.8), the checks, the coordinators'
resident memory over the run and, per failure kind, the time to detect and
to recover and the steps computed again.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gradsync_bench import churn_checks, churn_profile
from gradsync_bench.churn_cluster import Cluster, ClusterConfig
from gradsync_bench.churn_schedule import KINDS, Failure, Monitor, Schedule
from gradsync_bench.procs import progress, wait_until

#: After the failures stop: how long the ranks get to be all back and training.
SETTLE_TIMEOUT_S = 180.0
#: Steps past the furthest rank at which every rank stops (room for a healing one).
STOP_MARGIN_STEPS = 30
FINISH_TIMEOUT_S = 120.0
#: Builds a run's cluster in its folder: `Cluster` or a subclass.
ClusterFactory = Callable[[Path, ClusterConfig], Cluster]


@dataclass(frozen=True)
class ChurnPlan:
    """What the churn suite runs (`gradsync bench --churn-*` flags)."""

    duration_s: float = 600.0
    interval_s: float = 15.0
    kinds: tuple[str, ...] = KINDS
    world_size: int = 4
    shards: int = 2
    #: Where the processes' logs go (default: a temporary folder, removed afterwards).
    work_dir: str | None = None


def churn_suite(plan: ChurnPlan) -> dict[str, Any]:
    """Run the churn-free run, then the churn run; return the suite's document."""
    if plan.work_dir is not None:
        return _both(plan, Path(plan.work_dir))
    with tempfile.TemporaryDirectory(prefix="gradsync-churn-") as folder:
        return _both(plan, Path(folder))


def _both(plan: ChurnPlan, folder: Path) -> dict[str, Any]:
    config = ClusterConfig(world_size=plan.world_size, shards=plan.shards)
    baseline, churn, ratio = both_runs("churn", folder, config, plan, plan.kinds, run_once)
    return {
        "plan": {
            "duration_s": plan.duration_s,
            "interval_s": plan.interval_s,
            "kinds": list(plan.kinds),
            "world_size": plan.world_size,
            "shards": plan.shards,
            "lease_ttl_s": config.lease_ttl_s,
            "compute_s": config.compute_s,
            "checkpoint_every": config.checkpoint_every,
        },
        "baseline": baseline,
        "churn": churn,
        "steps_per_s_ratio": ratio,
        "ok": bool(baseline["ok"] and churn["ok"]),
    }


#: A run's body: (folder, config, plan, kinds) -> the run's row.
RunOnce = Callable[[Path, ClusterConfig, ChurnPlan, tuple[str, ...]], dict[str, Any]]


def both_runs(
    suite: str,
    folder: Path,
    config: ClusterConfig,
    plan: ChurnPlan,
    kinds: tuple[str, ...],
    run: RunOnce,
) -> tuple[dict[str, Any], dict[str, Any], float | None]:
    """The churn-free run, then the run with `kinds` of failures; (baseline, churn, ratio)."""
    progress(f"{suite}: churn-free run of {plan.duration_s:g}s ...")
    baseline = run(folder / "baseline", config, plan, ())
    progress(f"{suite}: run of {plan.duration_s:g}s, a failure every {plan.interval_s:g}s ...")
    churn = run(folder / "churn", config, plan, kinds)
    ratio = churn["steps_per_s"] / baseline["steps_per_s"] if baseline["steps_per_s"] > 0 else None
    return baseline, churn, ratio


@dataclass
class Driven:
    """What one run leaves for its report: the cluster, its failures and the window."""

    cluster: Cluster
    monitor: Monitor | None
    schedule: Schedule | None
    started: float
    ended: float
    settled_s: float
    stop_step: int

    @property
    def failures(self) -> list[Failure]:
        return self.schedule.failures if self.schedule is not None else []


def drive(
    cluster: Cluster, plan: ChurnPlan, kinds: tuple[str, ...], *, monitored: bool = True
) -> Driven:
    """Start `cluster`, train (with failures when `kinds`), settle, stop; always stop it."""
    monitor = Monitor(cluster) if monitored else None
    schedule = Schedule(cluster, kinds, plan.interval_s) if kinds else None
    try:
        cluster.start()
        if monitor is not None:
            monitor.start()
        _wait_all_training(cluster, 180.0, since=0.0)
        started = time.time()
        if schedule is not None:
            schedule.start()
        time.sleep(plan.duration_s)
        ended = time.time()
        if schedule is not None:
            schedule.stop()
        settle_started = time.time()
        _wait_all_training(cluster, SETTLE_TIMEOUT_S, since=ended)
        settled_s = time.time() - settle_started
        stop_step = _finish(cluster)
    finally:
        if monitor is not None:
            monitor.stop()
        cluster.stop()
    return Driven(cluster, monitor, schedule, started, ended, settled_s, stop_step)


def run_once(
    folder: Path,
    config: ClusterConfig,
    plan: ChurnPlan,
    kinds: tuple[str, ...],
    cluster: ClusterFactory = Cluster,
) -> dict[str, Any]:
    """One run of gradsync's cluster (or `cluster`'s): start, train, settle, stop, check."""
    return _report(drive(cluster(folder, config), plan, kinds))


def common_row(
    run: Driven, incarnations: list[churn_checks.Incarnation], rows: list[dict[str, Any]]
) -> dict[str, Any]:
    """The row's parts every cluster shares: throughput, end checks, failures, restarts."""
    times = churn_checks.step_times(incarnations)
    steps_in_window = sum(1 for t, _ in times if run.started <= t < run.ended)
    world = run.cluster.config.world_size
    return {
        "window_s": run.ended - run.started,
        "steps_in_window": steps_in_window,
        "steps_per_s": steps_in_window / (run.ended - run.started),
        "settle_s": run.settled_s,
        "stop_step": run.stop_step,
        "replicas": churn_checks.replicas_identical(incarnations, world),
        "applied_once": churn_checks.applied_once(incarnations),
        "failures": rows,
        "per_kind": churn_checks.summarize_kinds(rows),
        "injection_errors": run.schedule.errors if run.schedule is not None else [],
        "injections_skipped": run.schedule.skipped if run.schedule is not None else [],
        "incarnations": {slot.name: slot.incarnations for slot in run.cluster.workers},
        "worker_exit_codes": {slot.name: slot.exits for slot in run.cluster.workers},
    }


def _latest_applied(folder: Path, rank: int) -> tuple[float, int] | None:
    """(time, step) of the last step the rank's current process applied."""
    path = folder / f"rank{rank}.jsonl"
    if not path.exists():
        return None
    latest: tuple[float, int] | None = None
    for inc in churn_checks.read_logs(folder, rank + 1):
        if inc.rank != rank:
            continue
        applied = inc.of("applied")
        latest = (applied[-1]["t"], applied[-1]["s"]) if applied else None
    return latest


def _wait_all_training(cluster: Cluster, timeout_s: float, since: float) -> None:
    """Until every rank's current process has applied a step after `since` (and 4 did)."""

    def training() -> bool:
        latest = [_latest_applied(cluster.folder, r) for r in range(cluster.config.world_size)]
        return all(entry is not None and entry[0] > since for entry in latest)

    failure = f"the ranks were not all training again within {timeout_s:g}s"
    wait_until(training, timeout_s, failure, interval_s=0.5)


def _finish(cluster: Cluster) -> int:
    """Write the stop step; wait for every rank to stop there. Returns the stop step."""
    for slot in cluster.workers:
        cluster.hold(slot, True)  # no more restarts: a process that ends now is reported
    furthest = max(
        entry[1]
        for r in range(cluster.config.world_size)
        if (entry := _latest_applied(cluster.folder, r)) is not None
    )
    stop_step = furthest + STOP_MARGIN_STEPS
    cluster.stop_file.write_text(f"{stop_step}\n")
    deadline = time.monotonic() + FINISH_TIMEOUT_S
    for slot in cluster.workers:
        if slot.process is not None:
            slot.process.wait(timeout=max(1.0, deadline - time.monotonic()))
    return stop_step


def _rss_summary(monitor: Monitor) -> dict[str, Any]:
    """Per coordinator process: first, last and max MiB (leader; leader + its shards)."""
    processes: list[dict[str, Any]] = []
    for pid, series in monitor.rss.items():
        processes.append(
            {
                "pid": pid,
                "lived_s": series[-1][0] - series[0][0],
                "samples": len(series),
                "leader_mib": _first_last_max([row[1] for row in series]),
                "with_shards_mib": _first_last_max([row[2] for row in series]),
            }
        )
    processes.sort(key=lambda row: -float(row["lived_s"]))
    return {"processes": processes, "longest_lived": processes[0] if processes else None}


def _first_last_max(values: list[float]) -> dict[str, float]:
    return {"first": values[0], "last": values[-1], "max": max(values)}


def _report(run: Driven) -> dict[str, Any]:
    cluster = run.cluster
    assert run.monitor is not None
    incarnations = churn_checks.read_logs(cluster.folder, cluster.config.world_size)
    rows = churn_checks.failure_timings(run.failures, run.monitor.samples, incarnations, run.ended)
    row = common_row(run, incarnations, rows)
    replicas = row["replicas"]
    members, unresolved = churn_checks.contributions(incarnations)
    replayed: dict[str, Any] = {"ok": False, "error": "no final step"}
    if replicas["final_steps"]:
        try:
            skipped = churn_checks.aborted_steps(incarnations)
            digests: dict[int, str] = {}
            counted: dict[int, list[int]] = {}
            expected = churn_checks.replay(
                members,
                replicas["final_steps"][0],
                skipped,
                digests,
                lost=churn_checks.unclaimed(incarnations, members),
                logged=churn_checks.logged_digests(incarnations),
                counted=counted,
                shards=cluster.config.shards,
            )
            replayed = churn_checks.compare_to_replay(
                cluster.folder, expected, replicas["live_ranks"]
            )
            replayed["first_divergence"] = churn_checks.first_divergence(incarnations, digests)
            # Steps whose gradients held a rank lost during them that the count left out.
            replayed["counted_lost_ranks"] = {str(step): r for step, r in sorted(counted.items())}
        except (ValueError, FileNotFoundError) as exc:
            replayed = {"ok": False, "error": str(exc)}
    return {
        **row,
        "replay": {**replayed, "unresolved": unresolved[:20], "unresolved_count": len(unresolved)},
        "contributors_per_step": _widths(members),
        "coordinator_rss": _rss_summary(run.monitor),
        "profile": churn_profile.profile(cluster.folder, run.failures, incarnations),
        "coordinator_incarnations": {s.name: s.incarnations for s in cluster.coordinators},
        "coordinator_exit_codes": {s.name: s.exits for s in cluster.coordinators},
        "ok": bool(
            replicas["ok"] and row["applied_once"]["ok"] and replayed.get("ok") and not unresolved
        ),
    }


def _widths(members: dict[int, list[int]]) -> dict[str, int]:
    """How many steps averaged over 1, 2, ... ranks."""
    counts: dict[str, int] = {}
    for ranks in members.values():
        counts[str(len(ranks))] = counts.get(str(len(ranks)), 0) + 1
    return counts
