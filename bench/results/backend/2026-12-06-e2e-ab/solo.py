"""Stock DDP over "gradsync" alone at W = 2, REPS runs on one coordinator, one tree.

    PYTHONPATH=TREE/client:TREE/server:TREE/proto:TREE/bench python solo.py MODEL_MB STEPS REPS NAME

Prints, per run: NAME, the run, seconds for STEPS steps, samples/s, wall seconds.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path

from gradsync_bench.procs import stop_process
from gradsync_bench.suites import _torchrun
from gradsync_proto.net.launch import local_launch, start_coordinator


def main() -> None:
    mb, steps, reps = float(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    coordinator, port = start_coordinator(2, launch=local_launch)
    env = dict(os.environ, GRADSYNC_COORDINATOR=f"127.0.0.1:{port}", OMP_NUM_THREADS="1")
    try:
        with tempfile.TemporaryDirectory() as scratch:
            for i in range(reps):
                t = time.time()
                r = _torchrun(2, "ddp-backend", Path(scratch) / f"b{i}.json", mb, steps, env)
                print(
                    sys.argv[4],
                    i,
                    round(r["seconds"], 2),
                    round(r["samples_per_s"]),
                    "wall",
                    round(time.time() - t, 1),
                    flush=True,
                )
    finally:
        stop_process(coordinator)


if __name__ == "__main__":
    main()
