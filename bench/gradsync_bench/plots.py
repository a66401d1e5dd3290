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


def _bars(
    axis: Any, series: dict[str, list[float]], labels: list[str], **ticks: Any
) -> list[list[float]]:
    """One group of bars per label, one bar a series (with its legend name); their x."""
    width = 0.8 / len(series)
    xs = [[p - 0.4 + width * (i + 0.5) for p in range(len(labels))] for i in range(len(series))]
    for x, (name, heights) in zip(xs, series.items(), strict=True):
        axis.bar(x, heights, width, label=name)
    axis.set_xticks(range(len(labels)), labels, **ticks)
    return xs


def _plot_loopback(axis: Any, loopback: list[dict[str, Any]]) -> None:
    """Algorithm bandwidth of one sync per (W, S, N), gradsync beside gloo."""
    labels = [
        f"W={r['world_size']}"
        + (f" S={r['shards']}" if r.get("shards", 1) > 1 else "")
        + f"\n{r['megabytes']:g} MB"
        for r in loopback
    ]
    series = {"gradsync": "gradsync", "gloo all_reduce": "gloo"}
    _bars(axis, {k: [r[m]["algbw_mb_s"] for r in loopback] for k, m in series.items()}, labels)
    axis.set_ylabel("algorithm bandwidth, MB/s")
    axis.set_title("one sync on loopback")
    axis.legend()


def _plot_train(axis: Any, train: list[dict[str, Any]]) -> None:
    """Training samples/s per W, one bar per mode."""
    modes = {
        "local (no comm)": "local",
        "gradsync": "gradsync",
        "gradsync, no overlap": "sequential",
        "torchrun DDP": "ddp",
    }
    series = {name: [r["samples_per_s"][mode] for r in train] for name, mode in modes.items()}
    _bars(axis, series, [f"W={r['world_size']}" for r in train])
    axis.set_ylabel("samples/s")
    axis.set_title("end-to-end training")
    axis.legend()


def _plot_netns(axis: Any, rows: list[dict[str, Any]]) -> None:
    """One N: gradsync and gloo time per (layout, W, S) in units of N/B, each bar with its
    analytic bound (a black line) and the CPU use of all processes (text above it)."""
    methods = {"gradsync": "gradsync", "gloo ring": "gloo"}
    measured = {n: [r[m]["median_ms"] / r["link_ms"] for r in rows] for n, m in methods.items()}
    labels = [f"{r['layout']}\nW={r['world_size']} S={r['shards']}" for r in rows]
    xs = _bars(axis, measured, labels, fontsize=8)
    for x, (name, method) in zip(xs, methods.items(), strict=True):
        bounds = [r[f"{method}_bound_ms"] / r["link_ms"] for r in rows]
        axis.hlines(
            bounds,
            [b - 0.2 for b in x],
            [b + 0.2 for b in x],
            colors="black",
            label="analytic bound" if method == "gloo" else None,
            zorder=3,
        )
        for at, height, row in zip(x, measured[name], rows, strict=True):
            cpu = row[method]["cpu_utilisation"]
            axis.annotate(f"{cpu:.0%}", (at, height), ha="center", va="bottom", fontsize=7)
    first = rows[0]
    axis.set_ylabel("time per sync / (N/B)")
    axis.set_title(
        f"emulated cluster: N = {first['megabytes']:g} MB, B = {first['rate_mbit']:g} Mbit/s "
        "(median per sync; black: analytic bound; text: CPU use of all processes)"
    )
    axis.legend(fontsize=8)
