"""The latency suite (`gradsync_bench.latency.latency_suite`) with every coordinator
started with `--heartbeat-timeout 60`: on a shared machine a rank starved of CPU for
5 s would otherwise be declared dead mid-run. Prints the suite's tables.

    python latency_hb60.py WORLDS MODES STEPS REPS OUT.json
    python latency_hb60.py 8,16 flat,ddp-backend,ddp 100 2 out.json
"""

from __future__ import annotations

import json
import sys
from typing import Any

import gradsync_bench.latency as latency

_start = latency.start_coordinator


def _start_patient(world_size: int, *extra: str, **options: Any) -> Any:
    return _start(world_size, *extra, "--heartbeat-timeout", "60", **options)


def main() -> None:
    worlds, modes, steps, reps, out = sys.argv[1:6]
    latency.start_coordinator = _start_patient
    plan = latency.LatencyPlan(
        worlds=tuple(int(w) for w in worlds.split(",")),
        modes=tuple(modes.split(",")),
        steps=int(steps),
        reps=int(reps),
    )
    rows = latency.latency_suite(plan)
    with open(out, "w") as file:
        json.dump(rows, file, indent=1)
    print("\n".join(latency.markdown_lines(rows)))


if __name__ == "__main__":
    main()
