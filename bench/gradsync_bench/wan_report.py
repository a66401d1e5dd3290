"""The wan suite's Markdown tables and plot (called by `gradsync_bench.runner`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

#: How each method is named in the tables and the plot.
LABELS = {
    "nosync": "no-sync reference",
    "ddp-gloo": "torch DDP + gloo",
    "gradsync-ddp": "gradsync DDP",
    "diloco-h10-fp32": "DiLoCo H=10 fp32",
    "diloco-h10-int8": "DiLoCo H=10 int8",
    "diloco-h50-fp32": "DiLoCo H=50 fp32",
    "diloco-h50-int8": "DiLoCo H=50 int8",
    "streaming-f4-int8": "streaming F=4 int8",
    "diloco-h50-int8x2": "DiLoCo H=50 int8, int8 answer",
    "streaming-f4-int8x2": "streaming F=4 int8, int8 answer",
    "diloco-h100-int8x2": "DiLoCo H=100 int8, int8 answer",
    "diloco-h50-topk2": "DiLoCo H=50 sparse 2-bit, d = 0.02 both ways",
    "torchft-h50-fp32": "torchft DiLoCo H=50 fp32",
    "torchft-h10-fp32": "torchft DiLoCo H=10 fp32",
}


def _rate(row: dict[str, Any]) -> str:
    """The row's link: "unshaped", "100", with a one-way delay per link "100 + 25 ms", and
    with the coordinator host on a faster link "100 + 25 ms, hub 1000"."""
    if row["rate_mbit"] is None:
        return "unshaped"
    delay, hub = row.get("delay_ms"), row.get("hub_mbit")
    label = f"{row['rate_mbit']:g}" + (f" + {delay:g} ms" if delay else "")
    return label + (f", hub {hub:g}" if hub else "")


def _mb(value: float | None) -> str:
    return "-" if value is None else f"{value / 1e6:.3f}"


def _s(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def markdown_lines(suite: dict[str, Any]) -> list[str]:
    """The scorecard and the per-method table, as Markdown lines ([] when nothing ran)."""
    rows = suite.get("rows", [])
    if not rows:
        return []
    measured = [r for r in rows if "error" not in r]
    world = f"{measured[0]['world_size']}" if measured else "?"
    model_mb = f"{measured[0]['parameter_bytes'] / 1e6:.1f}" if measured else "?"
    lines = [
        f"**Slow-link scorecard** (wan suite: W = {world} worker hosts and a "
        "coordinator host, network namespaces, every link shaped to B each way; "
        f"{suite.get('note', '')}; char transformer of {model_mb} MB "
        "fp32 on the standard library's source, AdamW; utilization = samples/s / no-sync "
        "samples/s on the same link; bytes per inner step = mean worker host eth0 tx + rx; "
        "client up = gradsync's own upload count; s/round = timed seconds / rounds; "
        "sync s = the slowest rank's mean seconds in a synchronizing step's optimizer step "
        "and synchronization; hub X: the coordinator host's link at X Mbit/s; quality rows: "
        "links unshaped, more steps)",
        "",
        "| target | measured | goal | result |",
        "|---|---|---|---|",
    ]
    for card in suite.get("scorecard", []):
        measured = card["measured"]
        shown = "-" if measured is None else f"{measured:.3g}"
        lines.append(
            f"| {card['target']} ({card['text']}) | {shown} | {card['goal']:g} | {card['result']} |"
        )
    lines += [
        "",
        "| B Mbit/s (+ delay per link) | method | steps | samples/s | utilization | "
        "MB/step up | MB/step down | MB/step total | client MB/step up | client MB/round up | "
        "s/round | sync s | final train loss | held-out loss | load |",
        "|" + "---|" * 15,
    ]
    for row in rows:
        if "error" in row:
            name = LABELS.get(row["method"], row["method"])
            reason = row["error"].splitlines()[0][:300].replace("|", "/")
            lines.append(f"| {_rate(row)} | {name} | failed: {reason} |" + " - |" * 12)
            continue
        utilization = row.get("utilization")
        lines.append(
            "| "
            + " | ".join(
                [
                    _rate(row),
                    LABELS.get(row["method"], row["method"]),
                    f"{row['steps']}",
                    f"{row['samples_per_s']:.1f}",
                    "-" if utilization is None else f"{utilization:.0%}",
                    _mb(row["link_up_bytes_per_step"]),
                    _mb(row["link_down_bytes_per_step"]),
                    _mb(row["link_bytes_per_step"]),
                    _mb(row["client_up_bytes_per_step"]),
                    _mb(row["client_round_upload_bytes"]),
                    _s(row.get("seconds_per_round")),
                    _s(row.get("round_blocking_s")),
                    f"{row['final_train_loss']:.3f}",
                    f"{row['held_out_loss']:.3f}",
                    "-" if row.get("load_average") is None else f"{row['load_average']:.1f}",
                ]
            )
            + " |"
        )
    return [*lines, ""]


def plot(suite: dict[str, Any], path: Path) -> None:
    """Loss against samples per method (one panel per pass) and utilization bars per B."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in suite.get("rows", []) if "error" not in r]
    passes = sorted({_rate(r) for r in rows}, key=lambda link: (link == "unshaped", link))
    figure, axes = plt.subplots(1, len(passes) + 1, figsize=(6 * (len(passes) + 1), 4.5))
    axes = list(axes) if len(passes) else [axes]
    for axis, link in zip(axes, passes, strict=False):
        for row in rows:
            if _rate(row) != link:
                continue
            samples, losses = zip(*row["loss_curve"], strict=True)
            axis.plot(samples, losses, label=LABELS.get(row["method"], row["method"]))
        axis.set_xlabel("samples (all ranks)")
        axis.set_ylabel("training loss, nats/byte")
        unshaped = link == "unshaped"
        axis.set_title("links unshaped (quality pass)" if unshaped else f"B = {link} Mbit/s")
        axis.legend(fontsize=7)
    bars = axes[-1]
    shaped = [r for r in rows if r["rate_mbit"] is not None and r.get("utilization") is not None]
    rates = sorted({_rate(r) for r in shaped}, reverse=True)
    methods = [m for m in LABELS if any(r["method"] == m for r in shaped)]
    width = 0.8 / max(1, len(rates))
    for index, rate in enumerate(rates):
        values = [
            next(
                (r["utilization"] for r in shaped if r["method"] == m and _rate(r) == rate),
                0.0,
            )
            for m in methods
        ]
        bars.bar(
            [i + index * width for i in range(len(methods))],
            values,
            width,
            label=f"{rate} Mbit/s",
        )
    bars.axhline(0.9, color="black", linewidth=0.8, linestyle="--")
    bars.set_xticks(
        [i + 0.4 - width / 2 for i in range(len(methods))],
        [LABELS[m] for m in methods],
        rotation=45,
        ha="right",
        fontsize=7,
    )
    bars.set_ylabel("utilization (samples/s / no-sync)")
    bars.set_title("compute utilization (dashed: 90 %)")
    bars.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
