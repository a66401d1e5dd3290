"""Read a `gradsync_bench.wan_profile` folder: where each profiled row's seconds went.

`python -m gradsync_bench.wan_profile_report DIR [DIR ...]` prints, per folder (one link),
a markdown section per method:

- the row (timed seconds, samples/s, utilization against the no-sync rows of the same
  folder, the load average it ran under);
- its rounds from the ranks' timelines: when the first and the last rank started
  uploading (the spread is time the early ranks wait for the slowest one's compute), and
  how long from the last upload's start to the answers, against the link's bound for the
  bytes the round moved (the last rank's upload over its own link, then the W answers over
  the coordinator host's link, or one answer over a worker's link if that is slower);
- what the sampled processes' threads did: py-spy's samples per thread, each sorted by its
  innermost frames into a few kinds (compute, waiting for the round, quantizing, the event
  loop busy or idle, ...), as shares of the thread's samples times the sampled window.

py-spy samples a thread at most `hz` times a second and fewer when the machine is
saturated (its sampler then gets no CPU either), so shares are of the samples it took; the
timelines, not the samples, give the seconds of waiting. `--trim N` also writes
`<raw>.top.txt` beside every raw profile: its N largest stacks.
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
from pathlib import Path
from typing import Any

#: (kind, substrings of a stack's innermost frames), first match wins; a stack matching
#: none is "other".
KINDS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("waiting for the round", ("Fragment.wait", "_wait_for_tstate_lock", "Inbox.wait")),
    ("int8 quantize / dequantize", ("quantize", "Int8Quantization", "Int8Wire")),
    (
        "torchft all-reduce / quorum",
        ("allreduce", "quorum", "Manager.", "should_commit", "_ManagedWork", "perform_sync"),
    ),
    ("backward", ("backward", "_engine_run_backward")),
    ("optimizer step", ("adam", "Adam.", "SGD.", "sgd")),
    ("forward", ("forward", "Linear", "attention", "layer_norm", "cross_entropy", "relu")),
    ("DiLoCo bookkeeping", ("DiLoCo.", "Fragment.", "OuterState", "OpenStep", "outer")),
    ("event loop idle", ("EpollSelector.select",)),
    (
        "idle (blocked thread)",
        ("Condition.wait", "FrameSocket._wait", "socket.accept", "Event.wait", "_worker"),
    ),
    (
        "transport",
        ("sendall", "socket.send", "recv_into", "FrameConnection", "write_message", "_ready"),
    ),
)
#: Threads that only ever block in native code (grpc's poller): left out of the tables.
SILENT_THREADS = ("_poll_wrapper",)


def kind_of(frames: list[str]) -> str:
    """The kind of one stack (outermost frame first)."""
    inner = ";".join(frames[-6:])
    for kind, needles in KINDS:
        if any(needle in inner for needle in needles):
            return kind
    if frames[-1].startswith("Thread.run") or frames[-1].startswith("Thread._bootstrap"):
        return "idle (blocked thread)"
    return "other"


def read_raw(path: Path) -> dict[str, collections.Counter[str]]:
    """py-spy's raw output: per thread name, samples per stack."""
    threads: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        stack, count = line.rsplit(" ", 1)
        frames = stack.split(";")
        # "thread (ID): NAME": threads may share a name (one per fragment), not an id.
        tid, _, name = frames[0].partition(": ")
        thread = f"{name} {tid.removeprefix('thread ')}"
        threads[thread][";".join(frames[1:])] += int(count)
    return threads


def thread_table(path: Path, window_s: float) -> list[str]:
    """A markdown table of one sampled process: per thread, seconds by kind."""
    threads = read_raw(path)
    # The longest-lived thread was sampled at every sample: its count spans the window.
    full = max(sum(stacks.values()) for stacks in threads.values())
    lines = ["| thread | samples | kind | share | ≈ s of the window |", "|---|---|---|---|---|"]
    for thread, stacks in sorted(threads.items(), key=lambda t: -sum(t[1].values())):
        if any(s in thread for s in SILENT_THREADS):
            continue
        total = sum(stacks.values())
        kinds: collections.Counter[str] = collections.Counter()
        for stack, count in stacks.items():
            kinds[kind_of(stack.split(";"))] += count
        for kind, count in kinds.most_common():
            if count / total < 0.01:
                continue
            lines.append(
                f"| {thread} | {total} | {kind} | {count / total:.1%} | "
                f"{count / full * window_s:.1f} |"
            )
    return lines


def top_busy(path: Path, limit: int) -> list[str]:
    """The `limit` busiest non-idle stacks of a process (innermost three frames)."""
    counts: collections.Counter[str] = collections.Counter()
    for thread, stacks in read_raw(path).items():
        if any(s in thread for s in SILENT_THREADS):
            continue
        for stack, count in stacks.items():
            frames = stack.split(";")
            if kind_of(frames).startswith(("idle", "event loop idle")):
                continue
            inner = " < ".join(f.split(" (")[0] for f in reversed(frames[-3:]))
            counts[f"{thread}: {inner}"] += count
    return [f"    {count:6d}  {stack}" for stack, count in counts.most_common(limit)]


def trim(path: Path, limit: int) -> Path:
    """Write the `limit` largest stacks of a raw profile beside it; the new file."""
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    lines.sort(key=lambda line: -int(line.rsplit(" ", 1)[1]))
    target = path.with_suffix(".top.txt")
    total = sum(int(line.rsplit(" ", 1)[1]) for line in lines)
    kept = lines[:limit]
    kept_samples = sum(int(line.rsplit(" ", 1)[1]) for line in kept)
    header = (
        f"# py-spy raw stacks of {path.name}: the {len(kept)} largest of {len(lines)} "
        f"({kept_samples} of {total} samples); format: stack count\n"
    )
    target.write_text(header + "\n".join(kept) + "\n")
    return target


def round_lines(
    records: list[dict[str, Any]], link: dict[str, Any], world_size: int, shards: int = 0
) -> list[str]:
    """The rounds of one row from the ranks' timelines, against the link's bound (`shards`
    S > 0: the outer state on S shards colocated with the first S workers, whose hosts'
    links then carry max(1, (W + S - 2) / S) uploads and answers each way)."""
    rate = link["rate_mbit"] * 1e6 / 8
    hub = (link.get("hub_mbit") or link["rate_mbit"]) * 1e6 / 8
    round_trip = 4 * (link.get("delay_ms") or 0.0) / 1000
    by_round: dict[tuple[int, int], list[dict[str, Any]]] = collections.defaultdict(list)
    for record in records:
        for index, item in enumerate(
            sorted(record.get("round_timeline", []), key=lambda r: (r["fragment"], r["start_s"]))
        ):
            by_round[(item["fragment"], index)].append(item)
    lines = []
    for (fragment, _), items in sorted(by_round.items(), key=lambda kv: kv[1][0]["start_s"]):
        if len(items) < world_size:
            continue
        first = min(i["start_s"] for i in items)
        last = max(i["start_s"] for i in items)
        answers = [i["answer_s"] for i in items]
        up = statistics.mean(i["sent_bytes"] for i in items)
        down = statistics.mean(i["received_bytes"] for i in items)
        # Each direction of the coordinator host's link carries W uploads and W answers
        # (a worker's link one of each, if that is slower).
        if shards:
            factor = max(1.0, (world_size + shards - 2) / shards)
            up_s, down_s, carried = factor * up / rate, factor * down / rate, f"{factor:g}"
        else:
            up_s = max(up / rate, world_size * up / hub)
            down_s = max(down / rate, world_size * down / hub)
            carried = str(world_size)
        lines.append(
            f"- fragment {fragment}: uploads start {first:.1f}-{last:.1f} s (spread "
            f"{last - first:.1f} s), answers {min(answers):.1f}-{max(answers):.1f} s; first "
            f"upload's start to the last answer {max(answers) - first:.1f} s, the last "
            f"upload's start to the answers (mean) {statistics.mean(answers) - last:.1f} s. "
            f"Link time: {carried} x {up / 1e6:.1f} MB up = {up_s:.2f} s, {carried} x "
            f"{down / 1e6:.1f} MB down = {down_s:.2f} s, round trip {round_trip:.2f} s; "
            f"bound one after the other {up_s + down_s + round_trip:.2f} s, answers streaming "
            f"back while the uploads go on {max(up_s, down_s) + round_trip:.2f} s"
        )
    return lines


def section(folder: Path, row: dict[str, Any], link: dict[str, Any], reference: float | None,
            limit: int) -> list[str]:  # fmt: skip
    """One method's markdown."""
    name = row.get("run", row["method"])
    if "error" in row:
        return [f"### {name}", "", f"failed: {row['error'][-600:]}", ""]
    records = json.loads((folder / f"{name}.json").read_text())
    window = row.get("sampled_window_s") or row["seconds"]
    utilization = f"{row['samples_per_s'] / reference:.2f}" if reference else "-"
    blocking = row.get("round_blocking_s")
    lines = [
        f"### {name}",
        "",
        f"{row['steps']} steps in {row['seconds']:.1f} s (slowest rank), "
        f"{row['samples_per_s']:.2f} samples/s, utilization {utilization} against this "
        f"link's no-sync rows, load average {row['load_average']:.1f}; per rank timed s: "
        + ", ".join(f"{r['seconds']:.1f}" for r in records)
        + (
            "; a synchronizing step blocked (per rank, mean): "
            + ", ".join(
                f"{statistics.mean(r['round_seconds']):.2f}" for r in records if r["round_seconds"]
            )
            + " s"
            if blocking is not None
            else ""
        )
        + f"; eth0 per rank and step: {row['link_up_bytes_per_step'] / 1e6:.3f} MB up, "
        f"{row['link_down_bytes_per_step'] / 1e6:.3f} MB down.",
        "",
        *round_lines(records, link, len(records), link.get("shards", 0)),
        "",
    ]
    for process in row.get("profiled", []):
        raw = folder / f"{name}-{process}.raw"
        if not raw.exists():
            lines += [f"{process}: no profile written", ""]
            continue
        lines += [
            f"{process} (py-spy, {window:.1f} s window):",
            "",
            *thread_table(raw, window),
            "",
            "busiest stacks (samples, innermost frame first):",
            "",
            *top_busy(raw, 8),
            "",
        ]
        if limit:
            trim(raw, limit)
    return lines


def report(folder: Path, limit: int) -> str:
    """The markdown of one profile folder."""
    summary = json.loads((folder / "rows.json").read_text())
    link = summary["link"]
    if summary.get("layout") == "colocated":
        link = dict(link, shards=summary["shards"])
    rows = summary["rows"]
    nosync = [r["samples_per_s"] for r in rows if r["method"] == "nosync" and "error" not in r]
    reference = statistics.mean(nosync) if nosync else None
    label = f"{link['rate_mbit']:g} Mbit/s + {link.get('delay_ms') or 0:g} ms per link" + (
        f", coordinator host {link['hub_mbit']:g} Mbit/s" if link.get("hub_mbit") else ""
    )
    if link.get("shards"):
        label += f", {link['shards']} shards colocated with the workers"
    lines = [
        f"## {label}",
        "",
        "no-sync reference samples/s: " + ", ".join(f"{s:.2f}" for s in nosync),
        "",
    ]
    for row in rows:
        lines += section(folder, row, link, reference, limit)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("folders", type=Path, nargs="+")
    parser.add_argument("--trim", type=int, default=0, help="write each raw's N top stacks")
    args = parser.parse_args(argv)
    print("\n\n".join(report(folder, args.trim) for folder in args.folders))


if __name__ == "__main__":
    main()
