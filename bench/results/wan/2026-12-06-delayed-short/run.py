"""The short delayed wan run of 2026-12-06: W = 2, 100 Mbit/s + 25 ms per link, four methods.

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
        wan_world=2,
        wan_rates_mbit=[100.0],
        wan_delays_ms=[25.0],
        wan_steps=20,
        wan_sync_steps=2,
        wan_quality_steps=0,
        wan_methods=("nosync", "ddp-gloo", "gradsync-ddp", "diloco-h10-int8"),
    )
    document = runner.run(plan)
    runner.write(document, Path(sys.argv[1]))
    print(runner.markdown(document))


if __name__ == "__main__":
    main()
