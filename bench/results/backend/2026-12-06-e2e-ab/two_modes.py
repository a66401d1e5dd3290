"""The hierarchical wrapper and stock DDP over "gradsync" at W = 2, one tree.

    PYTHONPATH=TREE/client:TREE/server:TREE/proto:TREE/bench \
        python two_modes.py MODEL_MB STEPS OUT.json

The train suite's two modes (`gradsync_bench.suites._torchrun`), the wrapper first; the
backend at its default setting ($GRADSYNC_HIERARCHICAL unset: "auto", a host group of 2).
With $SAME_COORDINATOR=1 both run on one coordinator (as the train suite does); by
default each mode gets a fresh coordinator (on one coordinator the backend after the
wrapper ran 2-3x slower than alone, on every tree: see README).
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import tempfile
from pathlib import Path

import gradsync_server
from gradsync_bench.procs import stop_process
from gradsync_bench.suites import _torchrun
from gradsync_proto.net.launch import local_launch, start_coordinator

MODES = ("hierarchical", "ddp-backend")


def main() -> None:
    model_mb, steps, out = float(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3])
    load = os.getloadavg()[0]
    shared = os.environ.get("SAME_COORDINATOR") == "1"
    results = {}
    with tempfile.TemporaryDirectory() as scratch:
        for groups in [MODES] if shared else [(m,) for m in MODES]:
            coordinator, port = start_coordinator(2, launch=local_launch)
            env = dict(os.environ, GRADSYNC_COORDINATOR=f"127.0.0.1:{port}", OMP_NUM_THREADS="1")
            try:
                for m in groups:
                    results[m] = _torchrun(2, m, Path(scratch) / f"{m}.json", model_mb, steps, env)
            finally:
                stop_process(coordinator)
    rates = {m: r["samples_per_s"] for m, r in results.items()}
    row = {
        "tree": str(Path(gradsync_server.__file__).resolve().parents[2]),
        "model_mb": model_mb,
        "steps": steps,
        "samples_per_s": rates,
        "backend_over_hierarchical": rates["ddp-backend"] / rates["hierarchical"],
        "same_coordinator": shared,
        "load_1min_start": load,
        "load_1min_end": os.getloadavg()[0],
        "finished": datetime.datetime.now(datetime.UTC).isoformat(),
        "results": results,
    }
    out.write_text(json.dumps(row, indent=1))
    print(
        out.name,
        {m: round(r) for m, r in rates.items()},
        f"ratio {row['backend_over_hierarchical']:.2f}",
        f"load {load:.1f}",
    )


if __name__ == "__main__":
    main()
