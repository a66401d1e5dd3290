"""`gradsync bench`: run the suites, then write JSON, a Markdown table and a plot.

Outputs go to `bench/results/` by default: `latest.json` (schema in
bench/README.md), `latest.md` and `latest.png`.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from gradsync.bench import suites


@dataclass(frozen=True)
class BenchPlan:
    """What to run; `quick()` and `full()` are the two presets."""

    sizes_mb: list[float] = field(default_factory=lambda: [1.0, 25.0, 100.0])
    worlds: list[int] = field(default_factory=lambda: [2, 4])
    reps: int = 5
    train_worlds: list[int] = field(default_factory=lambda: [2, 4])
    train_model_mb: float = 32.0
    train_steps: int = 20
    netns_worlds: list[int] = field(default_factory=lambda: [2, 3])
    netns_sizes_mb: list[float] = field(default_factory=lambda: [25.0])
    netns_reps: int = 3
    netns_rate_mbit: float = 1000.0
    suites: tuple[str, ...] = ("loopback", "train", "netns")

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
            netns_sizes_mb=[25.0],
            netns_reps=2,
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
        "plan": asdict(plan),
        "suites": {},
        "skipped": {},
    }
    if "loopback" in plan.suites:
        print("loopback sync: gradsync vs gloo ...", file=sys.stderr, flush=True)
        document["suites"]["loopback"] = suites.loopback_suite(
            plan.sizes_mb, plan.worlds, plan.reps
        )
    if "train" in plan.suites:
        print("end-to-end training: gradsync vs torchrun + DDP ...", file=sys.stderr, flush=True)
        document["suites"]["train"] = suites.train_suite(
            plan.train_worlds, plan.train_model_mb, plan.train_steps
        )
    if "netns" in plan.suites:
        print("emulated cluster (network namespaces) ...", file=sys.stderr, flush=True)
        rows, reason = suites.netns_suite(
            plan.netns_worlds, plan.netns_sizes_mb, plan.netns_reps, plan.netns_rate_mbit
        )
        document["suites"]["netns"] = rows
        if reason:
            document["skipped"]["netns"] = reason
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


def markdown(document: dict[str, Any]) -> str:
    """The human-readable table of a result document."""
    m = document["machine"]
    lines = [
        f"Measured {document['started_at']} on {m['cores']} cores ({m['cpu_model']}), "
        f"torch {m['torch']}, grpcio {m['grpcio']}; run took {document['duration_s']:.0f} s.",
        "",
    ]
    loopback = document["suites"].get("loopback", [])
    if loopback:
        lines += _table(
            "**Sync micro-benchmark, loopback** (one sync of N MB; median of A B A B reps)",
            "W | N MB | gradsync ms | gloo ms | gradsync MB/s | gloo MB/s | ratio | "
            "gradsync CPU-s/GB | gloo CPU-s/GB",
            [
                [
                    f"{r['world_size']}",
                    f"{r['megabytes']:g}",
                    f"{r['gradsync']['median_ms']:.1f}",
                    f"{r['gloo']['median_ms']:.1f}",
                    f"{r['gradsync']['algbw_mb_s']:.0f}",
                    f"{r['gloo']['algbw_mb_s']:.0f}",
                    f"{r['bandwidth_ratio']:.2f}",
                    f"{r['gradsync']['cpu_s_per_gb']:.2f}",
                    f"{r['gloo']['cpu_s_per_gb']:.2f}",
                ]
                for r in loopback
            ],
        )
    train = document["suites"].get("train", [])
    if train:
        lines += _table(
            "**End-to-end training, loopback** (samples/s; MLP, fp32)",
            "W | model MB | local | gradsync | gradsync, no overlap | torchrun DDP | "
            "ratio to DDP | exposed comm ms (gradsync / DDP) | overlap gain",
            [
                [
                    f"{r['world_size']}",
                    f"{r['model_mb']:g}",
                    *(f"{r['samples_per_s'][mode]:.0f}" for mode in suites.TRAIN_MODES),
                    f"{r['ratio_to_ddp']:.2f}",
                    f"{r['exposed_comm_ms']:.0f} / {r['ddp_exposed_comm_ms']:.0f}",
                    f"{r['overlap_gain']:.2f}x",
                ]
                for r in train
            ],
        )
    netns = document["suites"].get("netns", [])
    if netns:
        lines += _table(
            "**Emulated cluster** (network namespaces, every host link shaped to B; "
            "time against the analytic bound)",
            "W | N MB | B Mbit/s | gloo ms (bound) | gloo of bound | gradsync ms (bound) | "
            "gradsync of bound | CPU use gloo / gradsync",
            [
                [
                    f"{r['world_size']}",
                    f"{r['megabytes']:g}",
                    f"{r['rate_mbit']:g}",
                    f"{r['gloo']['median_ms']:.0f} ({r['gloo_bound_ms']:.0f})",
                    f"{r['gloo_of_bound']:.0%}",
                    f"{r['gradsync']['median_ms']:.0f} ({r['gradsync_bound_ms']:.0f})",
                    f"{r['gradsync_of_bound']:.0%}",
                    f"{r['gloo']['cpu_utilisation']:.0%} / {r['gradsync']['cpu_utilisation']:.0%}",
                ]
                for r in netns
            ],
        )
    for suite, reason in document.get("skipped", {}).items():
        lines.append(f"Suite {suite} skipped: {reason}")
    return "\n".join(lines) + "\n"


def plot(document: dict[str, Any], path: Path) -> None:
    """Bar charts: sync bandwidth per (W, N) and training samples/s per mode."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    loopback = document["suites"].get("loopback", [])
    train = document["suites"].get("train", [])
    figure, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    labels = [f"W={r['world_size']}\n{r['megabytes']:g} MB" for r in loopback]
    positions = range(len(loopback))
    axes[0].bar(
        [p - 0.2 for p in positions],
        [r["gradsync"]["algbw_mb_s"] for r in loopback],
        0.4,
        label="gradsync",
    )
    axes[0].bar(
        [p + 0.2 for p in positions],
        [r["gloo"]["algbw_mb_s"] for r in loopback],
        0.4,
        label="gloo all_reduce",
    )
    axes[0].set_xticks(list(positions), labels)
    axes[0].set_ylabel("algorithm bandwidth, MB/s")
    axes[0].set_title("one sync on loopback")
    axes[0].legend()
    modes = ["local", "gradsync", "sequential", "ddp"]
    names = ["local (no comm)", "gradsync", "gradsync, no overlap", "torchrun DDP"]
    width = 0.8 / len(modes)
    for index, (mode, name) in enumerate(zip(modes, names, strict=True)):
        axes[1].bar(
            [w + index * width for w in range(len(train))],
            [r["samples_per_s"][mode] for r in train],
            width,
            label=name,
        )
    axes[1].set_xticks(
        [w + 0.3 for w in range(len(train))], [f"W={r['world_size']}" for r in train]
    )
    axes[1].set_ylabel("samples/s")
    axes[1].set_title("end-to-end training")
    axes[1].legend()
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


def write(document: dict[str, Any], out_dir: Path) -> None:
    """Write latest.json, latest.md and latest.png into `out_dir`."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "latest.json").write_text(json.dumps(document, indent=2) + "\n")
    (out_dir / "latest.md").write_text(markdown(document))
    plot(document, out_dir / "latest.png")
