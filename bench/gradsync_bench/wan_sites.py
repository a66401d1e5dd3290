"""The sites row of the slow-link scorecard: DiLoCo between sites with FSDP2 inside.

Three emulated hosts (network namespaces, `gradsync_bench.netns`), each link shaped to
B Mbit/s (100 by default): the coordinator host and two sites, each site two ranks on
one host, training the char transformer of `gradsync_bench.wan_task` with FSDP2 over
gloo inside the site (their traffic stays on the host). Methods
(`gradsync_bench.wan_sites_worker`): the no-sync reference (each site alone), per-step
HSDP (stock FSDP2 over gloo, a 2-D mesh whose replicate dimension crosses the slow
link), and `gradsync.DiLoCo(replica_group=...)` at H = 10 (fp32; int8 wire with int8
answers) through a coordinator on its own host.

The methods run interleaved (every method once, then again: `reps`), and each row's
utilization is its samples/s over the no-sync reference of the same repetition, so the
ratios compare runs made side by side on a machine that other jobs share. Bytes per
inner step are each site host's eth0 (up + down), mean over the two sites.

    python -m gradsync_bench.wan_sites --out results.json [--rate-mbit 100] [--reps 2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from gradsync_bench.netns import Cluster
from gradsync_bench.netns_probe import available
from gradsync_bench.netns_shaping import LinkShape
from gradsync_bench.procs import flag_args, progress, wait_ranks
from gradsync_bench.sharded import GLOO_PORT, Topology, on_host, running_coordinator
from gradsync_bench.wan_sites_worker import METHODS, PER_SITE, SITES

SITE_HOSTS = [f"site{s}" for s in range(SITES)]


def run_method(
    cluster: Cluster, method: str, steps: int, batch: int, workdir: Path
) -> list[dict[str, Any]]:
    """One run of `method` on the cluster; the four ranks' records."""
    kind = METHODS[method][0]

    def launch(coordinator: str) -> None:
        processes = []
        for site, host in enumerate(SITE_HOSTS):
            rendezvous = cluster.address("site0" if kind == "hsdp" else host)
            for site_rank in range(PER_SITE):
                argv = [
                    sys.executable,
                    "-m", "gradsync_bench.wan_sites_worker",
                    *flag_args(method=method, site=site, site_rank=site_rank, steps=steps),
                    *flag_args(batch=batch, coordinator=coordinator, workdir=workdir),
                    *flag_args(gloo=f"{rendezvous}:{GLOO_PORT}"),
                ]  # fmt: skip
                processes.append(on_host(cluster, host)(argv))
        wait_ranks(
            processes,
            600.0 + 10.0 * steps,
            lambda rank, code, err: f"{method}: rank {rank} failed (exit {code}): {err[-3000:]}",
            lambda rank: f"{method}: rank {rank} still running",
        )

    if kind == "diloco":
        topology = Topology("single", SITES, 1)
        with running_coordinator(cluster, topology, workdir) as (address, _):
            launch(address)
    else:
        launch("")
    return [
        json.loads((workdir / f"{method}-rank{rank}.json").read_text())
        for rank in range(SITES * PER_SITE)
    ]


def summarize(records: list[dict[str, Any]], rate_mbit: float, rep: int) -> dict[str, Any]:
    steps, batch = records[0]["steps"], records[0]["batch"]
    seconds = max(r["seconds"] for r in records)
    hosts = [r for r in records if r["site_rank"] == 0]  # a site's ranks share its eth0
    sent = [r["client_bytes_sent"] for r in records]
    return {
        "method": records[0]["method"],
        "rate_mbit": rate_mbit,
        "rep": rep,
        "sites": SITES,
        "ranks_per_site": PER_SITE,
        "steps": steps,
        "seconds": seconds,
        "samples_per_s": len(records) * batch * steps / seconds,
        "site_link_bytes_per_step": statistics.mean(r["link_tx"] + r["link_rx"] for r in hosts)
        / steps,
        "client_up_bytes_per_step_per_site": (
            sum(s for s in sent if s is not None) / SITES / steps if sent[0] is not None else None
        ),
        "parameter_bytes": records[0]["parameter_bytes"],
        "final_loss": statistics.mean(statistics.mean(r["losses"][-5:]) for r in records),
    }


def sites_suite(
    rate_mbit: float, reps: int, steps: int, sync_steps: int, batch: int
) -> list[dict[str, Any]]:
    ok, reason = available()
    if not ok:
        raise RuntimeError(f"network namespaces are not available here: {reason}")
    rows = []
    with Cluster(["coord", *SITE_HOSTS], LinkShape(rate_mbit=rate_mbit)) as cluster:
        for rep in range(reps):
            for method in METHODS:
                count = sync_steps if METHODS[method][0] == "hsdp" else steps
                progress(f"  sites {method} at {rate_mbit:g} Mbit/s, rep {rep}, {count} steps")
                began, load = time.monotonic(), os.getloadavg()[0]
                with tempfile.TemporaryDirectory() as scratch:
                    records = run_method(cluster, method, count, batch, Path(scratch))
                row = summarize(records, rate_mbit, rep)
                row["load_average"] = (load + os.getloadavg()[0]) / 2
                progress(f"    {time.monotonic() - began:.0f} s: {row['samples_per_s']:.2f}/s")
                rows.append(row)
    for row in rows:
        reference = [r for r in rows if r["method"] == "nosync" and r["rep"] == row["rep"]]
        hsdp = [r for r in rows if r["method"] == "hsdp-gloo" and r["rep"] == row["rep"]]
        row["utilization"] = row["samples_per_s"] / reference[0]["samples_per_s"]
        row["speedup_over_hsdp"] = row["samples_per_s"] / hsdp[0]["samples_per_s"]
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--rate-mbit", type=float, default=100.0)
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--sync-steps", type=int, default=4)
    parser.add_argument("--batch", type=int, default=4)
    args = parser.parse_args()
    rows = sites_suite(args.rate_mbit, args.reps, args.steps, args.sync_steps, args.batch)
    args.out.write_text(
        json.dumps(
            {
                "suite": "wan-sites",
                "note": "measured on a machine shared with other jobs (loadavg per row); "
                "methods interleaved, ratios within one repetition",
                "rows": rows,
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
