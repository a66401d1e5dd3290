"""The netns suite: one sync on an emulated cluster, per coordinator layout, against its bound.

Every host is a network namespace whose link is shaped to B in each direction
(`gradsync_bench.netns`). The coordinator's bytes are placed three ways:

- `single`: one coordinator host (S = 1) and W worker hosts; it carries W·N in and W·N out.
- `dedicated`: S shard hosts besides the W worker hosts; the leader (shard 0) runs on the
  first of them with `serve --wait-for-shards S-1`, shard i with `gradsync shard --leader`.
  Each shard host carries W·N/S each way and each worker N: max(1, W/S)·N/B.
- `colocated`: no extra hosts; the leader runs on worker host 0, shard i on worker host i
  (S <= W). A host with a shard receives (W-1)·N/S from the other workers for its range plus
  (S-1)·N/S of averages from the other shards: max(1, (W+S-2)/S)·N/B, the ring's bound at S = W.

gloo's ring all-reduce runs in the same worker processes, alternating with gradsync, with
its bound 2(W-1)/W·N/B (the cost model in ARCHITECTURE.md). Rows report both times, both
bounds, the CPU time of every process (workers, leader, shards) and gradsync / gloo.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from gradsync_proto.auth import ENV_SHARD_TOKEN, ENV_SHARD_TOKEN_FILE, ENV_TOKEN, ENV_TOKEN_FILE
from gradsync_proto.net.launch import Launcher, start_coordinator

from gradsync_bench.netns import Cluster
from gradsync_bench.netns_probe import available
from gradsync_bench.netns_shaping import LinkShape
from gradsync_bench.procs import flag_args, progress, stop_process
from gradsync_bench.suites import MIB, Row, run_sync_workers
from gradsync_bench.wire_report import DDP_BF16

#: The coordinator layouts the netns suite knows, in table order.
LAYOUTS = ("single", "dedicated", "colocated")
#: Fixed ports are fine inside the namespaces: every host has its own port space.
LEADER_PORT = 50051
#: A shard's port; differs from the leader's, which shares worker host 0 when colocated.
SHARD_PORT = 50052
GLOO_PORT = 29500
#: Setup allowance per row on top of the transfers: W+S Python processes importing torch
#: and gRPC on two cores, the gloo rendezvous and the job's assembly.
STARTUP_ALLOWANCE_S = 180.0


def ring_factor(world_size: int) -> float:
    """gloo's ring all-reduce bound in units of N/B: 2(W-1)/W."""
    return 2 * (world_size - 1) / world_size


@dataclass(frozen=True)
class Topology:
    """Which emulated host runs what, for one layout, W workers and S shards."""

    layout: str
    world_size: int
    shards: int

    def __post_init__(self) -> None:
        if self.layout not in LAYOUTS:
            raise ValueError(f"unknown layout {self.layout!r}; choose from {', '.join(LAYOUTS)}")
        if self.world_size < 1 or self.shards < 1:
            raise ValueError(f"W and S must be >= 1, got W={self.world_size}, S={self.shards}")
        if self.layout == "single" and self.shards != 1:
            raise ValueError(f"the single layout has one coordinator, not S={self.shards}")
        if self.layout == "colocated" and self.shards > self.world_size:
            raise ValueError(
                f"colocated puts shard i on worker host i: S={self.shards} > W={self.world_size}"
            )

    @property
    def worker_hosts(self) -> list[str]:
        return [f"w{rank}" for rank in range(self.world_size)]

    @property
    def shard_hosts(self) -> list[str]:
        """The host of shard i, i = 0..S-1 (shard 0 = the leader)."""
        if self.layout == "single":
            return ["coord"]
        if self.layout == "dedicated":
            return [f"s{index}" for index in range(self.shards)]
        return self.worker_hosts[: self.shards]

    @property
    def hosts(self) -> list[str]:
        return [*(h for h in self.shard_hosts if h not in self.worker_hosts), *self.worker_hosts]

    def bound_factor(self) -> float:
        """gradsync's bandwidth bound in units of N/B (see the module docstring)."""
        w, s = self.world_size, self.shards
        if self.layout == "single":
            return float(w)
        if self.layout == "dedicated":
            return max(1.0, w / s)
        return max(1.0, (w + s - 2) / s)


def topologies(
    layouts: Sequence[str], worlds: Sequence[int], shards: Sequence[int]
) -> list[Topology]:
    """Every (layout, W, S) to measure; no `shards` means S = W; colocated keeps S <= W."""
    found = []
    for layout in layouts:
        for world_size in worlds:
            if layout == "single":
                counts = [1]
            else:
                counts = list(shards) or [world_size]
                if layout == "colocated":
                    counts = [s for s in counts if s <= world_size]
            found += [Topology(layout, world_size, count) for count in counts]
    return found


#: The token of this benchmark run's emulated hosts (see `on_host`).
_BENCH_TOKEN = secrets.token_urlsafe(32)
#: The shard token of this run: the leader and its shards have it, the workers do not.
_BENCH_SHARD_TOKEN = secrets.token_urlsafe(32)


def on_host(cluster: Cluster, host: str, coordinator: bool = False, **kwargs: Any) -> Launcher:
    """A launcher that runs a command on one emulated host (`coordinator`: the leader or a
    shard, which also get the shard token)."""
    # gloo finds its own address through the hostname, which names the
    # machine's real interface; inside a namespace only eth0 exists. The leader, its
    # shards and the workers listen beyond loopback, so they share a token (protected
    # mode refuses to listen there without one); it travels in the environment only.
    env = dict(os.environ, GLOO_SOCKET_IFNAME="eth0")
    env.pop(ENV_TOKEN_FILE, None)
    env.setdefault(ENV_TOKEN, _BENCH_TOKEN)
    env.pop(ENV_SHARD_TOKEN_FILE, None)
    if coordinator:
        env.setdefault(ENV_SHARD_TOKEN, _BENCH_SHARD_TOKEN)
    kwargs.setdefault("stderr", subprocess.PIPE)
    return lambda argv: cluster.popen(host, argv, text=True, env=env, **kwargs)


def shard_command(leader: str, host: str, port: int) -> list[str]:
    """`gradsync shard` registering with `leader`, serving workers at host:port.

    `--advertise` names the shard's own host: by default a shard advertises ":PORT", the
    host workers reach the leader at, which is another host here.
    """
    return [
        *(sys.executable, "-m", "gradsync.cli", "--log-level", "WARNING", "shard"),
        *flag_args(leader=leader, host=host, port=port, advertise=f"{host}:{port}"),
    ]


def _drain(stream: IO[str], into: list[str]) -> None:
    """Keep reading a log pipe so it never fills and blocks its writer; keep the lines."""
    for line in stream:
        into.append(line)
        del into[:-200]


@contextlib.contextmanager
def running_coordinator(
    cluster: Cluster, topology: Topology, workdir: Path, serve_args: Sequence[str] = ()
) -> Iterator[tuple[str, list[int]]]:
    """Start the leader and its shards on their hosts; yield (leader address, their pids).

    `serve_args` go to the leader's `gradsync serve` (e.g. a longer --heartbeat-timeout).

    The shards start right after the leader process (before its banner), so their first
    registration attempt usually finds it listening. Their logs go to workdir/shard-<i>.log
    and are quoted when something fails.
    """
    leader_host = topology.shard_hosts[0]
    leader_ip = cluster.address(leader_host)
    shards: list[subprocess.Popen[str]] = []
    logs: list[IO[str]] = []

    def launch_leader(argv: list[str]) -> subprocess.Popen[str]:
        leader = on_host(cluster, leader_host, coordinator=True)(argv)
        for index, host in enumerate(topology.shard_hosts[1:], start=1):
            log = (workdir / f"shard-{index}.log").open("w")
            logs.append(log)
            argv = shard_command(f"{leader_ip}:{LEADER_PORT}", cluster.address(host), SHARD_PORT)
            shards.append(on_host(cluster, host, True, stderr=log, stdout=log)(argv))
        return leader

    wait = ("--wait-for-shards", str(topology.shards - 1)) if topology.shards > 1 else ()
    leader_log: list[str] = []
    leader: subprocess.Popen[str] | None = None
    try:
        leader, port = start_coordinator(
            topology.world_size,
            *wait,
            *serve_args,
            launch=launch_leader,
            host=leader_ip,
            port=LEADER_PORT,
            forward_log=False,
        )
        assert leader.stderr is not None
        threading.Thread(target=_drain, args=(leader.stderr, leader_log), daemon=True).start()
        yield f"{leader_ip}:{port}", [leader.pid, *(shard.pid for shard in shards)]
    except Exception as exc:
        exc.add_note("leader log (last lines):\n" + "".join(leader_log[-30:]))
        for log in logs:
            log.flush()
            exc.add_note(f"{Path(log.name).name}:\n" + Path(log.name).read_text()[-2000:])
        raise
    finally:
        for process in [*shards, *([leader] if leader is not None else [])]:
            stop_process(process)
        for log in logs:
            log.close()


def measure(
    cluster: Cluster,
    topology: Topology,
    megabytes: float,
    reps: int,
    rate_mbit: float,
    wires: Sequence[str] = (),
) -> Row:
    """One row: gradsync and gloo on `cluster` (built for `topology`), against their bounds.

    Each of `wires` ("bf16", "fp16") is one more gradsync job with that wire dtype; with
    any, torch DDP's bf16 hook over gloo ("ddp-bf16") is timed too (`wire_report`).
    """
    methods = ("gradsync", *wires, *((DDP_BF16,) if wires else ()))
    link_s = megabytes * MIB / (rate_mbit * 1e6 / 8)  # N/B
    w = topology.world_size
    transfers_s = (reps + 1) * (topology.bound_factor() + ring_factor(w)) * link_s * len(methods)
    with (
        tempfile.TemporaryDirectory() as scratch,
        running_coordinator(cluster, topology, Path(scratch)) as (address, pids),
    ):
        result = run_sync_workers(
            w,
            megabytes,
            reps,
            workdir=Path(scratch),
            address=address,
            gloo=f"{cluster.address('w0')}:{GLOO_PORT}",
            launchers=[on_host(cluster, host) for host in topology.worker_hosts],
            server_pids=pids,
            methods=methods,
            # Three times the bound covers a slow link; the allowance covers the setup.
            timeout_s=STARTUP_ALLOWANCE_S + 3 * transfers_s,
        )
    gradsync_ms, gloo_ms = result["gradsync"]["median_ms"], result["gloo"]["median_ms"]
    gradsync_bound_ms = topology.bound_factor() * link_s * 1e3
    gloo_bound_ms = ring_factor(w) * link_s * 1e3
    return {
        "layout": topology.layout,
        "world_size": w,
        "shards": topology.shards,
        "megabytes": megabytes,
        "reps": reps,
        "rate_mbit": rate_mbit,
        **result,
        "link_ms": link_s * 1e3,
        "gloo_bound_ms": gloo_bound_ms,
        "gradsync_bound_ms": gradsync_bound_ms,
        "gloo_of_bound": gloo_bound_ms / gloo_ms,
        "gradsync_of_bound": gradsync_bound_ms / gradsync_ms,
        "gradsync_to_gloo": gradsync_ms / gloo_ms,
    }


def netns_suite(
    worlds: Sequence[int],
    sizes_mb: Sequence[float],
    reps: int,
    rate_mbit: float,
    layouts: Sequence[str] = ("single",),
    shards: Sequence[int] = (),
    wires: Sequence[str] = (),
) -> tuple[list[Row], str]:
    """Suite (c): every layout x W x S x N on an emulated cluster.

    One cluster per (layout, W, S), reused for every N. Returns (rows, reason); rows are
    empty and reason says why when namespaces cannot be built here.
    """
    ok, reason = available()
    if not ok:
        return [], reason
    rows = []
    for topology in topologies(layouts, worlds, shards):
        progress(f"  netns {topology.layout} W={topology.world_size} S={topology.shards} ...")
        with Cluster(topology.hosts, LinkShape(rate_mbit=rate_mbit)) as cluster:
            rows += [measure(cluster, topology, mb, reps, rate_mbit, wires) for mb in sizes_mb]
    return rows, ""
