"""Are healthy ranks declared dead on a slow, delayed link at the default timeouts?

A reproduction, as a new user would run it: W worker hosts and a coordinator host (network
namespaces, every link shaped to B Mbit/s with a one-way delay of D ms, `gradsync_bench.netns`),
`gradsync serve` with nothing but its world size and address, and on every worker host one
rank training a 16 MiB linear model (2048 x 2048 float32 and a bias) with
`gradsync.DistributedDataParallel` at its defaults, synchronized every step. Every process's
log is kept, and every second each worker host's bytes queued in its sockets to the
coordinator (``ss`` Send-Q, in ``send-queues.txt``); the summary says which rank, if any, was
declared dead, at what step, whether the job finished, and the largest queue per host.

``--freeze R`` stops rank R's process (SIGSTOP) 1 s into its second step (its upload), on the
same saturated links, and reports how long after the signal the coordinator declared it dead
(``freeze.dead_after_s``): a frozen rank must be named within the heartbeat timeout + 1 s.
``--width`` changes the model (``--width 1024``: 4 MiB) and ``--serve-arg`` passes a flag to
``gradsync serve`` (repeat it: ``--serve-arg=--heartbeat-timeout --serve-arg=2``).

    python -m gradsync_bench.wan_liveness --rate-mbit 20 --delay-ms 50 --world 3 --steps 5 \\
        --out /tmp/liveness

Needs root (namespaces); prints one JSON summary line and writes the logs to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import IO

from gradsync_proto.net.launch import start_coordinator

from gradsync_bench.netns import Cluster
from gradsync_bench.netns_probe import delay_available
from gradsync_bench.netns_shaping import LinkShape
from gradsync_bench.sharded import LEADER_PORT, on_host

#: Lines of the logs that report a rank lost (the coordinator's and the workers' wording).
DEAD = re.compile(r"declared dead|without a heartbeat|keepalive|dead", re.IGNORECASE)
#: The coordinator's line that names a rank declared dead.
DECLARED = re.compile(r"rank (\d+) was declared dead")
#: Width of the square weight: 2048 x 2048 float32 + 2048 bias = 16.0 MiB.
WIDTH = 2048


def worker(coordinator: str, rank: int, world_size: int, steps: int, width: int = WIDTH) -> int:
    """One rank at the library's defaults; a JSON line per step on stdout."""
    import gradsync
    import torch
    from torch import nn

    torch.set_num_threads(1)
    torch.manual_seed(rank)
    model = nn.Linear(width, width)
    ddp = gradsync.DistributedDataParallel(
        model, coordinator=coordinator, rank=rank, world_size=world_size, job_id="liveness"
    )
    optimizer = torch.optim.SGD(ddp.parameters(), lr=1e-3)
    began = time.monotonic()
    for step in range(steps):
        started = time.monotonic()
        inputs = torch.randn(8, width)
        loss = ddp(inputs).square().mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        line = {"rank": rank, "step": step, "seconds": time.monotonic() - started}
        print(json.dumps({**line, "since_start": time.monotonic() - began}), flush=True)
    ddp.close()
    return 0


def _sample_send_queues(
    cluster: Cluster, hosts: list[str], peer: str, stop: threading.Event, sink: IO[str]
) -> dict[str, int]:
    """Every second, each host's bytes queued in its sockets to `peer` (`ss` Send-Q); the
    largest seen per host. A heartbeat written behind them waits for all of them."""
    largest = dict.fromkeys(hosts, 0)
    while not stop.wait(1.0):
        for host in hosts:
            argv = cluster.command(host, ["ss", "-tnH", "dst", peer])
            try:
                shown = subprocess.run(argv, capture_output=True, text=True, timeout=5).stdout
            except (OSError, subprocess.TimeoutExpired):
                continue
            queued = sum(int(line.split()[2]) for line in shown.splitlines() if line.strip())
            largest[host] = max(largest[host], queued)
            sink.write(f"{time.strftime('%H:%M:%S')} {host} send-queue {queued}\n")
        sink.flush()
    return largest


def _drain(stream: IO[str], sink: IO[str], declared: dict[int, float] | None = None) -> None:
    """Copy a process's output to `sink`, stamped; the first time each rank was declared dead
    goes into `declared` (monotonic seconds)."""
    for line in stream:
        sink.write(f"{time.strftime('%H:%M:%S')} {line}")
        sink.flush()
        found = DECLARED.search(line) if declared is not None else None
        if found is not None and declared is not None:
            declared.setdefault(int(found.group(1)), time.monotonic())


class _Freezer:
    """Stops one rank's process with SIGSTOP `delay_s` after its log shows `after_step` done
    (in the middle of the next step's upload), and remembers when."""

    def __init__(self, rank: int, after_step: int, delay_s: float = 1.0) -> None:
        self.rank = rank
        self.after_step = after_step
        self.delay_s = delay_s
        self.process: subprocess.Popen[str] | None = None
        self.frozen_at: float | None = None

    def watch(self, path: Path, stop: threading.Event) -> None:
        while not stop.wait(0.05) and self.frozen_at is None:
            text = path.read_text(errors="replace") if path.exists() else ""
            done = f'"step": {self.after_step},'
            if self.process is not None and done in text:
                stop.wait(self.delay_s)
                self.process.send_signal(signal.SIGSTOP)
                self.frozen_at = time.monotonic()


def _wait_all(processes: list[subprocess.Popen[str]], timeout_s: float) -> list[int | None]:
    """Exit codes (None: still running when `timeout_s` ran out)."""
    deadline = time.monotonic() + timeout_s
    codes: list[int | None] = []
    for process in processes:
        try:
            codes.append(process.wait(timeout=max(1.0, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            codes.append(None)
    return codes


def reproduce(
    rate_mbit: float,
    delay_ms: float | None,
    world_size: int,
    steps: int,
    out: Path,
    timeout_s: float,
    *,
    freeze: int | None = None,
    width: int = WIDTH,
    serve_args: tuple[str, ...] = (),
) -> dict[str, object]:
    """Run the job once on a fresh cluster; the summary (logs in `out`)."""
    out.mkdir(parents=True, exist_ok=True)
    hosts = ["coord", *(f"w{rank}" for rank in range(world_size))]
    began = time.monotonic()
    with Cluster(hosts, LinkShape(rate_mbit=rate_mbit, delay_ms=delay_ms)) as cluster:
        ip = cluster.address("coord")
        launch = on_host(cluster, "coord", coordinator=True)
        # `start_coordinator` adds only --host, --port, --log-level WARNING and a 1 s shutdown
        # grace to `gradsync serve --world-size W`: the liveness settings stay at defaults.
        server, port = start_coordinator(
            world_size, *serve_args, launch=launch, host=ip, port=LEADER_PORT, forward_log=False
        )
        server_log = (out / "coordinator.log").open("w")
        declared: dict[int, float] = {}
        if server.stderr is not None:  # on_host pipes it
            drain_args = (server.stderr, server_log, declared)
            threading.Thread(target=_drain, args=drain_args, daemon=True).start()
        freezer = _Freezer(freeze, after_step=0) if freeze is not None else None
        ranks: list[subprocess.Popen[str]] = []
        logs = []
        for rank in range(world_size):
            log = (out / f"rank{rank}.log").open("w")
            logs.append(log)
            argv = [sys.executable, "-m", "gradsync_bench.wan_liveness", "--worker"]
            argv += ["--coordinator", f"{ip}:{port}", "--rank", str(rank)]
            argv += ["--world", str(world_size), "--steps", str(steps), "--width", str(width)]
            ranks.append(on_host(cluster, f"w{rank}", stdout=log, stderr=subprocess.STDOUT)(argv))
        stop = threading.Event()
        if freezer is not None:
            freezer.process = ranks[freezer.rank]
            watch_args = (out / f"rank{freezer.rank}.log", stop)
            threading.Thread(target=freezer.watch, args=watch_args, daemon=True).start()
        largest: dict[str, int] = {}
        workers = hosts[1:]
        with (out / "send-queues.txt").open("w") as queues:
            sampler = threading.Thread(
                target=lambda: largest.update(
                    _sample_send_queues(cluster, workers, ip, stop, queues)
                ),
                daemon=True,
            )
            sampler.start()
            if freezer is not None:
                # The frozen rank never exits by itself: wait for the others, then end it.
                others = [p for rank, p in enumerate(ranks) if rank != freezer.rank]
                _wait_all(others, timeout_s - (time.monotonic() - began))
                deadline = time.monotonic() + 30
                while freezer.rank not in declared and time.monotonic() < deadline:
                    time.sleep(0.1)
                ranks[freezer.rank].kill()
            codes = _wait_all(ranks, timeout_s - (time.monotonic() - began))
            stop.set()
            sampler.join(timeout=30)
        for log in logs:
            log.close()
        server.terminate()
        server.wait(timeout=30)
        server_log.close()
    found: dict[str, list[str]] = {}
    steps_done: dict[int, int] = {}
    for path in sorted(out.glob("*.log")):
        lines = path.read_text(errors="replace").splitlines()
        found[path.name] = [line for line in lines if DEAD.search(line)][:20]
        for line in lines:
            if line.startswith('{"rank"'):
                record = json.loads(line)
                steps_done[record["rank"]] = record["step"] + 1
    frozen: dict[str, object] | None = None
    if freezer is not None:
        at, dead = freezer.frozen_at, declared.get(freezer.rank)
        frozen = {
            "rank": freezer.rank,
            "after_step": freezer.after_step,
            "frozen": at is not None,
            "dead_after_s": round(dead - at, 2) if at is not None and dead is not None else None,
        }
    return {
        "rate_mbit": rate_mbit,
        "link_delay_ms": delay_ms,
        "rtt_ms": 4 * (delay_ms or 0.0),
        "world_size": world_size,
        "model_mib": round((width * width + width) * 4 / 2**20, 2),
        "serve_args": list(serve_args),
        "steps": steps,
        "exit_codes": codes,
        "steps_done": steps_done,
        "seconds": round(time.monotonic() - began, 1),
        "largest_send_queue_bytes": largest,
        "declared_dead": sorted(declared, key=declared.__getitem__),  # in that order
        "freeze": frozen,
        "dead_lines": found,
    }


def main(argv: list[str] | None = None) -> int:
    """`python -m gradsync_bench.wan_liveness`: run the reproduction (or one rank of it)."""
    parser = argparse.ArgumentParser(prog="python -m gradsync_bench.wan_liveness")
    parser.add_argument("--rate-mbit", type=float, default=20.0)
    parser.add_argument("--delay-ms", type=float, default=50.0, help="one-way delay per link")
    parser.add_argument("--world", type=int, default=3)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--timeout-s", type=float, default=900.0)
    parser.add_argument("--out", type=Path, default=Path("/tmp/gradsync-liveness"))
    parser.add_argument("--freeze", type=int, default=None, help="SIGSTOP this rank in step 1")
    parser.add_argument("--width", type=int, default=WIDTH, help="model: width x width + width")
    parser.add_argument("--serve-arg", action="append", default=[], help="a gradsync serve flag")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--coordinator", default="", help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return worker(args.coordinator, args.rank, args.world, args.steps, args.width)
    ok, reason = delay_available()
    if not ok:
        print(f"wan_liveness: cannot run here: {reason}", file=sys.stderr)
        return 2
    summary = reproduce(
        args.rate_mbit,
        args.delay_ms,
        args.world,
        args.steps,
        args.out,
        args.timeout_s,
        freeze=args.freeze,
        width=args.width,
        serve_args=tuple(args.serve_arg),
    )
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
