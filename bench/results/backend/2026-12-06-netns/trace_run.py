"""One hierarchy row (2 hosts x 2 ranks, N MB, 200 Mbit/s) written to OUT as JSON.

Run with $GRADSYNC_TRACE set to trace the backend's groups:
`python trace_run.py MB OUT`.
"""

from __future__ import annotations

import json
import sys

from gradsync_bench import netns_hosts


def main() -> None:
    megabytes, out = float(sys.argv[1]), sys.argv[2]
    rows, reason = netns_hosts.hierarchy_suite([megabytes], 2, 200.0)
    if reason:
        raise SystemExit(reason)
    with open(out, "w") as f:
        json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
