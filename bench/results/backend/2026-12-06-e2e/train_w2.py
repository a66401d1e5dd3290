"""The train suite at W = 2 with the hierarchical wrapper mode, for one model size.

    PYTHONPATH=client:server:proto:bench python train_w2.py MODEL_MB STEPS OUT.json

The backend's setting comes from $GRADSYNC_HIERARCHICAL (unset: "auto").
"""

from __future__ import annotations

import datetime
import json
import os
import sys
from pathlib import Path

from gradsync_bench.suites import train_suite


def main() -> None:
    model_mb, steps, out = float(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3])
    load = os.getloadavg()[0]
    rows = train_suite([2], model_mb, steps, hierarchy=True)
    for row in rows:
        row["load_1min_start"] = load
        row["backend_hierarchical_env"] = os.environ.get("GRADSYNC_HIERARCHICAL", "")
        row["finished"] = datetime.datetime.now(datetime.UTC).isoformat()
    out.write_text(json.dumps(rows, indent=1))
    rates = rows[0]["samples_per_s"]
    print(
        out,
        {mode: round(rate) for mode, rate in rates.items()},
        f"backend / flat wrapper {rates['ddp-backend'] / rates['gradsync']:.2f}",
        f"backend / hierarchical wrapper {rates['ddp-backend'] / rates['hierarchical']:.2f}",
    )


if __name__ == "__main__":
    main()
