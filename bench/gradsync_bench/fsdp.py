"""FSDP2 step time over the c10d backend "gradsync" against gloo.

Per world size W (default 2 and 4, all ranks on this host), `gradsync_bench.fsdp_worker`
trains the same `fully_shard`-ed small transformer over a default group on gloo and on
"gradsync" (a fresh coordinator per run), alternating gloo, gradsync, gloo, gradsync
for `reps` rounds; each run's step time is its slowest rank's, and the median of each
backend's runs is kept with each worker's CPU time per step (all its threads, the
mean over ranks), which a loaded machine stretches less than the wall time.

    python -m gradsync_bench.fsdp --worlds 2,4 --steps 50 --reps 2 --out fsdp.json

writes the rows (with the command, commit, date and load) to `--out` and prints the
table.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gradsync_proto.net.launch import local_launch, start_coordinator

from gradsync_bench.fsdp_worker import BACKENDS
from gradsync_bench.procs import flag_args, progress, run_module_ranks, stop_process
from gradsync_bench.provenance import command_line, commit

Row = dict[str, Any]
#: A heartbeat timeout that a rank starved of CPU on a shared machine does not trip
#: (a step here is milliseconds; liveness is not what is measured).
HEARTBEAT = ("--heartbeat-timeout", "60")


@dataclass(frozen=True)
class FsdpPlan:
    """What the FSDP2 benchmark runs."""

    worlds: tuple[int, ...] = (2, 4)
    steps: int = 50
    warmup: int = 3
    batch: int = 4
    reps: int = 2
    #: Bound on one run of W workers (start, join, warmup, timed steps).
    run_timeout_s: float = 600.0


def run_once(world_size: int, backend: str, plan: FsdpPlan, workdir: Path) -> dict[str, float]:
    """One run over `backend` at `world_size`: step time (slowest rank), worker CPU."""
    env = dict(os.environ)
    coordinator = None
    if backend == "gradsync":
        coordinator, port = start_coordinator(
            world_size, *HEARTBEAT, launch=local_launch, timeout_s=plan.run_timeout_s
        )
        env["GRADSYNC_COORDINATOR"] = f"127.0.0.1:{port}"
    try:
        records = run_module_ranks(
            "gradsync_bench.fsdp_worker",
            world_size,
            workdir / f"{backend}-w{world_size}",
            flag_args(backend=backend, steps=plan.steps, warmup=plan.warmup, batch=plan.batch),
            env,
            timeout_s=plan.run_timeout_s,
            what=f"fsdp {backend} W={world_size}",
        )
    finally:
        if coordinator is not None:
            stop_process(coordinator)
    seconds = max(record["seconds"] for record in records)
    cpu = statistics.mean(record["cpu_s"] for record in records)
    return {
        "step_ms": seconds / plan.steps * 1e3,
        "worker_cpu_ms_per_step": cpu / plan.steps * 1e3,
    }


def fsdp_suite(plan: FsdpPlan) -> list[Row]:
    """One row per W: each backend's median step time and gradsync's ratio to gloo."""
    progress("fsdp: FSDP2 of a small transformer, gradsync vs gloo ...")
    rows = []
    for world_size in plan.worlds:
        runs: dict[str, list[dict[str, float]]] = {backend: [] for backend in BACKENDS}
        with tempfile.TemporaryDirectory() as scratch:
            for _ in range(plan.reps):
                for backend in BACKENDS:  # A B A B
                    runs[backend].append(run_once(world_size, backend, plan, Path(scratch)))
                    progress(f"fsdp W={world_size} {backend}: {runs[backend][-1]}")
        row: Row = {
            "world_size": world_size,
            "steps": plan.steps,
            "reps": plan.reps,
            "load_1min": os.getloadavg()[0],
        }
        for backend, results in runs.items():
            row[backend] = {
                key: statistics.median(r[key] for r in results) for key in results[0]
            } | {"step_ms_all": [r["step_ms"] for r in results]}
        row["gradsync_step_time_over_gloo"] = row["gradsync"]["step_ms"] / row["gloo"]["step_ms"]
        rows.append(row)
    return rows


def markdown_lines(rows: Sequence[Row]) -> list[str]:
    """The table: step time of each backend, their ratio, worker CPU per step."""
    lines = [
        "| W | gloo ms/step | gradsync ms/step | gradsync / gloo (time) "
        "| worker CPU ms/step, gradsync / gloo | runs (ms/step), gloo; gradsync |",
        "|---|---|---|---|---|---|",
    ]
    for row in rows:
        gloo, ours = row["gloo"], row["gradsync"]
        lines.append(
            f"| {row['world_size']} | {gloo['step_ms']:.1f} | {ours['step_ms']:.1f} "
            f"| {row['gradsync_step_time_over_gloo']:.2f} "
            f"| {ours['worker_cpu_ms_per_step']:.1f} / {gloo['worker_cpu_ms_per_step']:.1f} "
            f"| {', '.join(f'{v:.1f}' for v in gloo['step_ms_all'])}; "
            f"{', '.join(f'{v:.1f}' for v in ours['step_ms_all'])} |"
        )
    return lines


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worlds", default="2,4", help="comma-separated world sizes")
    parser.add_argument("--steps", type=int, default=FsdpPlan.steps)
    parser.add_argument("--reps", type=int, default=FsdpPlan.reps)
    parser.add_argument("--out", type=Path, help="where to write the rows as JSON")
    args = parser.parse_args(argv)
    plan = FsdpPlan(
        worlds=tuple(int(w) for w in args.worlds.split(",")), steps=args.steps, reps=args.reps
    )
    rows = fsdp_suite(plan)
    if args.out is not None:
        result = {
            "command": command_line(),
            "commit": commit(),
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "rows": rows,
        }
        args.out.write_text(json.dumps(result, indent=1))
    print("\n".join(markdown_lines(rows)))


if __name__ == "__main__":
    main()
