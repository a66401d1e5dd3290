"""DiLoCo's model quality against DDP's at equal samples: `python -m gradsync_bench.quality`.

W = 4 ranks of the char-level transformer of `gradsync_bench.quality_sim` (width 32, 2
layers, context 32, batch 16 per rank; AdamW with a warm-up and a cosine decay), 2,000
inner steps by default. Every setting is simulated in one process (rule for rule as the
coordinator runs it: `gradsync_bench.quality_sim`), several at a time (`--jobs`):

  table   DDP, one rank alone, DiLoCo H = 10 and H = 50 with fp32 and int8 wires and
          streaming (2 fragments), at the library's defaults
  tune    DDP, one rank, and DiLoCo at the given points H:LR:MOMENTUM[:WARMUP]

and `gradsync_bench.quality_real` confirms a setting with real processes. Writes
`quality.json` (every run's held-out loss and curve, the date, commit, machine and
command), `quality.md` (the table, % against DDP) and `quality.png` (the curves)
into `--out`.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import json
import os
import platform
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from gradsync_bench import provenance
from gradsync_bench.quality_sim import Result, Setting, Task, simulate


def table_settings(outer_lr: float, momentum: float, warmup_rounds: int) -> list[Setting]:
    """The scorecard's rows at one outer setting."""
    common = dict(outer_lr=outer_lr, outer_momentum=momentum, warmup_rounds=warmup_rounds)
    rows = [Setting("ddp"), Setting("one")]
    for h in (10, 50):
        rows.append(Setting("diloco", sync_every=h, **common))  # type: ignore[arg-type]
        rows.append(Setting("diloco", sync_every=h, wire="int8", **common))  # type: ignore[arg-type]
        rows.append(Setting("diloco", sync_every=h, fragments=2, **common))  # type: ignore[arg-type]
    return rows


def tune_settings(points: str, wire: str, fragments: int, references: bool) -> list[Setting]:
    """DDP and one rank (`references`), then DiLoCo at each H:LR:MOMENTUM[:WARMUP] of
    `points` (a, b, ...)."""
    rows = [Setting("ddp"), Setting("one")] if references else []
    for point in points.split(","):
        h, lr, mu, *warmup = point.split(":")
        rows.append(
            Setting(
                "diloco",
                sync_every=int(h),
                outer_lr=float(lr),
                outer_momentum=float(mu),
                wire=wire,
                fragments=fragments,
                warmup_rounds=int(warmup[0]) if warmup else 0,
            )
        )
    return rows


def run_all(
    settings: list[Setting], task: Task, jobs: int, done: Callable[[list[Result]], object]
) -> list[Result]:
    """Every setting, `jobs` processes at a time; `done` gets the results so far (in the
    order they finished) after each."""
    results: list[Result] = []
    with concurrent.futures.ProcessPoolExecutor(max(1, jobs)) as pool:
        futures = [pool.submit(simulate, s, task) for s in settings]
        for future in concurrent.futures.as_completed(futures):
            result = future.result()
            print(f"{result.setting.name}: {result.held_out_loss:.4f} ({result.seconds:.0f} s)")
            results.append(result)
            done(results)
    order = {s: i for i, s in enumerate(settings)}
    return sorted(results, key=lambda r: order[r.setting])


def markdown(document: dict[str, Any]) -> str:
    """The table: held-out loss and % against DDP of every run."""
    runs = document["runs"]
    ddp = next((r["held_out_loss"] for r in runs if r["name"] == "ddp"), None)
    lines = [
        f"# DiLoCo quality ({document['date']})",
        "",
        f"commit {document['commit']}, machine {document['machine']}, "
        f"command `{document['command']}`",
        "",
        f"Task: {json.dumps(document['task'])}. Simulated in one process (rule for rule as "
        "the coordinator), the machine shared with other work (timings are not the point).",
        "",
        "| run | held-out loss | vs DDP |",
        "|---|---|---|",
    ]
    for r in runs:
        versus = "" if ddp is None else f"{100 * (r['held_out_loss'] / ddp - 1):+.2f} %"
        lines.append(f"| {r['name']} | {r['held_out_loss']:.4f} | {versus} |")
    return "\n".join(lines) + "\n"


def plot(document: dict[str, Any], path: Path) -> None:
    """The held-out loss curves of every run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(10, 6))
    for r in document["runs"]:
        if r["curve"]:
            steps, losses = zip(*r["curve"], strict=True)
            axis.plot(steps, losses, label=r["name"])
    axis.set_xlabel("inner step")
    axis.set_ylabel("held-out loss (nats/byte)")
    axis.set_ylim(top=min(3.0, axis.get_ylim()[1]))
    axis.legend(fontsize=7)
    axis.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


def combine(inputs: list[Path], out: Path) -> None:
    """One table and one figure (quality.md, quality.png) of the runs of several documents
    of the same task (the first one's provenance heads it; each keeps its own in `parts`)."""
    documents = [json.loads(path.read_text()) for path in inputs]
    runs: dict[str, Any] = {}
    for document in documents:
        if document["task"] != documents[0]["task"]:
            raise ValueError(f"{document['command']} ran another task: {document['task']}")
        for run in document["runs"]:
            runs.setdefault(run["name"], run)
    merged = {
        **{k: documents[0][k] for k in ("date", "commit", "machine", "command", "task")},
        "runs": list(runs.values()),
        "parts": [{k: d[k] for k in ("date", "commit", "command")} for d in documents],
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "quality.json").write_text(json.dumps(merged, indent=1) + "\n")
    (out / "quality.md").write_text(markdown(merged))
    plot(merged, out / "quality.png")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("what", choices=["table", "tune", "combine"])
    parser.add_argument(
        "--inputs", type=Path, nargs="*", default=[], help="combine: quality-*.json"
    )
    parser.add_argument("--steps", type=int, default=Task.steps)
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--outer-lr", type=float, default=None, help="table: default the library's")
    parser.add_argument("--outer-momentum", type=float, default=None)
    parser.add_argument("--warmup-rounds", type=int, default=0)
    parser.add_argument(
        "--points", default="10:0.7:0.9,50:0.7:0.9", help="tune: H:LR:MOMENTUM[:WARMUP],..."
    )
    parser.add_argument("--wire", choices=["fp32", "int8"], default="fp32", help="tune")
    parser.add_argument("--fragments", type=int, default=1, help="tune")
    parser.add_argument("--no-reference", action="store_true", help="tune: no DDP, no one rank")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--tag", default="", help="appended to the file names")
    args = parser.parse_args(argv)
    if args.what == "combine":
        combine(args.inputs, args.out)
        return
    task = Task(steps=args.steps, eval_every=50 if args.steps >= 1000 else max(1, args.steps // 20))
    if args.what == "table":
        import inspect

        from gradsync import DiLoCo

        defaults = inspect.signature(DiLoCo.__init__).parameters
        lr = args.outer_lr if args.outer_lr is not None else defaults["outer_lr"].default
        mu = (
            args.outer_momentum
            if args.outer_momentum is not None
            else defaults["outer_momentum"].default
        )
        settings = table_settings(lr, mu, args.warmup_rounds)
    else:
        settings = tune_settings(args.points, args.wire, args.fragments, not args.no_reference)
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"quality-{args.what}{args.tag}"

    def write(results: list[Result]) -> dict[str, Any]:
        document = {
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "commit": provenance.commit(),
            "machine": f"{platform.node()} {platform.machine()}, {os.cpu_count()} cpus (shared)",
            "command": provenance.command_line(),
            "task": asdict(task),
            "runs": [r.record() for r in results],
        }
        stem.with_suffix(".json").write_text(json.dumps(document, indent=1) + "\n")
        stem.with_suffix(".md").write_text(markdown(document))
        return document

    document = write(run_all(settings, task, args.jobs, write))
    plot(document, stem.with_suffix(".png"))
    print(markdown(document))


if __name__ == "__main__":
    main()
