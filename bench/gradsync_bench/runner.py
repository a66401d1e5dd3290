"""`gradsync bench`: run the suites, then write JSON, a Markdown table and a plot.

Outputs go to `bench/results/` by default: `latest.json` (schema in
bench/README.md), `latest.md` and `latest.png`.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from gradsync_bench import (
    churn,
    churn_report,
    heal,
    latency,
    netns_hosts,
    plots,
    provenance,
    sharded,
    suites,
    wan,
    wan_report,
    wan_worker,
    wire_report,
)
from gradsync_bench.procs import progress


@dataclass(frozen=True)
class BenchPlan:
    """What to run; `quick()` and `full()` are the two presets."""

    sizes_mb: list[float] = field(default_factory=lambda: [1.0, 25.0, 100.0])
    worlds: list[int] = field(default_factory=lambda: [2, 4])
    reps: int = 5
    #: Loopback rows per coordinator: 1 = one process, S > 1 = `serve --shards S`.
    loopback_shards: list[int] = field(default_factory=lambda: [1])
    train_worlds: list[int] = field(default_factory=lambda: [2, 4])
    train_model_mb: float = 32.0
    train_steps: int = 20
    netns_worlds: list[int] = field(default_factory=lambda: [2, 3, 4, 8])
    netns_sizes_mb: list[float] = field(default_factory=lambda: [16.0, 64.0])
    netns_reps: int = 3
    #: Low enough that two cores keep up with every process of the largest layout, so the
    #: links, not the CPU, bound the times (gloo within 10 % of its ring bound).
    netns_rate_mbit: float = 200.0
    netns_layouts: tuple[str, ...] = sharded.LAYOUTS
    #: Shard counts of the dedicated and colocated layouts; empty = S = W.
    netns_shards: list[int] = field(default_factory=list)
    #: 16-bit wires timed in every netns row besides fp32 ("bf16", "fp16"), with torch DDP's
    #: bf16 hook over gloo as their reference (`gradsync_bench.wire_report`); () = none.
    netns_wires: tuple[str, ...] = ()
    #: Hierarchical aggregation rows: a hierarchical gradsync job beside the flat one in the
    #: loopback rows (S = 1) and the train rows, and (with the single layout) the netns
    #: suite's H hosts x R ranks rows.
    hierarchy: bool = True
    netns_hosts: int = 2
    netns_ranks_per_host: int = 2
    suites: tuple[str, ...] = ("loopback", "train", "netns", "latency")
    latency: latency.LatencyPlan = field(default_factory=latency.LatencyPlan)
    #: The wan suite (the slow-link scorecard, `gradsync_bench.wan`); not run by default.
    wan_world: int = 4
    wan_rates_mbit: list[float] = field(default_factory=lambda: [100.0, 20.0])
    #: One-way delay per link (ms) for each of wan_rates_mbit (0: none); empty: no delay.
    wan_delays_ms: list[float] = field(default_factory=list)
    wan_methods: tuple[str, ...] = tuple(wan_worker.METHODS)
    wan_steps: int = 50
    wan_sync_steps: int = 6
    wan_quality_steps: int = 100
    #: The wan suite's hub pass: [workers' Mbit/s, one-way ms per link, coordinator host's
    #: Mbit/s]; empty: none.
    wan_hub: list[float] = field(default_factory=list)
    #: The heal suite (`gradsync_bench.heal`, a restarted rank healed; not run by default).
    heal_worlds: list[int] = field(default_factory=lambda: [2, 4])
    heal_states_mb: list[float] = field(default_factory=lambda: [256.0, 1024.0])
    #: The churn suite (`gradsync_bench.churn`, two runs of churn.duration_s); on request.
    churn: churn.ChurnPlan = field(default_factory=churn.ChurnPlan)

    def wan_plan(self) -> wan.WanPlan:
        """The wan suite's own plan."""
        return wan.WanPlan(
            world_size=self.wan_world,
            rates_mbit=tuple(self.wan_rates_mbit),
            delays_ms=tuple(self.wan_delays_ms),
            methods=tuple(self.wan_methods),
            steps=self.wan_steps,
            sync_steps=self.wan_sync_steps,
            quality_steps=self.wan_quality_steps,
            hub_link=wan.hub_link(self.wan_hub),
        )

    @classmethod
    def quick(cls) -> BenchPlan:
        """Under two minutes here: one world size, small sizes, few repetitions."""
        return cls(
            sizes_mb=[1.0, 25.0],
            worlds=[2],
            reps=3,
            train_worlds=[2],
            train_steps=5,
            netns_worlds=[2],
            netns_sizes_mb=[16.0],
            netns_reps=2,
            netns_layouts=("single",),
            hierarchy=False,
            heal_worlds=[2],
            heal_states_mb=[256.0],
            latency=latency.LatencyPlan(worlds=(2,), steps=50, reps=1),
        )


def machine() -> dict[str, Any]:
    """What the numbers were measured on."""
    import grpc
    import numpy
    import torch

    model = "unknown"
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    return {
        "cores": os.cpu_count(),
        "cpu_model": model,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "grpcio": grpc.__version__,
        "numpy": numpy.__version__,
    }


def run(plan: BenchPlan) -> dict[str, Any]:
    """Run the planned suites; return the full result document."""
    started = datetime.datetime.now(datetime.UTC)
    document: dict[str, Any] = {
        "schema_version": 1,
        "started_at": started.isoformat(timespec="seconds"),
        "machine": machine(),
        # The code and the flags that made the numbers.
        "commit": provenance.commit(),
        "command": provenance.command_line(),
        "plan": asdict(plan),
        "suites": {},
        "skipped": {},
    }
    if "loopback" in plan.suites:
        progress("loopback sync: gradsync vs gloo ...")
        document["suites"]["loopback"] = suites.loopback_suite(
            plan.sizes_mb, plan.worlds, plan.reps, plan.loopback_shards, plan.hierarchy
        )
    if "train" in plan.suites:
        progress("end-to-end training: gradsync vs torchrun + DDP ...")
        document["suites"]["train"] = suites.train_suite(
            plan.train_worlds, plan.train_model_mb, plan.train_steps, plan.hierarchy
        )
    if "netns" in plan.suites:
        progress("emulated cluster (network namespaces) ...")
        rows, reason = sharded.netns_suite(
            plan.netns_worlds,
            plan.netns_sizes_mb,
            plan.netns_reps,
            plan.netns_rate_mbit,
            plan.netns_layouts,
            plan.netns_shards,
            plan.netns_wires,
        )
        document["suites"]["netns"] = rows
        if reason:
            document["skipped"]["netns"] = reason
        # Its coordinator is one host, like the single layout's: it goes with that layout.
        if plan.hierarchy and "single" in plan.netns_layouts:
            rows, reason = netns_hosts.hierarchy_suite(
                plan.netns_sizes_mb,
                plan.netns_reps,
                plan.netns_rate_mbit,
                plan.netns_hosts,
                plan.netns_ranks_per_host,
            )
            document["suites"]["netns_hierarchy"] = rows
            if reason:
                document["skipped"]["netns_hierarchy"] = reason
    if "wan" in plan.suites:
        progress("slow-link scorecard (network namespaces) ...")
        document["suites"]["wan"], reason = wan.wan_suite(plan.wan_plan())
        if reason:
            document["skipped"]["wan"] = reason
    if "latency" in plan.suites:  # (it announces itself on stderr)
        document["suites"]["latency"] = latency.latency_suite(plan.latency)
    if "heal" in plan.suites:
        progress("healing a restarted rank ...")
        document["suites"]["heal"] = heal.heal_suite(plan.heal_worlds, plan.heal_states_mb)
    if "churn" in plan.suites:
        progress("churn soak: failures every interval ...")
        document["suites"]["churn"] = churn.churn_suite(plan.churn)
    finished = datetime.datetime.now(datetime.UTC)
    document["duration_s"] = (finished - started).total_seconds()
    return document


def _table(title: str, header: str, rows: Sequence[Sequence[str]]) -> list[str]:
    """A titled Markdown table (and the blank lines around it) as lines.

    `header` is the column titles joined by " | "; each row has one cell per column.
    """
    columns = len(header.split(" | "))
    assert all(len(row) == columns for row in rows), "a row's cells do not match the header"
    return [
        title,
        "",
        f"| {header} |",
        "|" + "---|" * columns,
        *("| " + " | ".join(row) + " |" for row in rows),
        "",
    ]


def _cpu_s(stats: dict[str, float]) -> str:
    """CPU-seconds per sync of all processes; "-" for documents older than that field."""
    return f"{stats['cpu_s_per_sync']:.2f}" if "cpu_s_per_sync" in stats else "-"


def _server_cores(stats: dict[str, float]) -> str:
    """The coordinator processes' cores in use, e.g. "1.31 (0.72)"; "-" for old documents."""
    if "server_cores" not in stats:
        return "-"
    return f"{stats['server_cores']:.2f} ({stats['busiest_server_cores']:.2f})"


def markdown(document: dict[str, Any]) -> str:
    """The human-readable table of a result document."""
    m = document["machine"]
    lines = [
        f"Measured {document['started_at']} on {m['cores']} cores ({m['cpu_model']}), "
        f"torch {m['torch']}, grpcio {m['grpcio']}; run took {document['duration_s']:.0f} s.",
        "",
    ]
    if "commit" in document:  # (older documents do not record them)
        lines[-1:] = [
            f"Commit {document['commit']}; command: `{document['command']}`.",
            "",
        ]
    loopback = document["suites"].get("loopback", [])
    if loopback:
        lines += _table(
            "**Sync micro-benchmark, loopback** (one sync of N MB; median of A B A B reps)",
            "W | S | N MB | gradsync ms | gloo ms | gradsync MB/s | gloo MB/s | ratio | "
            "gradsync CPU-s/GB | gloo CPU-s/GB | coordinator cores (busiest process) | "
            "hierarchical ms | hierarchical MB/s | ratio | hierarchical CPU-s/GB | "
            "forward + backward alone ms | torch DDP ms | hierarchical speed / DDP",
            [
                [
                    f"{r['world_size']}",
                    f"{r.get('shards', 1)}",
                    f"{r['megabytes']:g}",
                    f"{r['gradsync']['median_ms']:.1f}",
                    f"{r['gloo']['median_ms']:.1f}",
                    f"{r['gradsync']['algbw_mb_s']:.0f}",
                    f"{r['gloo']['algbw_mb_s']:.0f}",
                    f"{r['bandwidth_ratio']:.2f}",
                    f"{r['gradsync']['cpu_s_per_gb']:.2f}",
                    f"{r['gloo']['cpu_s_per_gb']:.2f}",
                    _server_cores(r["gradsync"]),
                    *_hierarchical_cells(r),
                    *_like_for_like_cells(r),
                ]
                for r in loopback
            ],
        )
    train = document["suites"].get("train", [])
    if train:
        lines += _table(
            "**End-to-end training, loopback** (samples/s; MLP, fp32)",
            "W | model MB | local | gradsync | gradsync, no overlap | torchrun DDP | "
            "ratio to DDP | exposed comm ms (gradsync / DDP) | overlap gain | "
            "gradsync hierarchical | ratio to DDP | stock DDP over gradsync | "
            "ratio to gradsync",
            [
                [
                    f"{r['world_size']}",
                    f"{r['model_mb']:g}",
                    *(f"{r['samples_per_s'][mode]:.0f}" for mode in suites.TRAIN_MODES),
                    f"{r['ratio_to_ddp']:.2f}",
                    f"{r['exposed_comm_ms']:.0f} / {r['ddp_exposed_comm_ms']:.0f}",
                    f"{r['overlap_gain']:.2f}x",
                    *(
                        (
                            f"{r['samples_per_s'][suites.HIERARCHICAL]:.0f}",
                            f"{r['hierarchical_ratio_to_ddp']:.2f}",
                        )
                        if suites.HIERARCHICAL in r["samples_per_s"]
                        else ("-", "-")
                    ),
                    *(
                        (
                            f"{r['samples_per_s'][suites.BACKEND]:.0f}",
                            f"{r['backend_ratio_to_gradsync']:.2f}",
                        )
                        if suites.BACKEND in r["samples_per_s"]
                        else ("-", "-")
                    ),
                ]
                for r in train
            ],
        )
    netns = document["suites"].get("netns", [])
    if netns:
        lines += _table(
            "**Emulated cluster** (network namespaces, every host link shaped to B; each time "
            "against its analytic bound: gloo 2(W-1)/W·N/B, single W·N/B, dedicated "
            "max(1, W/S)·N/B, colocated max(1, (W+S-2)/S)·N/B; of bound = bound / time)",
            "layout | W | S | N MB | B Mbit/s | gradsync ms (bound) | of bound | "
            "gloo ms (bound) | of bound | gradsync / gloo | CPU-s per sync gradsync / gloo | "
            "CPU use gradsync / gloo | coordinator cores (busiest process)",
            [
                [
                    r.get("layout", "single"),
                    f"{r['world_size']}",
                    f"{r.get('shards', 1)}",
                    f"{r['megabytes']:g}",
                    f"{r['rate_mbit']:g}",
                    f"{r['gradsync']['median_ms']:.0f} ({r['gradsync_bound_ms']:.0f})",
                    f"{r['gradsync_of_bound']:.0%}",
                    f"{r['gloo']['median_ms']:.0f} ({r['gloo_bound_ms']:.0f})",
                    f"{r['gloo_of_bound']:.0%}",
                    f"{r['gradsync']['median_ms'] / r['gloo']['median_ms']:.2f}",
                    f"{_cpu_s(r['gradsync'])} / {_cpu_s(r['gloo'])}",
                    f"{r['gradsync']['cpu_utilisation']:.0%} / {r['gloo']['cpu_utilisation']:.0%}",
                    _server_cores(r["gradsync"]),
                ]
                for r in netns
            ],
        )
    lines += wire_report.markdown_lines(netns)
    lines += _hierarchy_table(document["suites"].get("netns_hierarchy", []))
    lines += wan_report.markdown_lines(document["suites"].get("wan", {}))
    lines += latency.markdown_lines(document["suites"].get("latency", []))
    lines += heal.markdown_lines(document["suites"].get("heal", []))
    lines += churn_report.markdown_lines(document["suites"].get("churn", {}))
    for suite, reason in document.get("skipped", {}).items():
        lines.append(f"Suite {suite} skipped: {reason}")
    return "\n".join(lines) + "\n"


def _hierarchical_cells(row: dict[str, Any]) -> list[str]:
    """A loopback row's hierarchical columns ("-" where it has none)."""
    stats = row.get(suites.HIERARCHICAL)
    if stats is None:
        return ["-"] * 4
    return [
        f"{stats['median_ms']:.1f}",
        f"{stats['algbw_mb_s']:.0f}",
        f"{row['hierarchical_bandwidth_ratio']:.2f}",
        f"{stats['cpu_s_per_gb']:.2f}",
    ]


def _mb_per_host(row: dict[str, Any], method: str) -> str:
    """Up / down MB per sync of the busiest host link, e.g. "16.8 / 16.8"."""
    hosts = row["link_bytes"][method].values()
    up = max(h["tx"] for h in hosts) / 1e6
    down = max(h["rx"] for h in hosts) / 1e6
    return f"{up:.1f} / {down:.1f}"


def _hierarchy_table(rows: list[dict[str, Any]]) -> list[str]:
    """The netns hierarchy rows: times against bounds and bytes per host link."""
    if not rows:
        return []
    return _table(
        "**Emulated hosts of several ranks** (network namespaces, links shaped to B; H hosts x "
        "R ranks; bounds: flat W·N/B, hierarchical H·N/B (one contribution per host), gloo "
        "2(W-1)/W·N/B; host link MB per sync, up / down, busiest host)",
        "H x R | N MB | B Mbit/s | flat ms (bound) | hierarchical ms (bound) | of bound | "
        "gloo ms (bound) | hierarchical / flat time | flat MB/host | hierarchical MB/host | "
        "gloo MB/host | hierarchical / flat bytes",
        [
            [
                f"{r['hosts']} x {r['ranks_per_host']}",
                f"{r['megabytes']:g}",
                f"{r['rate_mbit']:g}",
                f"{r['gradsync']['median_ms']:.0f} ({r['gradsync_bound_ms']:.0f})",
                f"{r['hierarchical']['median_ms']:.0f} ({r['hierarchical_bound_ms']:.0f})",
                f"{r['hierarchical_of_bound']:.0%}",
                f"{r['gloo']['median_ms']:.0f} ({r['gloo_bound_ms']:.0f})",
                f"{r['hierarchical_to_flat_time']:.2f}",
                _mb_per_host(r, "gradsync"),
                _mb_per_host(r, "hierarchical"),
                _mb_per_host(r, "gloo"),
                f"{r['hierarchical_to_flat_bytes']:.2f}",
            ]
            for r in rows
        ],
    )


def write(document: dict[str, Any], out_dir: Path) -> None:
    """Write latest.json, latest.md and latest.png into `out_dir`."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "latest.json").write_text(json.dumps(document, indent=2) + "\n")
    (out_dir / "latest.md").write_text(markdown(document))
    rows = document["suites"]
    wan_ran = bool(rows.get("wan", {}).get("rows"))
    others = any(rows.get(name) for name in ("loopback", "train", "netns"))
    if others or not (wan_ran or "churn" in rows or "latency" in rows):
        plots.plot(document, out_dir / "latest.png")
    if wan_ran:
        # Alone, the wan suite's figure is latest.png; beside the others, latest-wan.png.
        wan_report.plot(rows["wan"], out_dir / ("latest-wan.png" if others else "latest.png"))


def _like_for_like_cells(row: dict[str, Any]) -> list[str]:
    """A loopback row's forward + backward alone, torch DDP's time for the same forward,
    backward and sync, and the hierarchical sync's speed against it ("-" where absent)."""
    local, ddp = row.get(wire_report.LOCAL), row.get(wire_report.DDP_FP32)
    ratio = row.get("hierarchical_to_ddp")
    return [
        "-" if local is None else f"{local['median_ms']:.1f}",
        "-" if ddp is None else f"{ddp['median_ms']:.1f}",
        "-" if ratio is None else f"{ratio:.2f}",
    ]
