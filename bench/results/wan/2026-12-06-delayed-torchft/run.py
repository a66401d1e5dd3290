"""The delayed wan scorecard with torchft beside gradsync, 2026-12-06: W = 4, H = 50.

Links: 100 Mbit/s + 25 ms per link (100 ms round trip host to host), 100 Mbit/s + 100 ms
per link (400 ms round trip), 20 Mbit/s + 50 ms per link (200 ms round trip), and the hub
pass (workers 100 Mbit/s + 25 ms, the coordinator host 1 Gbit/s + 25 ms).

`python run.py OUT_DIR` (root, with gradsync and gradsync_bench importable) writes
latest.json, latest.md and latest.png into OUT_DIR, as `gradsync bench` would.
"""

import dataclasses
import sys
from pathlib import Path

from gradsync_bench import runner


def main() -> None:
    """Run the plan and write its results into the folder given as the only argument."""
    plan = dataclasses.replace(
        runner.BenchPlan(),
        suites=("wan",),
        wan_world=4,
        wan_rates_mbit=[100.0, 100.0, 20.0],
        wan_delays_ms=[25.0, 100.0, 50.0],
        wan_hub=[100.0, 25.0, 1000.0],
        wan_steps=50,
        wan_sync_steps=3,
        wan_quality_steps=0,
        wan_methods=(
            "nosync",
            "ddp-gloo",
            "diloco-h50-fp32",
            "diloco-h50-int8",
            "streaming-f4-int8",
            "diloco-h50-int8x2",
            "torchft-h50-fp32",
        ),
    )
    document = runner.run(plan)
    runner.write(document, Path(sys.argv[1]))
    print(runner.markdown(document))


if __name__ == "__main__":
    main()
