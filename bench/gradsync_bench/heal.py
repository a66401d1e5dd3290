"""The heal suite: how fast a restarted rank gets the live state, and what it costs the others.

A W-rank elastic job trains an MLP with Adam (state = parameters + both
moments, about `state_mb`); the last rank SIGKILLs itself, the others go on
without it, and a fresh process of that rank joins the live job and is healed
with the lowest live rank's state. Per (W, state size) it reports:

- `gb_per_s`: the state's bytes over the joiner's wall time from its Join to
  its first step ready (construction of `gradsync.DistributedDataParallel`,
  which joins and loads the module state, then `register_optimizer`, which
  loads the optimizer state). It includes the wait for the donor's next step
  boundary (at most one step; the steps here are short).
- `boundary_wait_s`, `heal_proper_s`, `heal_gb_per_s`: the same time cut in
  two: from the joiner's Join to the donor's step boundary (the donor
  finishing the step it was in: up to a step, whatever the state's size),
  and from that boundary to the joiner ready (offer relayed, connection,
  transfer, load), with the state's bytes over the latter.
- `blocked_s`: for each surviving rank, how much longer the step the joiner
  entered took than the median of the full-membership steps after it (from
  its second on; the worst of the survivors is reported): the time the
  others stood still for the healing.
- `transfer_s`: the donor's own timing of the direct transfer (first byte
  to last), without the Join and the wait for its step boundary.
- `path`: "grpc" (the state through the coordinator, as before the direct
  path; `$GRADSYNC_HEAL_CHANNEL=0`) or "direct", measured side by side.
- `interface`: how the bytes travelled.
- `bitwise`: every rank ended with the same parameter and optimizer digest.
"""

from __future__ import annotations

import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from gradsync_proto.net.launch import start_coordinator

from gradsync_bench.procs import kill_all, progress, stop_process, wait_until
from gradsync_bench.tables import table

MIB = 1 << 20
Row = dict[str, Any]
#: Elastic, with a short heartbeat timeout so that the killed rank is dropped quickly.
_SERVE_FLAGS: tuple[str, ...] = ("--on-failure", "elastic", "--min-workers", "1")
#: A joiner reading a GB through gRPC was declared dead at 2 s (fixed since: README, fault
#: tolerance); kept longer for a loaded host. The orchestrator waits this long for the
#: killed rank to be dropped.
_HEARTBEAT_TIMEOUT_S = 6.0
_SERVE_FLAGS += ("--heartbeat-interval", "0.25", "--heartbeat-timeout", f"{_HEARTBEAT_TIMEOUT_S:g}")
#: The victim dies before this step (the others are at full speed by then).
_DIE_AT = 3
#: How the state travels, per path (reported beside the figures).
INTERFACES = {
    "direct": "abstract Unix socket, donor -> joiner (raw tensors, read into the joiner's own "
    "parameters); the coordinator relays an offer",
    "grpc": "gRPC stream, donor -> coordinator -> joiner, 1 MiB chunks (raw state blob)",
}
#: The donor's log line of a direct transfer (`gradsync.control.heal_channel`).
_SENT = re.compile(r"heal offer: sent (\d+) bytes in ([0-9.]+) s")
#: The joiner's log line (with its timestamp, `heal_worker`'s log format) of its Join.
_JOINING = re.compile(r"^([0-9.]+) rank \d+: joining job", re.MULTILINE)
#: Steps every rank trains after the healed one (the typical full step is their median).
_STEPS_AFTER = 8


def _worker(
    address: str, rank: int, world: int, state_mb: float, role: str, workdir: Path, path: str
) -> subprocess.Popen[str]:
    argv = [sys.executable, "-m", "gradsync_bench.heal_worker", "--coordinator", address]
    argv += ["--rank", str(rank), "--world-size", str(world), "--state-mb", f"{state_mb:g}"]
    argv += ["--role", role, "--die-at", str(_DIE_AT), "--stop-file", str(workdir / "stop")]
    argv += ["--ready-file", str(workdir / "ready"), "--out", str(workdir / f"{role}{rank}.json")]
    env = dict(os.environ, GRADSYNC_HEAL_CHANNEL="1" if path == "direct" else "0")
    with (workdir / f"{role}{rank}.log").open("w") as log:  # the child keeps its own copy
        return subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, text=True, env=env)


def heal_once(
    world: int,
    state_mb: float,
    workdir: Path,
    path: str = "direct",
    timeout_s: float = 600.0,
    serve_flags: tuple[str, ...] = (),
) -> Row:
    """One healing of a W-rank job with about `state_mb` MiB of live state; its row.

    `path`: "direct" (the donor serves the joiner on loopback) or "grpc" (the
    state goes through the coordinator: `$GRADSYNC_HEAL_CHANNEL=0`).
    `serve_flags`: more `gradsync serve` flags (a test's small --max-outbox-mb).
    """
    budget_mb = max(2048.0, 4 * state_mb)
    coordinator, port = start_coordinator(
        world,
        *_SERVE_FLAGS,
        "--max-checkpoint-mb",
        f"{2 * state_mb:g}",
        "--max-buffered-mb",
        f"{budget_mb:g}",
        "--max-job-buffered-mb",
        f"{budget_mb:g}",
        *serve_flags,
    )
    address = f"127.0.0.1:{port}"
    processes: list[subprocess.Popen[str]] = []
    try:
        for rank in range(world):
            role = "victim" if rank == world - 1 else "member"
            processes.append(_worker(address, rank, world, state_mb, role, workdir, path))
        victim = processes[-1]
        late = f"within {timeout_s:g} s"
        wait_until(
            lambda: victim.poll() is not None, timeout_s, f"heal bench: no victim's death {late}"
        )
        # Its heartbeats stop: the coordinator drops it and the others go on.
        time.sleep(_HEARTBEAT_TIMEOUT_S + 0.5)
        joiner = _worker(address, world - 1, world, state_mb, "joiner", workdir, path)
        processes.append(joiner)
        ready = workdir / "ready"
        joined = f"heal bench: no joiner ready {late}"
        wait_until(lambda: ready.exists() and ready.read_text(), timeout_s, joined)
        start = json.loads(ready.read_text())["step"]
        (workdir / "stop").write_text(str(int(start) + _STEPS_AFTER))
        for process in [*processes[:-2], joiner]:
            process.wait(timeout=timeout_s)
            if process.returncode != 0:
                raise RuntimeError(f"heal bench: a worker failed; see the logs in {workdir}")
    finally:
        kill_all(processes)
        stop_process(coordinator)
        if coordinator.stderr is not None:
            coordinator.stderr.close()
    return _row(world, state_mb, workdir, path)


def _row(world: int, state_mb: float, workdir: Path, path: str) -> Row:
    """The figures of one healing, from the ranks' reports (wall clocks of one host)."""
    joiner = json.loads((workdir / f"joiner{world - 1}.json").read_text())
    members = [json.loads((workdir / f"member{r}.json").read_text()) for r in range(world - 1)]
    seconds = joiner["ready"] - joiner["join_started"]
    healed_step = joiner["start_step"]
    blocked = []
    for member in members:
        durations = {int(s): end - begin for s, begin, end, _ in member["steps"]}
        typical = statistics.median(
            end - begin
            for s, begin, end, contributors in member["steps"]
            if s > healed_step + 1 and contributors == world
        )
        blocked.append(durations[healed_step] - typical)
    # The donor (the lowest live rank, member 0) starts the healed step at its boundary.
    boundary = next(begin for s, begin, _, _ in members[0]["steps"] if s == healed_step)
    joining = _JOINING.search((workdir / f"joiner{world - 1}.log").read_text())
    join_sent = float(joining.group(1)) if joining else joiner["join_started"]
    proper = joiner["ready"] - boundary
    sent = _SENT.search((workdir / "member0.log").read_text())
    return {
        "world_size": world,
        "state_mb": state_mb,
        "state_bytes": joiner["state_bytes"],
        "heal_s": seconds,
        "gb_per_s": joiner["state_bytes"] / seconds / 1e9,
        "setup_s": join_sent - joiner["join_started"],
        "boundary_wait_s": boundary - join_sent,
        "heal_proper_s": proper,
        "heal_gb_per_s": joiner["state_bytes"] / proper / 1e9,
        "blocked_s": max(blocked),
        "median_step_s": statistics.median(
            end - begin for s, begin, end, _ in members[0]["steps"] if s > healed_step + 1
        ),
        "healed_at_step": healed_step,
        "path": path,
        # The donor's own timing of the direct transfer (None on the grpc path).
        "transfer_s": float(sent.group(2)) if sent else None,
        "interface": INTERFACES[path],
        "bitwise": len({m["digest"] for m in [*members, joiner]}) == 1,
    }


def _failed(world: int, state_mb: float, path: str, workdir: Path, exc: Exception) -> Row:
    """The row of a healing that failed: the error and each worker's last words."""
    last = {log.stem: log.read_text().strip().splitlines()[-1:] for log in workdir.glob("*.log")}
    return {"world_size": world, "state_mb": state_mb, "path": path, "error": str(exc), **last}


def heal_suite(
    worlds: Sequence[int], states_mb: Sequence[float], paths: Sequence[str] = ("grpc", "direct")
) -> list[Row]:
    """Every (W, state size, path) healing; one row each, the paths side by side."""
    rows = []
    for world in worlds:
        for state_mb in states_mb:
            for path in paths:
                progress(f"  heal W={world} state {state_mb:g} MiB via {path} ...")
                with tempfile.TemporaryDirectory(prefix="gradsync-heal-") as tmp:
                    try:
                        rows.append(heal_once(world, state_mb, Path(tmp), path))
                    except (RuntimeError, subprocess.TimeoutExpired) as exc:  # reported
                        rows.append(_failed(world, state_mb, path, Path(tmp), exc))
    return rows


def markdown_lines(rows: Sequence[Row]) -> list[str]:
    """The heal suite's table (nothing when it did not run)."""
    lines = []
    for r in rows:
        if "error" in r:
            failure = r.get(f"joiner{r['world_size'] - 1}", r["error"])
            lines.append(
                f"{r['world_size']} | {r['state_mb']:g} MiB | {r['path']} | failed: {failure}"
            )
            continue
        transfer = r["transfer_s"]
        moved = f"{transfer:.3f} ({r['state_bytes'] / transfer / 1e9:.2f})" if transfer else "-"
        lines.append(
            f"{r['world_size']} | {r['state_bytes'] / 1e6:.0f} | {r['path']} | "
            f"{r['heal_s']:.2f} ({r['gb_per_s']:.2f}) | {r['setup_s']:.2f} | "
            f"{r['boundary_wait_s']:.2f} | {r['heal_proper_s']:.2f} "
            f"({r['heal_gb_per_s']:.2f}) | {moved} | {r['blocked_s']:.2f} | "
            f"{r['median_step_s']:.3f} | {'yes' if r['bitwise'] else 'NO'} | {r['interface']}"
        )
    title = (
        "**Healing a restarted rank, loopback** (state = params + Adam moments; heal = the "
        "joiner's DDP construction to first step ready, = setup + wait for the donor's step "
        "boundary + boundary to ready; GB/s = state bytes / that time; blocked = the others' "
        "extra time in the step the joiner entered)"
    )
    header = (
        "W | state MB | path | heal s (GB/s) | setup s | boundary wait s | "
        "boundary to ready s (GB/s) | transfer s (GB/s) | others blocked s | "
        "median step s | bitwise | interface"
    )
    return table(title, header, lines) if rows else []
