"""Profile single rows of the wan suite (`python -m gradsync_bench.wan_profile`, as root).

One cluster of emulated hosts on one link (rate, one-way delay, optionally a faster
coordinator host), then each chosen method once, as `gradsync_bench.wan` runs it, with
py-spy sampling the coordinator (`gradsync serve`) and the chosen ranks during the timed
window only: the samplers start when every rank passed the start barrier and stop (SIGINT,
which makes py-spy write what it has) when every rank wrote its end marker. Samples are
taken with `--idle --threads --nonblocking` in py-spy's raw (collapsed) format: one line
per distinct stack, its sample count last; at `--hz` samples a second a count is
count / hz seconds of that thread.

Written into `--out`: `<run>.json` (the ranks' records, with each round's timeline:
upload start and answer, seconds from the window's start) and `<run>-<process>.raw`
(py-spy's output), where a run is the method's name, with "-2", "-3", ... when it runs
again; `rows.json` holds every run's summary row. `gradsync_bench.wan_profile_report` reads them.

Everything it builds (namespaces, veths, the delay line, the processes on the hosts, the
samplers) is torn down on the way out, also on failure.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from gradsync_bench import wan
from gradsync_bench.netns import Cluster
from gradsync_bench.netns_shaping import LinkShape
from gradsync_bench.procs import progress, wait_ranks
from gradsync_bench.sharded import GLOO_PORT, Topology, on_host, running_coordinator
from gradsync_bench.torchft_wan import lighthouse
from gradsync_bench.wan_worker import METHODS, Method

#: How long the samplers wait for the ranks to reach the start barrier, and to finish.
WINDOW_TIMEOUT_S = 1800.0
#: How long a sampler gets to write its output after SIGINT.
SAMPLER_STOP_S = 30.0


class Samplers:
    """py-spy on some processes during the ranks' timed window (a thread watches the
    barrier files in the shared work folder)."""

    def __init__(
        self, py_spy: str, hz: int, workdir: Path, method: str, world_size: int, out: Path
    ) -> None:
        self.py_spy, self.hz, self.workdir = py_spy, hz, workdir
        self.method, self.world_size, self.out = method, world_size, out
        self.run = method  # the output files' stem
        self.targets: dict[str, int] = {}
        self.running: list[subprocess.Popen[bytes]] = []
        self.window: tuple[float, float] | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def start(self, targets: dict[str, int]) -> None:
        self.targets = targets
        self._thread.start()

    def _all(self, marker: str) -> bool:
        return all(
            (self.workdir / f"{self.method}-{marker}.{r}").exists() for r in range(self.world_size)
        )

    def _wait_for(self, marker: str) -> bool:
        deadline = time.monotonic() + WINDOW_TIMEOUT_S
        while not self._all(marker):
            if self._stop.is_set() or time.monotonic() > deadline:
                return False
            time.sleep(0.02)
        return True

    def _watch(self) -> None:
        if not self._wait_for("start"):
            return
        began = time.monotonic()
        for name, pid in self.targets.items():
            argv = [
                *(self.py_spy, "record", "--pid", str(pid), "--rate", str(self.hz)),
                *("--idle", "--threads", "--nonblocking", "--format", "raw"),
                *("--output", str(self.out / f"{self.run}-{name}.raw")),
            ]
            self.running.append(
                subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
            )
        if self._wait_for("end"):
            self.window = (began, time.monotonic())
        self._halt()

    def _halt(self) -> None:
        for sampler in self.running:
            if sampler.poll() is None:
                sampler.send_signal(signal.SIGINT)
        for sampler in self.running:
            try:
                sampler.wait(timeout=SAMPLER_STOP_S)
            except subprocess.TimeoutExpired:
                sampler.kill()
                sampler.wait(timeout=SAMPLER_STOP_S)

    def stop(self) -> None:
        """Stop watching and stop every sampler still running (idempotent)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=WINDOW_TIMEOUT_S)
        self._halt()


def profile_method(
    cluster: Cluster,
    plan: wan.WanPlan,
    method: Method,
    link: tuple[float, float | None, float | None],
    out: Path,
    py_spy: str,
    hz: int,
    ranks: list[int],
    run: str,
    topology: Topology,
) -> dict[str, Any]:
    """Run `method` once on `cluster` with samplers attached (its files named `run`); its
    summary row."""
    rate, delay, hub = link
    steps = plan.steps_of(method, rate, False)
    gloo = f"{cluster.address('w0')}:{GLOO_PORT}"
    progress(f"  profile {method.name}, {steps} steps ...")
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as scratch:
        workdir = Path(scratch)
        samplers = Samplers(py_spy, hz, workdir, method.name, plan.world_size, out)
        samplers.run = run

        def launch(coordinator: str, server_pid: int | None) -> None:
            processes = [
                on_host(cluster, host)(
                    wan._worker_argv(
                        plan, method, rank, steps, workdir, coordinator, gloo, cluster.address(host)
                    )
                )
                for rank, host in enumerate(topology.worker_hosts)
            ]
            targets = {f"rank{r}": processes[r].pid for r in ranks}
            if server_pid is not None:
                targets["coordinator"] = server_pid
            samplers.start(targets)
            timeout_s = wan._timeout_s(plan, method, steps, rate, delay)
            try:
                wait_ranks(
                    processes,
                    timeout_s,
                    lambda r, code, err: f"{method.name}: rank {r} failed ({code}): {err[-3000:]}",
                )
            finally:
                samplers.stop()

        if method.uses_coordinator:
            with running_coordinator(cluster, topology, workdir, wan.SERVE_ARGS) as (addr, pids):
                launch(addr, pids[0])
        elif method.uses_lighthouse:
            with lighthouse(cluster, topology.shard_hosts[0], plan.world_size) as addr:
                launch(addr, None)
        else:
            launch("", None)
        records = [
            json.loads((workdir / f"{method.name}-rank{r}.json").read_text())
            for r in range(plan.world_size)
        ]
    load = (load_before + os.getloadavg()[0]) / 2
    for record in records:
        record["load_average"] = load
    (out / f"{run}.json").write_text(json.dumps(records, indent=1) + "\n")
    row = wan.summarize(records, method, rate, False, delay, hub)
    row.pop("loss_curve")
    row["sampled_window_s"] = (
        samplers.window[1] - samplers.window[0] if samplers.window is not None else None
    )
    row["profiled"] = sorted(samplers.targets)
    row["run"] = run
    progress(
        f"    {row['seconds']:.1f} s timed, {row['samples_per_s']:.2f} samples/s, load {load:.1f}"
    )
    return row


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rate", type=float, required=True, help="Mbit/s of every link")
    parser.add_argument("--delay", type=float, default=0.0, help="one-way ms per link")
    parser.add_argument("--hub", type=float, default=0.0, help="coordinator host's Mbit/s")
    parser.add_argument("--methods", required=True, help="comma-separated wan methods, in order")
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument(
        "--layout",
        choices=["single", "colocated"],
        default="single",
        help="one coordinator host (the wan suite's), or S shards on the first S worker hosts",
    )
    parser.add_argument("--shards", type=int, default=1, help="S (colocated)")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--ranks", default="0", help="comma-separated ranks to sample")
    parser.add_argument("--hz", type=int, default=100)
    parser.add_argument("--py-spy", default="py-spy")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    methods = [METHODS[name] for name in args.methods.split(",")]
    plan = wan.WanPlan(world_size=args.world_size, steps=args.steps)
    link = (args.rate, args.delay or None, args.hub or None)
    args.out.mkdir(parents=True, exist_ok=True)
    topology = Topology(args.layout, args.world_size, args.shards)
    rows = []
    with Cluster(topology.hosts, LinkShape(rate_mbit=args.rate, delay_ms=link[1])) as cluster:
        if link[2]:
            wan.shape_hub(cluster, topology.shard_hosts[0], link[2])
        ranks = [int(r) for r in args.ranks.split(",")]
        for index, method in enumerate(methods):
            # A method run again gets files of its own: "<method>-2", ...
            again = [m.name for m in methods[:index]].count(method.name)
            run = method.name + (f"-{again + 1}" if again else "")
            try:
                rows.append(
                    profile_method(
                        cluster,
                        plan,
                        method,
                        link,
                        args.out,
                        args.py_spy,
                        args.hz,
                        ranks,
                        run,
                        topology,
                    )
                )
            except (RuntimeError, TimeoutError, OSError) as exc:
                progress(f"    failed: {str(exc)[-800:]}")
                rows.append({"method": method.name, "error": str(exc)[-3000:]})
    summary = {
        "link": {"rate_mbit": link[0], "delay_ms": link[1], "hub_mbit": link[2]},
        "layout": args.layout,
        "shards": args.shards,
        "hz": args.hz,
        "rows": rows,
    }
    (args.out / "rows.json").write_text(json.dumps(summary, indent=1) + "\n")


if __name__ == "__main__":
    main()
