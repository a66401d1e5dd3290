"""`gradsync bench`: run the suites, then write JSON, a Markdown table and a plot.

Outputs go to `bench/results/` by default: `latest.json` (schema in
bench/README.md), `latest.md` and `latest.png`.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from gradsync_bench import (
    churn,
    churn_report,
    churn_torchft,
    heal,
    latency,
    netns_hosts,
    plots,
    provenance,
    sharded,
    suites,
    tables,
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
    if "churn-torchft" in plan.suites:
        progress("churn soak with torchft: the same failures ...")
        document["suites"]["churn_torchft"] = churn_torchft.churn_torchft_suite(plan.churn)
    finished = datetime.datetime.now(datetime.UTC)
    document["duration_s"] = (finished - started).total_seconds()
    return document


#: The loopback table: column titles and cells (`tables.cells`).
LOOPBACK = (
    "W | S | N MB | gradsync ms | gloo ms | gradsync MB/s | gloo MB/s | ratio | "
    "gradsync CPU-s/GB | gloo CPU-s/GB | coordinator cores (busiest process) | "
    "hierarchical ms | hierarchical MB/s | ratio | hierarchical CPU-s/GB | "
    "forward + backward alone ms | torch DDP ms | hierarchical speed / DDP",
    "{world_size} | {shards} | {megabytes:g} | {gradsync[median_ms]:.1f} | "
    "{gloo[median_ms]:.1f} | {gradsync[algbw_mb_s]:.0f} | {gloo[algbw_mb_s]:.0f} | "
    "{bandwidth_ratio:.2f} | {gradsync[cpu_s_per_gb]:.2f} | {gloo[cpu_s_per_gb]:.2f} | "
    "{gradsync[server_cores]:.2f} ({gradsync[busiest_server_cores]:.2f}) | "
    "{hierarchical[median_ms]:.1f} | {hierarchical[algbw_mb_s]:.0f} | "
    "{hierarchical_bandwidth_ratio:.2f} | {hierarchical[cpu_s_per_gb]:.2f} | "
    "{local[median_ms]:.1f} | {ddp[median_ms]:.1f} | {hierarchical_to_ddp:.2f}",
)
TRAIN = (
    "W | model MB | local | gradsync | gradsync, no overlap | torchrun DDP | "
    "ratio to DDP | exposed comm ms (gradsync / DDP) | overlap gain | "
    "gradsync hierarchical | ratio to DDP | stock DDP over gradsync | "
    "ratio to gradsync",
    "{world_size} | {model_mb:g} | {samples_per_s[local]:.0f} | "
    "{samples_per_s[gradsync]:.0f} | {samples_per_s[sequential]:.0f} | "
    "{samples_per_s[ddp]:.0f} | {ratio_to_ddp:.2f} | "
    "{exposed_comm_ms:.0f} / {ddp_exposed_comm_ms:.0f} | {overlap_gain:.2f}x | "
    "{samples_per_s[hierarchical]:.0f} | {hierarchical_ratio_to_ddp:.2f} | "
    "{samples_per_s[ddp-backend]:.0f} | {backend_ratio_to_gradsync:.2f}",
)
NETNS = (
    "layout | W | S | N MB | B Mbit/s | gradsync ms (bound) | of bound | "
    "gloo ms (bound) | of bound | gradsync / gloo | CPU-s per sync gradsync / gloo | "
    "CPU use gradsync / gloo | coordinator cores (busiest process)",
    "{layout} | {world_size} | {shards} | {megabytes:g} | {rate_mbit:g} | "
    "{gradsync[median_ms]:.0f} ({gradsync_bound_ms:.0f}) | {gradsync_of_bound:.0%} | "
    "{gloo[median_ms]:.0f} ({gloo_bound_ms:.0f}) | {gloo_of_bound:.0%} | "
    "{gradsync_to_gloo:.2f} | {gradsync[cpu_s_per_sync]:.2f} / {gloo[cpu_s_per_sync]:.2f} | "
    "{gradsync[cpu_utilisation]:.0%} / {gloo[cpu_utilisation]:.0%} | "
    "{gradsync[server_cores]:.2f} ({gradsync[busiest_server_cores]:.2f})",
)
HIERARCHY = (
    "H x R | N MB | B Mbit/s | flat ms (bound) | hierarchical ms (bound) | of bound | "
    "gloo ms (bound) | hierarchical / flat time | flat MB/host | hierarchical MB/host | "
    "gloo MB/host | hierarchical / flat bytes | stock DDP over gradsync ms | "
    "backend MB/host | backend / hierarchical wrapper (speed, same layout)",
    "{hosts} x {ranks_per_host} | {megabytes:g} | {rate_mbit:g} | "
    "{gradsync[median_ms]:.0f} ({gradsync_bound_ms:.0f}) | "
    "{hierarchical[median_ms]:.0f} ({hierarchical_bound_ms:.0f}) | "
    "{hierarchical_of_bound:.0%} | {gloo[median_ms]:.0f} ({gloo_bound_ms:.0f}) | "
    "{hierarchical_to_flat_time:.2f} | {per_host[gradsync]} | {per_host[hierarchical]} | "
    "{per_host[gloo]} | {hierarchical_to_flat_bytes:.2f} | {ddp-backend[median_ms]:.0f} | "
    "{per_host[ddp-backend]} | {backend_to_wrapper:.2f}",
)


def markdown(document: dict[str, Any]) -> str:
    """The human-readable table of a result document."""
    m, found = document["machine"], document["suites"]
    lines = [
        f"Measured {document['started_at']} on {m['cores']} cores ({m['cpu_model']}), "
        f"torch {m['torch']}, grpcio {m['grpcio']}; run took {document['duration_s']:.0f} s.",
    ]
    if "commit" in document:  # (a document made outside `run` may lack them)
        lines.append(f"Commit {document['commit']}; command: `{document['command']}`.")
    lines.append("")
    lines += tables.rows_table(
        "**Sync micro-benchmark, loopback** (one sync of N MB; median of A B A B reps)",
        *LOOPBACK,
        found.get("loopback", []),
    )
    lines += tables.rows_table(
        "**End-to-end training, loopback** (samples/s; MLP, fp32)", *TRAIN, found.get("train", [])
    )
    netns = found.get("netns", [])
    lines += tables.rows_table(
        "**Emulated cluster** (network namespaces, every host link shaped to B; each time "
        "against its analytic bound: gloo 2(W-1)/W·N/B, single W·N/B, dedicated "
        "max(1, W/S)·N/B, colocated max(1, (W+S-2)/S)·N/B; of bound = bound / time)",
        *NETNS,
        netns,
    )
    lines += wire_report.markdown_lines(netns)
    lines += tables.rows_table(
        "**Emulated hosts of several ranks** (network namespaces, links shaped to B; H hosts x "
        "R ranks; bounds: flat W·N/B, hierarchical H·N/B (one contribution per host), gloo "
        "2(W-1)/W·N/B; host link MB per sync, up / down, busiest host; stock DDP over the "
        'backend "gradsync" at its default layout, a host group per host)',
        *HIERARCHY,
        [r | {"per_host": _mb_per_host(r)} for r in found.get("netns_hierarchy", [])],
    )
    lines += wan_report.markdown_lines(found.get("wan", {}))
    lines += latency.markdown_lines(found.get("latency", []))
    lines += heal.markdown_lines(found.get("heal", []))
    lines += churn_report.markdown_lines(found.get("churn", {}))
    lines += churn_torchft.markdown_lines(found.get("churn_torchft", {}))
    lines += [f"Suite {suite} skipped: {why}" for suite, why in document.get("skipped", {}).items()]
    return "\n".join(lines) + "\n"


def _mb_per_host(row: dict[str, Any]) -> dict[str, str]:
    """Up / down MB per sync of the busiest host link per method, e.g. "16.8 / 16.8"."""
    found = {}
    for method, hosts in row["link_bytes"].items():
        up = max(h["tx"] for h in hosts.values()) / 1e6
        found[method] = f"{up:.1f} / {max(h['rx'] for h in hosts.values()) / 1e6:.1f}"
    return found


def write(document: dict[str, Any], out_dir: Path) -> None:
    """Write latest.json, latest.md and latest.png into `out_dir`."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "latest.json").write_text(json.dumps(document, indent=2) + "\n")
    (out_dir / "latest.md").write_text(markdown(document))
    rows = document["suites"]
    wan_ran = bool(rows.get("wan", {}).get("rows"))
    others = any(rows.get(name) for name in ("loopback", "train", "netns"))
    if others or not (wan_ran or "churn" in rows or "churn_torchft" in rows or "latency" in rows):
        plots.plot(document, out_dir / "latest.png")
    if wan_ran:
        # Alone, the wan suite's figure is latest.png; beside the others, latest-wan.png.
        wan_report.plot(rows["wan"], out_dir / ("latest-wan.png" if others else "latest.png"))
