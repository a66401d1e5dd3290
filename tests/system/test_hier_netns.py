"""Hierarchical aggregation across real (emulated) hosts: 2 hosts x 2 ranks in network namespaces.

Each host is a network namespace, so the ranks find their host without
`$GRADSYNC_HOST_ID` (the host identity includes the network namespace) and each
host's traffic crosses its own veth. Every rank runs a hierarchical job, then a
flat one, then the same training as stock DDP over the c10d backend "gradsync" at
its default layout (torch imported once), training a model whose gradients (2.4 MB a
rank) dwarf the protocol's other bytes; each rank reads its host's eth0 byte
counters after a barrier that follows construction and after the last step.
Hierarchical and the backend must train as flat (1e-6 relative) and each host link must
carry about half the flat layout's bytes each way: one contribution per host up,
one average per host down, instead of one per rank (the backend's host groups, found
the same way, take DDP's buckets of this model).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from gradsync_bench.netns import Cluster
from gradsync_bench.netns_commands import HOST_IFNAME
from support.components import netns_available
from support.faults import HEARTBEAT
from support.hierarchy import (
    assert_ranks_identical,
    finish,
    max_relative_difference,
    run_of,
    start_job,
)

WORLD = 4
HOSTS = ("h0", "h0", "h1", "h1")  # rank -> host
STEPS = 6
WIDTH = 20_000  # (24 + 1 + 5) x 20000 float32 parameters: 2.4 MB of gradients per rank
HIER, FLAT, BACKEND = 0, 1, 2
PORT = 50051


@pytest.fixture(autouse=True)
def _require_netns() -> None:
    ok, reason = netns_available()
    if not ok:
        pytest.skip(reason)


def host_bytes(runs: list[dict[str, Any]], host: str) -> dict[str, int]:
    """tx/rx bytes of `host`'s link over the training window of its ranks' runs.

    Both ranks of a host read the same counters; the window runs from the earlier
    start (after the barrier: every rank constructed; the other rank may already be
    uploading) to the later end (every average received).
    """
    mine = [run for rank, run in enumerate(runs) if HOSTS[rank] == host]
    return {
        direction: max(r["link_end"][direction] for r in mine)
        - min(r["link_start"][direction] for r in mine)
        for direction in ("tx", "rx")
    }


@pytest.mark.timeout(180)
def test_two_hosts_of_two_ranks_train_as_flat_with_half_the_bytes_per_host(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Beyond loopback a coordinator needs a token; every process inherits this one.
    monkeypatch.delenv("GRADSYNC_TOKEN_FILE", raising=False)
    monkeypatch.setenv("GRADSYNC_TOKEN", "hierarchy-netns-test-token")
    with Cluster(["coord", "h0", "h1"]) as cluster:
        cluster.popen(
            "coord",
            [
                sys.executable,
                "-m",
                "gradsync.cli",
                "serve",
                "--world-size",
                str(WORLD),
                "--host",
                "0.0.0.0",
                "--port",
                str(PORT),
                *HEARTBEAT,
            ],
            stderr=subprocess.DEVNULL,
        )
        out = tmp_path / "netns"
        processes = start_job(
            f"{cluster.address('coord')}:{PORT}",
            WORLD,
            out,
            "--runs",
            "hier,flat,backend",
            "--steps",
            str(STEPS),
            "--width",
            str(WIDTH),
            "--link-stats",
            HOST_IFNAME,
            "--timeout-s",
            "60",
            hosts=[None] * WORLD,  # the namespace is the host
            popen=lambda rank, argv, **kwargs: cluster.popen(HOSTS[rank], argv, **kwargs),
        )
        reports = finish(processes, out, timeout_s=150)
    hier, flat = run_of(reports, HIER, out), run_of(reports, FLAT, out)
    backend = run_of(reports, BACKEND, out)
    # Each namespace is a host: two local groups, found without $GRADSYNC_HOST_ID.
    assert [run["local_ranks"] for run in hier] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [run["local_ranks"] for run in backend] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert_ranks_identical(backend)
    assert max_relative_difference(backend[0], flat[0]) <= 1e-6
    assert all(run["local_ranks"] == [] for run in flat)
    assert_ranks_identical(hier)
    assert_ranks_identical(flat)
    difference = max_relative_difference(hier[0], flat[0])
    assert difference <= 1e-6, difference
    gradient_bytes = 4 * (24 * WIDTH + WIDTH + WIDTH * 5 + 5)
    for host in ("h0", "h1"):
        hier_bytes, flat_bytes = host_bytes(hier, host), host_bytes(flat, host)
        backend_bytes = host_bytes(backend, host)
        for direction in ("tx", "rx"):
            ratio = backend_bytes[direction] / flat_bytes[direction]
            print(f"{host} {direction}: stock DDP over gradsync / flat {ratio:.2f}")
            assert backend_bytes[direction] >= STEPS * gradient_bytes, (host, direction)
            assert 0.45 <= ratio <= 0.55, (host, direction, backend_bytes, flat_bytes)
            ratio = hier_bytes[direction] / flat_bytes[direction]
            print(
                f"{host} {direction}: hierarchical {hier_bytes[direction] / 1e6:.1f} MB, "
                f"flat {flat_bytes[direction] / 1e6:.1f} MB, ratio {ratio:.2f}"
            )
            # One rank's gradients a step, not two (plus headers, heartbeats, TCP acks).
            assert hier_bytes[direction] >= STEPS * gradient_bytes, (host, direction)
            assert flat_bytes[direction] >= 2 * STEPS * gradient_bytes, (host, direction)
            assert 0.45 <= ratio <= 0.55, (host, direction, hier_bytes, flat_bytes)
