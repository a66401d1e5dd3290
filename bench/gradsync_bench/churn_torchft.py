"""`gradsync bench --suites churn-torchft`: torchft under the churn suite's failures.

The churn suite (`gradsync_bench.churn`) with torchft (pinned in the bench extra) in
gradsync's place: W replica groups of one process each (`churn_torchft_worker`: the churn
workers' model, data and optimizer, per-step DDP through torchft's `Manager`), and
torchft's lighthouse where gradsync's coordinators run, everything on loopback. The same
supervisor (`churn_cluster`) starts a process that ends again, and the same schedule
(`churn_schedule`) injects the failures that have a counterpart in torchft:

* worker-kill: SIGKILL of a replica group; restarted, it joins the next quorum and is
  healed from a live group;
* worker-stop: SIGSTOP for the same time as gradsync's; the other groups wait for it in
  their all-reduce until the manager's timeout, then go on without it;
* coordinator-kill: SIGKILL of the lighthouse (torchft has no standby: the supervisor starts
  it again on its port, with no state; the groups' quorums wait for it);
* shard-kill and redis-restart have none (the lighthouse keeps no shards and no store) and
  are left out.

Two runs of the same length, a churn-free one and one with a failure every interval, end
as the churn suite's do (a stop step once every group trains, final parameters, digests).
The row holds both runs' steps/s and their ratio, per failure kind the time to the first
reaction, the longest stall of the job's steps that follows (counted whole, even when it
ends after the next failure or the run's window) and when training went on after it, and
the steps torchft did not commit (computed, then thrown away and computed again).
"""

from __future__ import annotations

import os
import socket
import tempfile
import threading
from itertools import pairwise
from pathlib import Path
from typing import Any

from gradsync_bench import churn_checks
from gradsync_bench.churn import ChurnPlan, both_runs, common_row, drive
from gradsync_bench.churn_cluster import Cluster, ClusterConfig, Supervised, free_port
from gradsync_bench.churn_report import end_checks, kind_rows
from gradsync_bench.churn_schedule import STOP_S, Sample
from gradsync_bench.procs import flag_args
from gradsync_bench.torchft_wan import lighthouse_command

#: The churn suite's failure kinds that torchft has a counterpart of, and what it is.
COUNTERPARTS = {
    "worker-kill": "SIGKILL of a replica group's process (restarted, healed)",
    "worker-stop": f"SIGSTOP of a replica group's process for {STOP_S:g} s",
    "coordinator-kill": "SIGKILL of the lighthouse (restarted on its port, no standby)",
}
#: The lighthouse's liveness: the churn workers' heartbeat timeout in gradsync's runs.
HEARTBEAT_TIMEOUT_MS = 2000
#: How long the lighthouse waits for a heartbeating group to join a quorum.
JOIN_TIMEOUT_MS = 2000
#: The manager's timeout for an all-reduce and the commit (a frozen group's peers wait so long).
MANAGER_TIMEOUT_S = 5.0
#: How often a group's manager asks the lighthouse again for a quorum that failed (torchft's
#: default, 0, ends every group whose quorum was in flight when the lighthouse died).
QUORUM_RETRIES = 3


def torchft_kinds(kinds: tuple[str, ...]) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The kinds of `kinds` with a torchft counterpart (in order), and those without."""
    kept = tuple(kind for kind in kinds if kind in COUNTERPARTS)
    return kept, tuple(kind for kind in kinds if kind not in COUNTERPARTS)


class TorchftCluster(Cluster):
    """The lighthouse (as the one "coordinator") and W replica groups, supervised.

    It is a `Cluster` for the schedule and the churn suite's helpers: same slots, same
    supervision, no Redis, no standby, no shards.
    """

    def __init__(self, folder: Path, config: ClusterConfig) -> None:
        self.folder = folder
        self.config = config
        folder.mkdir(parents=True, exist_ok=True)
        self.redis = None
        self.stop_file = folder / "stop"
        self.env = dict(os.environ)
        port = free_port()
        self.ports = [port]
        self.addresses = [f"127.0.0.1:{port}"]
        command = lighthouse_command(config.min_workers)
        bind = command.index("--bind") + 1
        command[bind] = self.addresses[0]
        command[command.index("--join_timeout_ms") + 1] = str(JOIN_TIMEOUT_MS)
        command[command.index("--heartbeat_timeout_ms") + 1] = str(HEARTBEAT_TIMEOUT_MS)
        self.coordinators = [Supervised("lighthouse", command, folder / "lighthouse.log")]
        self._store_ports: set[int] = set()
        self.workers = [self._group(rank) for rank in range(config.world_size)]
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None

    def _group(self, rank: int) -> Supervised:
        config = self.config
        store_port = free_port()
        while store_port in self._store_ports or store_port == self.ports[0]:
            store_port = free_port()
        self._store_ports.add(store_port)
        command = [
            config.python, "-m", "gradsync_bench.churn_torchft_worker",
            *flag_args(lighthouse=f"http://{self.addresses[0]}", rank=rank),
            *flag_args(store_port=store_port, min_replicas=config.min_workers),
            *flag_args(log=self.folder / f"rank{rank}.jsonl", stop_file=self.stop_file),
            *flag_args(final=self.folder / f"final{rank}.pt", compute_s=config.compute_s),
            *flag_args(timeout_s=MANAGER_TIMEOUT_S, quorum_retries=QUORUM_RETRIES),
        ]  # fmt: skip
        return Supervised(f"rank{rank}", command, self.folder / f"rank{rank}.log")

    def start(self) -> None:
        """The lighthouse, then the groups, then the supervisor."""
        self.coordinators[0].start(self.env)
        self.wait_active(60)
        for worker in self.workers:
            worker.start(self.env)
        self._thread = threading.Thread(target=self._supervise, name="supervisor", daemon=True)
        self._thread.start()

    def active_index(self) -> int | None:
        """0 while the lighthouse accepts connections, else None."""
        host, port = self.addresses[0].split(":")
        try:
            with socket.create_connection((host, int(port)), timeout=1):
                return 0
        except OSError:
            return None

    def shard_pids(self, index: int) -> list[int]:
        return []


def churn_torchft_suite(plan: ChurnPlan) -> dict[str, Any]:
    """The churn-free run, then the churn run, with torchft; the suite's document."""
    if plan.work_dir is not None:
        return _both(plan, Path(plan.work_dir) / "torchft")
    with tempfile.TemporaryDirectory(prefix="gradsync-churn-torchft-") as folder:
        return _both(plan, Path(folder))


def _both(plan: ChurnPlan, folder: Path) -> dict[str, Any]:
    config = ClusterConfig(world_size=plan.world_size)
    kinds, left_out = torchft_kinds(plan.kinds)
    baseline, churn, ratio = both_runs("churn-torchft", folder, config, plan, kinds, run_once)
    return {
        "plan": {
            "duration_s": plan.duration_s,
            "interval_s": plan.interval_s,
            "kinds": list(kinds),
            "left_out": list(left_out),
            "counterparts": {kind: COUNTERPARTS[kind] for kind in kinds},
            "world_size": plan.world_size,
            "min_replicas": config.min_workers,
            "compute_s": config.compute_s,
            "lighthouse_heartbeat_timeout_ms": HEARTBEAT_TIMEOUT_MS,
            "lighthouse_join_timeout_ms": JOIN_TIMEOUT_MS,
            "manager_timeout_s": MANAGER_TIMEOUT_S,
            "quorum_retries": QUORUM_RETRIES,
        },
        "baseline": baseline,
        "churn": churn,
        "steps_per_s_ratio": ratio,
        "ok": bool(baseline["ok"] and churn["ok"]),
    }


def run_once(
    folder: Path, config: ClusterConfig, plan: ChurnPlan, kinds: tuple[str, ...]
) -> dict[str, Any]:
    """One run of the churn suite's (`churn.drive`) on torchft's cluster; its row."""
    run = drive(TorchftCluster(folder, config), plan, kinds, monitored=False)
    incarnations = churn_checks.read_logs(run.cluster.folder, config.world_size)
    failures = run.failures
    rows = churn_checks.failure_timings(
        failures, participant_samples(incarnations), incarnations, run.ended
    )
    times = churn_checks.step_times(incarnations)
    for index, row in enumerate(rows):
        if row["kind"] == "worker-stop" and row["rank_back_s"] is None:
            row["rank_back_s"] = rank_applied_after(incarnations, row["target"], row["at_s"])
        until = failures[index + 1].at if index + 1 < len(failures) else float("inf")
        stall = longest_stall([t for t, _ in times], row["at_s"], until)
        if stall is not None:
            row["longest_stall_s"] = stall[1] - stall[0]
            row["recover_s"] = stall[1] - row["at_s"]
    common = common_row(run, incarnations, rows)
    uncommitted = [e for inc in incarnations for e in inc.of("restart")]
    return {
        **common,
        "uncommitted": len(uncommitted),
        "uncommitted_in_window": sum(1 for e in uncommitted if run.started <= e["t"] < run.ended),
        "lighthouse_incarnations": run.cluster.coordinators[0].incarnations,
        "errors": [
            f"rank {inc.rank}: {e['class']}: {e['message'][:200]}"
            for inc in incarnations
            for e in inc.of("error")
        ][:10],
        "ok": bool(common["replicas"]["ok"] and common["applied_once"]["ok"]),
    }


def participant_samples(incarnations: list[churn_checks.Incarnation]) -> list[Sample]:
    """The job's membership as the groups logged it: a sample per first application of a
    step, its participant count as the "epoch" (a change is a reaction to a failure)."""
    first: dict[int, tuple[float, int]] = {}
    for inc in incarnations:
        for event in inc.of("applied"):
            if event["s"] not in first or event["t"] < first[event["s"]][0]:
                first[event["s"]] = (event["t"], int(event["c"]))
    return [
        Sample(t, 0, count, step, count) for step, (t, count) in sorted(first.items(), key=_time)
    ]


def _time(item: tuple[int, tuple[float, int]]) -> float:
    return item[1][0]


def rank_applied_after(
    incarnations: list[churn_checks.Incarnation], target: str, at: float
) -> float | None:
    """Seconds from `at` + the stop until the frozen rank `target` ("rank R") applied a step."""
    rank = int(target.split()[-1])
    woken = at + STOP_S
    times = [
        e["t"]
        for inc in incarnations
        if inc.rank == rank
        for e in inc.of("applied")
        if e["t"] > woken
    ]
    return min(times) - at if times else None


def markdown_lines(suite: dict[str, Any]) -> list[str]:
    """The suite's section; nothing when it did not run."""
    if not suite:
        return []
    plan = suite["plan"]
    lines = [
        f"**Churn soak, torchft** (W = {plan['world_size']} replica groups, min "
        f"{plan['min_replicas']}, a lighthouse, per-step DDP; {plan['duration_s']:g} s with a "
        f"failure every {plan['interval_s']:g} s cycling over {', '.join(plan['kinds'])}"
        + (f"; left out: {', '.join(plan['left_out'])}" if plan["left_out"] else "")
        + "; against a churn-free run of the same length)",
        "",
        "| run | steps/s | steps | end checks | steps not committed (in window) |",
        "|---|---|---|---|---|",
    ]
    for name in ("baseline", "churn"):
        run = suite[name]
        checks = "; ".join(end_checks(run))
        lines.append(
            f"| {name} | {run['steps_per_s']:.1f} | {run['steps_in_window']} | {checks} | "
            f"{run['uncommitted']} ({run['uncommitted_in_window']}) |"
        )
    ratio = suite["steps_per_s_ratio"]
    lines += [
        "",
        f"Steps/s under churn / churn-free: {ratio:.2f}."
        if ratio is not None
        else "Steps/s ratio: no churn-free steps.",
        "",
        *kind_rows(
            suite["churn"]["per_kind"],
            "| failure | count | first reaction s | training again s | longest stall s "
            "| hit rank training again s | steps computed again |",
        ),
    ]
    problems = suite["churn"]["injection_errors"] + suite["churn"]["errors"]
    if problems:
        lines += ["", f"Errors: {'; '.join(problems[:5])}"]
    lines.append("")
    return lines


def longest_stall(times: list[float], start: float, end: float) -> tuple[float, float] | None:
    """The longest gap (from, to) between consecutive job steps in `times` (sorted) that ends
    in (start, end]: the step in flight at the failure included, and counted whole when it
    ends after the run's window (`end` is the next failure, or infinity for the last)."""
    gaps = [(a, b) for a, b in pairwise(times) if start < b <= end]
    return max(gaps, key=lambda gap: gap[1] - gap[0], default=None)
