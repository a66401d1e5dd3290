"""The netns suite's hierarchy rows: H hosts of R ranks each, flat vs hierarchical gradsync.

Every host is a network namespace whose link is shaped to B each way
(`gradsync_bench.netns`); a coordinator host holds `gradsync serve`, and host h
runs ranks h·R .. h·R+R-1. Each sync worker times, alternately, a flat gradsync
job (every rank uploads N and receives N), a hierarchical one (the R ranks of a
host sum in shared memory; only the local leader uploads N and receives the
average) and gloo's ring `all_reduce`, and reads its namespace's eth0 byte
counters around each, so a row holds the bytes each host link carried per sync
as well as the times. Stock torch DDP over the c10d backend "gradsync" joins
the rotation ("ddp-backend", at the backend's default layout: with two ranks on a
host, a host group per host), timed against the hierarchical wrapper, the
wrapper's own layout on these hosts.

Bounds, in units of N/B (the coordinator's link is the bottleneck of a star):
flat W·N/B (one contribution per rank in, one average per rank out),
hierarchical H·N/B (one contribution per host), gloo's ring 2(W-1)/W·N/B. The
backend's bound is the hierarchical one: an all-reduce its host groups do not
take (above their size cap) goes flat, W·N/B, which its link bytes show.
"""

from __future__ import annotations

import statistics
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from gradsync_bench.netns import Cluster
from gradsync_bench.netns_commands import HOST_IFNAME
from gradsync_bench.netns_probe import available
from gradsync_bench.netns_shaping import LinkShape
from gradsync_bench.procs import progress
from gradsync_bench.sharded import (
    GLOO_PORT,
    STARTUP_ALLOWANCE_S,
    Topology,
    on_host,
    ring_factor,
    running_coordinator,
)
from gradsync_bench.suites import MIB, Row, read_sync_records, run_sync_workers
from gradsync_bench.sync_worker import DDP_BACKEND

#: The timed methods of a row: flat gradsync, hierarchical gradsync, stock DDP over the
#: backend, gloo.
METHODS = ("gradsync", "hierarchical", DDP_BACKEND, "gloo")


def host_of(rank: int, ranks_per_host: int) -> str:
    """The emulated host of `rank`: "h0" holds ranks 0..R-1, and so on."""
    return f"h{rank // ranks_per_host}"


def bytes_per_host(
    records: list[dict[str, list[dict[str, Any]]]], ranks_per_host: int
) -> dict[str, dict[str, dict[str, float]]]:
    """Median bytes per sync each host link carried, {method: {host: {"tx", "rx"}}}.

    The ranks of a host read the same counters between the same barriers, so the
    host's first rank speaks for it; tx is what the host sent (up), rx what it received.
    """
    found: dict[str, dict[str, dict[str, float]]] = {}
    for method in METHODS:
        found[method] = {}
        for first in range(0, len(records), ranks_per_host):
            reps = records[first][method]
            found[method][host_of(first, ranks_per_host)] = {
                direction: statistics.median(rep[f"link_{direction}"] for rep in reps)
                for direction in ("tx", "rx")
            }
    return found


def measure(
    cluster: Cluster,
    hosts: int,
    ranks_per_host: int,
    megabytes: float,
    reps: int,
    rate_mbit: float,
) -> Row:
    """One row: flat, hierarchical, the backend and gloo on `cluster`, times against bounds,
    link bytes."""
    world_size = hosts * ranks_per_host
    link_s = megabytes * MIB / (rate_mbit * 1e6 / 8)  # N/B
    bound_factors = {
        "gradsync": float(world_size),
        "hierarchical": float(hosts),
        DDP_BACKEND: float(hosts),
        "gloo": ring_factor(world_size),
    }
    # The backend's buckets above the host groups' cap travel flat: time allowed for that.
    transfers_s = (reps + 1) * (sum(bound_factors.values()) + world_size) * link_s
    topology = Topology("single", world_size, 1)
    with tempfile.TemporaryDirectory() as scratch:
        with running_coordinator(cluster, topology, Path(scratch)) as (address, pids):
            result = run_sync_workers(
                world_size,
                megabytes,
                reps,
                workdir=Path(scratch),
                address=address,
                gloo=f"{cluster.address('h0')}:{GLOO_PORT}",
                launchers=[
                    on_host(cluster, host_of(rank, ranks_per_host)) for rank in range(world_size)
                ],
                server_pids=pids,
                timeout_s=STARTUP_ALLOWANCE_S + 3 * transfers_s,
                methods=METHODS[:3],
                link_stats=HOST_IFNAME,
            )
        link_bytes = bytes_per_host(read_sync_records(Path(scratch), world_size), ranks_per_host)
    row: Row = {
        "layout": "hosts",
        "hosts": hosts,
        "ranks_per_host": ranks_per_host,
        "world_size": world_size,
        "megabytes": megabytes,
        "reps": reps,
        "rate_mbit": rate_mbit,
        **result,
        "link_ms": link_s * 1e3,
        "link_bytes": link_bytes,
    }
    for method, factor in bound_factors.items():
        bound_ms = factor * link_s * 1e3
        key = method.replace("-", "_")
        row[f"{key}_bound_ms"] = bound_ms
        row[f"{key}_of_bound"] = bound_ms / result[method]["median_ms"]
    # The busiest host link's bytes, hierarchical over flat (1/R when only leaders talk).
    row["hierarchical_to_flat_bytes"] = max(
        link_bytes["hierarchical"][host][direction] / link_bytes["gradsync"][host][direction]
        for host in link_bytes["gradsync"]
        for direction in ("tx", "rx")
    )
    row["hierarchical_to_flat_time"] = (
        result["hierarchical"]["median_ms"] / result["gradsync"]["median_ms"]
    )
    # Speed (syncs per second) of stock DDP over the backend over the wrapper's, same layout.
    row["backend_to_wrapper"] = (
        result["hierarchical"]["median_ms"] / result[DDP_BACKEND]["median_ms"]
    )
    return row


def hierarchy_suite(
    sizes_mb: Sequence[float],
    reps: int,
    rate_mbit: float,
    hosts: int = 2,
    ranks_per_host: int = 2,
) -> tuple[list[Row], str]:
    """Rows for `hosts` x `ranks_per_host` on one emulated cluster, one per N.

    Returns (rows, reason); rows are empty and reason says why when namespaces cannot
    be built here.
    """
    ok, reason = available()
    if not ok:
        return [], reason
    progress(f"  netns hierarchy {hosts} hosts x {ranks_per_host} ranks ...")
    names = ["coord", *(f"h{index}" for index in range(hosts))]
    with Cluster(names, LinkShape(rate_mbit=rate_mbit)) as cluster:
        rows = [
            measure(cluster, hosts, ranks_per_host, megabytes, reps, rate_mbit)
            for megabytes in sizes_mb
        ]
    return rows, ""
