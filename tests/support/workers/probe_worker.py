"""Says what a worker process sees at its start (the prefork launcher's tests).

Prints one JSON line to stdout: its argv, working directory, one environment variable,
parent, session, whether torch was imported before this script ran, a draw from `random`
and from numpy, and the first line of stdin; writes "to stderr" on stderr and one line to
each descriptor named by --write-fd; then sleeps --sleep-s and exits with --exit.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time

TORCH_BEFORE = "torch" in sys.modules

import numpy as np  # noqa: E402  (after the check above, on purpose)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--exit", type=int, default=0)
    parser.add_argument("--sleep-s", type=float, default=0.0)
    parser.add_argument("--read-stdin", action="store_true")
    parser.add_argument("--write-fd", type=int, action="append", default=[])
    args = parser.parse_args()
    facts = {
        "argv": sys.argv[1:],
        "cwd": os.getcwd(),
        "probe_env": os.environ.get("GRADSYNC_PROBE"),
        "ppid": os.getppid(),
        "pid": os.getpid(),
        "sid": os.getsid(0),
        "torch_before": TORCH_BEFORE,
        "random": random.random(),
        "numpy": float(np.random.random()),
        "stdin": sys.stdin.readline() if args.read_stdin else None,
        "main_file": os.path.basename(str(sys.modules["__main__"].__file__)),
    }
    print(json.dumps(facts), flush=True)
    sys.stderr.write("to stderr\n")
    for fd in args.write_fd:
        os.write(fd, f"fd {fd}\n".encode())
    time.sleep(args.sleep_s)
    return args.exit


if __name__ == "__main__":
    sys.exit(main())
