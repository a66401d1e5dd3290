"""Where a churn run's stalls went: each rejoin's and each takeover's timeline.

From the logs a churn run keeps (the workers' JSON lines, the coordinators' logs with
their millisecond timestamps), without instrumenting anything:

* a rejoin (every process of a rank after its first): when the process started (after
  its imports of torch and gradsync), when the coordinator admitted it into the open step
  ("rank(s) [R] rejoined ... at step S"), when its wrapper was built and its optimizer
  registered (the worker's "joined"), its first step submitted and applied; and the gap
  in the job's steps around the admission, which is what the other ranks waited;
* a takeover (each coordinator kill): when the standby started its local shards, took the
  lease, each rank joined it again, its shards registered and the job continued, and the
  job's first step after the kill.

Every time is in seconds from the process start (a rejoin) or from the kill (a takeover).
"""

from __future__ import annotations

import datetime
import re
import statistics
from pathlib import Path
from typing import Any

from gradsync_bench.churn_checks import Incarnation, step_times
from gradsync_bench.churn_schedule import Failure

_LINE = re.compile(r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) \[(\w+)\] \w+ [\w.]+: (.*)")
_ADMITTED = re.compile(r"rank\(s\) \[([\d, ]+)\] rejoined job .* at step (\d+)")
#: A takeover's milestones: (name, what the leader's log line says).
_MILESTONES = (
    ("shards_started", "local shard process(es)"),
    ("took_over", "took over the lease"),
    ("shards_registered", "all shards registered"),
    ("continued", "continued at step"),
)


def coordinator_events(folder: Path) -> list[tuple[float, str, str]]:
    """(wall time, log file's name, message) of every timestamped coordinator log line."""
    events: list[tuple[float, str, str]] = []
    for path in sorted(folder.glob("coordinator*.log")):
        for line in path.read_text(errors="replace").splitlines():
            match = _LINE.match(line)
            if match is None:
                continue
            # The logs' timestamps are local time, as `datetime` reads a naive one.
            stamp = datetime.datetime.strptime(match.group(1), "%Y-%m-%d %H:%M:%S,%f")
            events.append((stamp.timestamp(), path.stem, match.group(3)))
    events.sort()
    return events


def _first(incarnation: Incarnation, kind: str) -> float | None:
    events = incarnation.of(kind)
    return float(events[0]["t"]) if events else None


def _since(t: float | None, origin: float) -> float | None:
    return None if t is None else t - origin


def rejoins(
    incarnations: list[Incarnation], events: list[tuple[float, str, str]]
) -> list[dict[str, Any]]:
    """Each rejoining process's timeline, and the job's gap around its admission."""
    times = [t for t, _ in step_times(incarnations)]
    admissions = [
        (t, int(rank))
        for t, _, message in events
        if (match := _ADMITTED.search(message))
        for rank in match.group(1).split(",")
    ]
    seen: set[int] = set()
    rows: list[dict[str, Any]] = []
    for inc in incarnations:
        if inc.rank not in seen:
            seen.add(inc.rank)
            continue
        start = _first(inc, "start")
        if start is None:
            continue
        admitted = min((t for t, r in admissions if r == inc.rank and t >= start), default=None)
        row: dict[str, Any] = {
            "rank": inc.rank,
            "admitted_s": _since(admitted, start),
            "joined_s": _since(_first(inc, "joined"), start),
            "first_submit_s": _since(_first(inc, "submit"), start),
            "first_applied_s": _since(_first(inc, "applied"), start),
            "others_waited_s": None,
        }
        if admitted is not None:
            before = [t for t in times if t <= admitted]
            after = [t for t in times if t > admitted]
            if before and after:
                row["others_waited_s"] = after[0] - before[-1]
        rows.append(row)
    return rows


def takeovers(
    failures: list[Failure],
    incarnations: list[Incarnation],
    events: list[tuple[float, str, str]],
) -> list[dict[str, Any]]:
    """Each coordinator kill's milestones at the coordinator that took over."""
    times = [t for t, _ in step_times(incarnations)]
    kills = [f for f in failures if f.kind == "coordinator-kill"]
    rows: list[dict[str, Any]] = []
    for index, kill in enumerate(kills):
        until = kills[index + 1].at if index + 1 < len(kills) else float("inf")
        window = [(t, who, m) for t, who, m in events if kill.at <= t < until]
        taken = next((who for _, who, m in window if "took over the lease" in m), None)
        row: dict[str, Any] = {"target": kill.target, "by": taken}
        for name, words in _MILESTONES:
            row[f"{name}_s"] = next(
                (t - kill.at for t, who, m in window if who == taken and words in m), None
            )
        # The ranks' joins that the job continued with (a later rejoin is a rejoin's).
        resumed = row["continued_s"] if row["continued_s"] is not None else float("inf")
        joins = [
            t - kill.at
            for t, who, m in window
            if who == taken and " joined from " in m and t - kill.at <= resumed
        ]
        row["first_rank_joined_s"] = min(joins, default=None)
        row["last_rank_joined_s"] = max(joins, default=None)
        row["first_step_s"] = next((t - kill.at for t in times if t > kill.at), None)
        rows.append(row)
    return rows


def profile(
    folder: Path, failures: list[Failure], incarnations: list[Incarnation]
) -> dict[str, Any]:
    """The run's rejoins and takeovers (see the module's docstring)."""
    events = coordinator_events(folder)
    return {
        "rejoins": rejoins(incarnations, events),
        "takeovers": takeovers(failures, incarnations, events),
    }


def medians(rows: list[dict[str, Any]]) -> dict[str, float]:
    """The median of every timing (`*_s`) over `rows`, where any row has one."""
    keys = sorted({key for row in rows for key in row if key.endswith("_s")})
    found = {key: [row[key] for row in rows if row.get(key) is not None] for key in keys}
    return {key: statistics.median(values) for key, values in found.items() if values}
