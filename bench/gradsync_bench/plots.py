"""The figure of a bench run (latest.png): loopback, training and emulated-cluster panels.

Why a module of its own: drawing is the one part of a run that needs
matplotlib, and it is read apart from the tables (`gradsync_bench.runner`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


def plot(document: dict[str, Any], path: Path) -> None:
    """Bar charts: sync bandwidth per (W, N) and training samples/s per mode on top and,
    when the netns suite ran, one row per N with each emulated-cluster time against its
    bound; a suite that did not run gets no panel."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    loopback = document["suites"].get("loopback", [])
    train = document["suites"].get("train", [])
    netns = document["suites"].get("netns", [])
    sizes = sorted({r["megabytes"] for r in netns})
    top = 1 if loopback or train or not netns else 0
    width = max([12.0, *(0.9 * sum(r["megabytes"] == mb for r in netns) for mb in sizes)])
    figure = plt.figure(figsize=(width, 4.5 * (top + len(sizes))))
    grid = figure.add_gridspec(top + len(sizes), 2)
    if top:
        _plot_loopback(figure.add_subplot(grid[0, 0]), loopback)
        _plot_train(figure.add_subplot(grid[0, 1]), train)
    for index, megabytes in enumerate(sizes):
        axis = figure.add_subplot(grid[top + index, :])
        _plot_netns(axis, [r for r in netns if r["megabytes"] == megabytes])
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


def _plot_loopback(axis: Any, loopback: list[dict[str, Any]]) -> None:
    """Algorithm bandwidth of one sync per (W, S, N), gradsync beside gloo."""
    labels = [
        f"W={r['world_size']}"
        + (f" S={r['shards']}" if r.get("shards", 1) > 1 else "")
        + f"\n{r['megabytes']:g} MB"
        for r in loopback
    ]
    positions = range(len(loopback))
    axis.bar(
        [p - 0.2 for p in positions],
        [r["gradsync"]["algbw_mb_s"] for r in loopback],
        0.4,
        label="gradsync",
    )
    axis.bar(
        [p + 0.2 for p in positions],
        [r["gloo"]["algbw_mb_s"] for r in loopback],
        0.4,
        label="gloo all_reduce",
    )
    axis.set_xticks(list(positions), labels)
    axis.set_ylabel("algorithm bandwidth, MB/s")
    axis.set_title("one sync on loopback")
    axis.legend()


def _plot_train(axis: Any, train: list[dict[str, Any]]) -> None:
    """Training samples/s per W, one bar per mode."""
    modes = ["local", "gradsync", "sequential", "ddp"]
    names = ["local (no comm)", "gradsync", "gradsync, no overlap", "torchrun DDP"]
    width = 0.8 / len(modes)
    for index, (mode, name) in enumerate(zip(modes, names, strict=True)):
        axis.bar(
            [w + index * width for w in range(len(train))],
            [r["samples_per_s"][mode] for r in train],
            width,
            label=name,
        )
    axis.set_xticks([w + 0.3 for w in range(len(train))], [f"W={r['world_size']}" for r in train])
    axis.set_ylabel("samples/s")
    axis.set_title("end-to-end training")
    axis.legend()


def _plot_netns(axis: Any, rows: list[dict[str, Any]]) -> None:
    """One N: gradsync and gloo time per (layout, W, S) in units of N/B, each bar with its
    analytic bound (a black line) and the CPU use of all processes (text above it)."""
    positions = list(range(len(rows)))
    for offset, method, name in ((-0.2, "gradsync", "gradsync"), (0.2, "gloo", "gloo ring")):
        xs = [p + offset for p in positions]
        measured = [r[method]["median_ms"] / _link_ms(r) for r in rows]
        bounds = [r[f"{method}_bound_ms"] / _link_ms(r) for r in rows]
        axis.bar(xs, measured, 0.4, label=name)
        axis.hlines(
            bounds,
            [x - 0.2 for x in xs],
            [x + 0.2 for x in xs],
            colors="black",
            label="analytic bound" if method == "gloo" else None,
            zorder=3,
        )
        for x, height, row in zip(xs, measured, rows, strict=True):
            cpu = row[method]["cpu_utilisation"]
            axis.annotate(f"{cpu:.0%}", (x, height), ha="center", va="bottom", fontsize=7)
    axis.set_xticks(
        positions,
        [f"{r.get('layout', 'single')}\nW={r['world_size']} S={r.get('shards', 1)}" for r in rows],
        fontsize=8,
    )
    first = rows[0]
    axis.set_ylabel("time per sync / (N/B)")
    axis.set_title(
        f"emulated cluster: N = {first['megabytes']:g} MB, B = {first['rate_mbit']:g} Mbit/s "
        "(median per sync; black: analytic bound; text: CPU use of all processes)"
    )
    axis.legend(fontsize=8)


def _link_ms(row: dict[str, Any]) -> float:
    """N/B of a netns row in ms (older documents lack `link_ms`: from the ring bound)."""
    if "link_ms" in row:
        return float(row["link_ms"])
    w = int(row["world_size"])
    return float(row["gloo_bound_ms"]) * w / (2 * (w - 1))
