"""Stock DDP over "gradsync" on one coordinator (S = 1) and on a sharded one (S = 2), A B A B.

Each pass starts `gradsync serve --world-size 2` (with `--shards 2` for S = 2), then two
ranks of `gradsync_bench.train_worker --mode ddp-backend` (stock DDP over the backend,
one CPU thread each, the train suite's MLP of `--model-mb` MB), and records rank 0's
samples/s and the CPU seconds of the coordinator's processes (leader and shard).
`serve` defaults to 1 MiB chunks unsharded and 0.25 MiB sharded; `--chunk-mb` sets both.

    PYTHONPATH=client:server:proto:bench python bench/results/backend/2026-12-06-shards/run_ab.py \
        --model-mb 32 --steps 8 --passes 2 --out bench/results/backend/2026-12-06-shards/ab.json
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of `pid` and its children so far (Linux /proc)."""
    total = 0.0
    ticks = os.sysconf("SC_CLK_TCK")
    pids = [pid]
    children = Path(f"/proc/{pid}/task/{pid}/children")
    if children.exists():
        pids += [int(p) for p in children.read_text().split()]
    for each in pids:
        try:
            fields = Path(f"/proc/{each}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / ticks
    return total


def one_pass(
    shards: int, model_mb: float, steps: int, chunk_mb: float | None, workdir: Path
) -> dict[str, float]:
    port = free_port()
    while port + 3 >= 65535:
        port = free_port()
    command = [sys.executable, "-m", "gradsync", "serve", "--world-size", "2", "--port", str(port)]
    if shards > 1:
        command += ["--shards", str(shards)]
    if chunk_mb is not None:
        command += ["--chunk-mb", str(chunk_mb)]
    log = (workdir / f"serve-{port}.log").open("w")
    coordinator = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    try:
        time.sleep(4.0)  # the leader, and its shard process, start and register
        out = workdir / f"rank0-{port}.json"
        env = dict(
            os.environ,
            WORLD_SIZE="2",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(free_port()),
            GRADSYNC_COORDINATOR=f"127.0.0.1:{port}",
        )
        ranks = [
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "gradsync_bench.train_worker",
                    "--mode",
                    "ddp-backend",
                    "--model-mb",
                    str(model_mb),
                    "--steps",
                    str(steps),
                    "--warmup",
                    "2",
                    "--out",
                    str(out),
                ],
                env=dict(env, RANK=str(rank), LOCAL_RANK=str(rank)),
            )
            for rank in range(2)
        ]
        for rank in ranks:
            if rank.wait(timeout=600) != 0:
                raise RuntimeError(f"a rank exited {rank.returncode}; see {log.name}")
        result = json.loads(out.read_text())
        result["coordinator_cpu_s"] = cpu_seconds(coordinator.pid)
        result["shards"] = shards
        result["chunk_mb"] = chunk_mb if chunk_mb is not None else (1.0 if shards == 1 else 0.25)
        return result
    finally:
        coordinator.terminate()
        coordinator.wait(timeout=30)
        log.close()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model-mb", type=float, default=32.0)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--passes", type=int, default=2)
    parser.add_argument("--chunk-mb", type=float, help="both coordinators' (default: serve's)")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(args.passes):
            for shards in (1, 2):  # A B A B
                row = one_pass(shards, args.model_mb, args.steps, args.chunk_mb, Path(tmp))
                print(json.dumps(row), flush=True)
                rows.append(row)
    args.out.write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
