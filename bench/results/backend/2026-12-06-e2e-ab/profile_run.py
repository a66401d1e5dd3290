"""Stock DDP over "gradsync" at W = 2 (the train suite's ddp-backend mode), with py-spy on
the coordinator and both ranks for 8 s once training runs.

    PYTHONPATH=client:server:proto:bench python profile_run.py MODEL_MB STEPS OUT_DIR
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from gradsync_bench.procs import stop_process
from gradsync_bench.suites import _torchrun
from gradsync_proto.net.launch import local_launch, start_coordinator

PY_SPY = [sys.executable.rsplit("/", 1)[0] + "/py-spy", "record", "-d", "8", "-r", "200"]


def spy(coordinator_pid: int, out: Path) -> None:
    time.sleep(25)  # torchrun, imports, the join and a few steps
    found = subprocess.run(
        ["pgrep", "-f", "train_worker.*ddp-backend"], capture_output=True, text=True
    )
    ranks = found.stdout.split()[-2:]  # (the first match is torchrun itself)
    targets = [("coordinator", coordinator_pid)]
    targets += [(f"rank{index}", int(pid)) for index, pid in enumerate(ranks)]
    spies = [
        subprocess.Popen(
            [*PY_SPY, "-p", str(pid), "--threads", "-f", "raw", "-o", str(out / f"{name}.txt")],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for name, pid in targets
    ]
    for process in spies:
        process.wait()


def main() -> None:
    model_mb, steps, out = float(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3])
    out.mkdir(parents=True, exist_ok=True)
    coordinator, port = start_coordinator(2, launch=local_launch)
    env = dict(os.environ, GRADSYNC_COORDINATOR=f"127.0.0.1:{port}", OMP_NUM_THREADS="1")
    threading.Thread(target=spy, args=(coordinator.pid, out), daemon=True).start()
    try:
        with tempfile.TemporaryDirectory() as scratch:
            result = _torchrun(2, "ddp-backend", Path(scratch) / "b.json", model_mb, steps, env)
    finally:
        stop_process(coordinator)
    print("samples/s", result["samples_per_s"])


if __name__ == "__main__":
    main()
