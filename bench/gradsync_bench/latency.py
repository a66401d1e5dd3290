"""The latency suite: steps/s of a tiny model, where every step is fixed per-step cost.

With small gradients a star (two hops per step) should beat a ring (2(W-1)
hops) by a wide margin, unless per-step fixed costs eat the lead. Per world size W
(default 2, 8, 16, all ranks on this host), each mode of `gradsync_bench.latency_worker`
(gradsync flat, gradsync default layout, torch DDP over gloo, and the same stock
DDP over the c10d backend "gradsync") trains the same
`Linear(256, 256)` with the same seeds; the modes alternate A B C A B C for `reps`
rounds and the median steps/s of each is kept, with each worker's CPU time per step
(all its threads; the mean over ranks), which a loaded machine stretches less than
the wall time. Each gradsync run gets a fresh
coordinator, whose CPU time over the timed steps is read by rank 0 (from /proc, at its
clock's start and end: the coordinator's start and the joins are not in it), and whose
RSS and peak RSS (VmRSS / VmHWM from /proc) are read when its workers are done.
"""

from __future__ import annotations

import os
import statistics
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gradsync_proto.net.frame_stream import frames_enabled
from gradsync_proto.net.launch import local_launch, start_coordinator

from gradsync_bench.latency_worker import MODES
from gradsync_bench.procs import flag_args, proc_status, progress, run_module_ranks, stop_process
from gradsync_bench.tables import rows_table

Row = dict[str, Any]


def num(values: dict[str, float], key: str, digits: int = 1) -> str:
    """`values[key]` with `digits` decimals, "-" when missing."""
    return f"{values[key]:.{digits}f}" if key in values else "-"


#: The targets, flat gradsync over gloo DDP steps/s, by W.
TARGETS = {16: 3.0, 8: 2.0}


@dataclass(frozen=True)
class LatencyPlan:
    """What the latency suite runs (`BenchPlan.latency`; `--worlds`, `--reps` and
    `--train-steps` override it)."""

    worlds: tuple[int, ...] = (2, 8, 16)
    modes: tuple[str, ...] = MODES
    steps: int = 150
    warmup: int = 10
    reps: int = 2
    #: Bound on one run of W workers (start, join, warmup, timed steps).
    run_timeout_s: float = 300.0
    extra_env: dict[str, str] = field(default_factory=dict)


def run_once(world_size: int, mode: str, plan: LatencyPlan, workdir: Path) -> dict[str, float]:
    """One run of `mode` at `world_size`: steps/s (slowest rank), coordinator CPU and RSS."""
    env = dict(os.environ, **plan.extra_env)
    coordinator = None
    if mode != "ddp":
        coordinator, port = start_coordinator(world_size, launch=local_launch)
        env["GRADSYNC_COORDINATOR"] = f"127.0.0.1:{port}"
    out = workdir / f"{mode}-w{world_size}"
    try:
        records = run_module_ranks(
            "gradsync_bench.latency_worker",
            world_size,
            out,
            flag_args(
                mode=mode,
                steps=plan.steps,
                warmup=plan.warmup,
                job_id=f"latency-{mode}",
                coordinator_pid=coordinator.pid if coordinator is not None else 0,
            ),
            env,
            timeout_s=plan.run_timeout_s,
            what=f"latency {mode} W={world_size}",
            # Sixteen pipes read one after the other could fill and block: files instead.
            stderr_path=lambda rank: out.with_name(f"{out.name}-{rank}.err"),
        )
        result: dict[str, float] = {}
        if coordinator is not None:
            memory = proc_status(coordinator.pid)
            result["coordinator_rss_mib"] = memory.get("VmRSS", 0) / 1024
            result["coordinator_peak_rss_mib"] = memory.get("VmHWM", 0) / 1024
    finally:
        if coordinator is not None:
            stop_process(coordinator)
    seconds = max(record["seconds"] for record in records)
    result["steps_per_s"] = plan.steps / seconds
    result["step_ms"] = seconds / plan.steps * 1e3
    cpu = statistics.mean(record["cpu_s"] for record in records)
    result["worker_cpu_ms_per_step"] = cpu / plan.steps * 1e3
    if "coordinator_cpu_s" in records[0]:
        result["coordinator_cpu_ms_per_step"] = records[0]["coordinator_cpu_s"] / plan.steps * 1e3
    return result


def latency_suite(plan: LatencyPlan) -> list[Row]:
    """The suite's rows: one per W, every mode's median and its ratio to gloo DDP."""
    progress("latency: a tiny model, gradsync vs gloo DDP ...")
    rows = []
    for world_size in plan.worlds:
        runs: dict[str, list[dict[str, float]]] = {mode: [] for mode in plan.modes}
        with tempfile.TemporaryDirectory() as scratch:
            for _ in range(plan.reps):
                for mode in plan.modes:
                    runs[mode].append(run_once(world_size, mode, plan, Path(scratch)))
        row: Row = {
            "world_size": world_size,
            "steps": plan.steps,
            "reps": plan.reps,
            "load_1min": os.getloadavg()[0],
            # Workers' Sync streams on the frame port (the default) or on gRPC (GRADSYNC_FRAMES=0).
            "pipe": "frames" if frames_enabled() else "grpc",
        }
        for mode, results in runs.items():
            row[mode] = {key: statistics.median(r[key] for r in results) for key in results[0]} | {
                "steps_per_s_all": [r["steps_per_s"] for r in results]
            }
        if "ddp" in runs:
            for mode in runs:
                if mode != "ddp":
                    row[f"{mode}_ratio_to_ddp"] = (
                        row[mode]["steps_per_s"] / row["ddp"]["steps_per_s"]
                    )
        if "ddp-backend" in runs and "flat" in runs:
            row["ddp-backend_ratio_to_flat"] = (
                row["ddp-backend"]["steps_per_s"] / row["flat"]["steps_per_s"]
            )
        rows.append(row)
    return rows


def _pipe_words(row: Row) -> str:
    if row.get("pipe", "grpc") == "frames":
        return "the coordinator's frame port, the default"
    return "gRPC (GRADSYNC_FRAMES=0, or before the frame port)"


def markdown_lines(rows: Sequence[Row]) -> list[str]:
    """The suite's table (steps/s, ratio to gloo DDP, coordinator RSS and CPU per step)."""
    if not rows:
        return []
    title = (
        "**Latency: a tiny model** (one Linear(256, 256), SGD, batch 32, all ranks on this "
        "host; steps/s of the slowest rank, median of the reps; flat = hierarchical=False, "
        'default = hierarchical="auto"; coordinator CPU over the timed steps of rank 0; '
        f"workers' Sync streams on {_pipe_words(rows[0])})"
    )
    header = (
        "W | gloo DDP steps/s | flat steps/s | flat / DDP | target | default steps/s "
        "| default / DDP | coordinator RSS MiB (peak), flat / default "
        "| coordinator CPU ms/step, flat / default | worker CPU ms/step, flat / default / DDP"
    )
    cells = (
        "{world_size} | {ddp[steps_per_s]:.1f} | {flat[steps_per_s]:.1f} | "
        "{flat_ratio_to_ddp:.2f} | {target} | {default[steps_per_s]:.1f} | "
        "{default_ratio_to_ddp:.2f} | {flat[coordinator_rss_mib]:.0f} "
        "({flat[coordinator_peak_rss_mib]:.0f}) / {default[coordinator_rss_mib]:.0f} "
        "({default[coordinator_peak_rss_mib]:.0f}) | {flat[coordinator_cpu_ms_per_step]:.2f} / "
        "{default[coordinator_cpu_ms_per_step]:.2f} | {flat[worker_cpu_ms_per_step]:.2f} / "
        "{default[worker_cpu_ms_per_step]:.2f} / {ddp[worker_cpu_ms_per_step]:.2f}"
    )
    with_targets = [
        {**r, "target": f">= {TARGETS[r['world_size']]:g}"} if r["world_size"] in TARGETS else r
        for r in rows
    ]
    return [*rows_table(title, header, cells, with_targets), *_backend_lines(rows)]


def _backend_lines(rows: Sequence[Row]) -> list[str]:
    """Stock DDP over the c10d backend "gradsync" against the wrapper and gloo DDP."""
    rows = [row for row in rows if "ddp-backend" in row]
    if not rows:
        return []
    lines = [
        '**Stock DDP over the "gradsync" backend** (same model and runs as above; '
        "steps/s of the slowest rank, median of the reps)",
        "",
        "| W | stock DDP over gradsync steps/s | / flat wrapper | / gloo DDP "
        "| worker CPU ms/step, backend / flat / gloo DDP |",
        "|---|---|---|---|---|",
    ]
    for row in rows:
        backend, flat, ddp = row["ddp-backend"], row.get("flat", {}), row.get("ddp", {})

        def ratio(key: str, row: Row = row) -> str:
            return f"{row[key]:.2f}" if key in row else "-"

        lines.append(
            f"| {row['world_size']} | {num(backend, 'steps_per_s')} "
            f"| {ratio('ddp-backend_ratio_to_flat')} | {ratio('ddp-backend_ratio_to_ddp')} "
            f"| {num(backend, 'worker_cpu_ms_per_step', 2)} / "
            f"{num(flat, 'worker_cpu_ms_per_step', 2)} / {num(ddp, 'worker_cpu_ms_per_step', 2)} |"
        )
    return [*lines, ""]
