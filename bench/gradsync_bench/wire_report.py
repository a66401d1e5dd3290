"""The netns suite's 16-bit wire table: bf16 / fp16 gradsync next to fp32 and DDP's bf16 hook.

A 16-bit wire halves the bytes each way (the coordinator still sums in fp32),
so on a link-bound layout its time should approach half the fp32 time (the
issue's target: bf16 <= 0.55x). The reference is what torch users do on the
same links: DDP with `bf16_compress_hook` over gloo (a bf16 ring all-reduce),
timed in the same worker processes, alternating with the other methods.
"""

from __future__ import annotations

from typing import Any

from gradsync_bench.tables import cells, table

#: The 16-bit wires the netns suite can time (`gradsync_bench.sync_worker` methods).
WIRES = ("bf16", "fp16")
#: torch DDP with the bf16 compression hook over gloo (no coordinator).
DDP_BF16 = "ddp-bf16"
#: The sync worker's method that times the forward and backward alone (no sync at all).
LOCAL = "local"
#: torch DDP over the same gloo group, fp32, on the same forward and backward as gradsync's.
DDP_FP32 = "ddp"


def markdown_lines(rows: list[dict[str, Any]]) -> list[str]:
    """The table of every row that timed a 16-bit wire (none: no lines)."""
    timed = [r for r in rows if any(wire in r for wire in WIRES)]
    if not timed:
        return []
    wires = [wire for wire in WIRES if any(wire in r for r in timed)]
    lines = []
    for r in timed:
        fp32, ddp = r["gradsync"]["median_ms"], r.get(DDP_BF16, {}).get("median_ms")
        times = [r.get(wire, {}).get("median_ms") for wire in wires]
        lines.append(
            cells("{layout} | {world_size} | {shards} | {megabytes:g} | ", r)
            + f"{fp32:.0f} ({r['gradsync_of_bound']:.0%}) | "
            + "".join("- | " if ms is None else f"{ms:.0f} ({ms / fp32:.2f}) | " for ms in times)
            + cells("{gloo[median_ms]:.0f} | {ddp:.0f} | ", {**r, "ddp": ddp})
            + " | ".join("-" if None in (ms, ddp) else f"{ms / ddp:.2f}" for ms in times)
        )
    return table(
        "**16-bit wire on the emulated cluster** (same links and processes as above; gradsync "
        "sums in fp32 and answers in the wire dtype; DDP bf16 hook = torch DDP with "
        "`bf16_compress_hook` over gloo; median of the repetitions)",
        "layout | W | S | N MB | fp32 ms (of bound) | "
        + "".join(f"{wire} ms (/ fp32) | " for wire in wires)
        + "gloo fp32 ms | DDP bf16 hook ms | "
        + " | ".join(f"{wire} / DDP bf16" for wire in wires),
        lines,
    )
