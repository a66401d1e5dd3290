"""Ranks SIGKILLed and restarted while the others train rejoin a sharded job cleanly.

Real processes: a `gradsync serve --shards 2 --on-failure elastic` leader with its
local shard, W = 3 churn workers (`gradsync_bench.churn_worker`: a deterministic
model and data, every step logged with the parameters' digest). One rank at a time
is SIGKILLed while it computes (so none of its step is in any sum) and started
again; it rejoins and is healed with a live rank's state while the others keep
training. Rank 0 is among the victims, so a newcomer ranks below its donor too.

The donor's state carries a 32 MB frozen ballast: through the coordinator (gRPC,
the path of a remote coordinator) the leader has the whole state long after the
donor's gradient chunks of that step reached the shard on their own stream. A
rejoin that admits the newcomer to the open step only at the leader then finds the
shard has already summed the donor (the step is aborted for everyone, and a rank
that had all of the step's averages may apply what the others skip).

At the end: no step aborted, every replica bitwise identical, no step applied twice,
and the parameters bitwise equal to a single-process replay of who contributed to
each step (`gradsync_bench.churn_checks`), step by step.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from gradsync_bench import churn_checks
from gradsync_proto.net.launch import parse_banner
from support.faults import HEARTBEAT
from support.processes import reap

WORLD_SIZE = 3
#: Who is killed, in turn: rank 0 makes rank 1 the donor of a rank below it.
VICTIMS = (2, 0, 1, 0)
COMPUTE_S = 0.05
BALLAST_MB = 32


class _Run:
    """The coordinator and the workers of one test, their logs in `folder`."""

    def __init__(self, folder: Path, heal_path: str) -> None:
        self.folder = folder
        self.env = dict(os.environ, GRADSYNC_HEAL_CHANNEL="0" if heal_path == "grpc" else "1")
        self.coordinator_log = folder / "coordinator.log"
        self.processes: list[subprocess.Popen[bytes]] = []
        self.workers: dict[int, subprocess.Popen[bytes]] = {}
        self.incarnations = dict.fromkeys(range(WORLD_SIZE), 0)
        self.address = ""

    def start_coordinator(self) -> None:
        command = [
            sys.executable, "-m", "gradsync.cli", "serve", "--world-size", str(WORLD_SIZE),
            "--host", "127.0.0.1", "--port", "0", "--shards", "2",
            "--on-failure", "elastic", "--min-workers", "2", *HEARTBEAT,
        ]  # fmt: skip
        with self.coordinator_log.open("wb") as log:
            process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=self.env)
        self.processes.append(process)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and process.poll() is None:
            for line in self.coordinator_log.read_text().splitlines():
                banner = parse_banner(line)
                if banner is not None:
                    self.address = f"127.0.0.1:{banner[1]}"
                    return
            time.sleep(0.05)
        raise AssertionError(f"no coordinator banner: {self.coordinator_log.read_text()[-2000:]}")

    def start_worker(self, rank: int) -> None:
        self.incarnations[rank] += 1
        command = [
            sys.executable, "-m", "gradsync_bench.churn_worker", "--coordinator", self.address,
            "--rank", str(rank), "--world-size", str(WORLD_SIZE),
            "--log", str(self.folder / f"rank{rank}.jsonl"),
            "--stop-file", str(self.folder / "stop"),
            "--final", str(self.folder / f"final{rank}.pt"),
            "--compute-s", str(COMPUTE_S), "--ballast-mb", str(BALLAST_MB),
            "--incarnation", str(self.incarnations[rank]), "--timeout-s", "60",
        ]  # fmt: skip
        with (self.folder / f"rank{rank}.log").open("ab") as log:
            process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=self.env)
        self.processes.append(process)
        self.workers[rank] = process

    def stop(self) -> None:
        """The workers SIGKILLed if still there, the leader SIGTERMed (it stops its shard)."""
        reap(list(self.workers.values()))
        leader = self.processes[0] if self.processes else None
        if leader is not None and leader.poll() is None:
            leader.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):  # then reaped below
                leader.wait(timeout=30)
        reap(self.processes)

    def current(self, rank: int) -> list[dict[str, Any]]:
        """The events of `rank`'s latest process."""
        incarnations = [
            i for i in churn_checks.read_logs(self.folder, WORLD_SIZE) if i.rank == rank
        ]
        return incarnations[-1].events if incarnations else []

    def wait_applied(self, rank: int, after_t: float, timeout_s: float) -> int:
        """Until `rank`'s latest process applied a step after `after_t`; return that step."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            applied = [e for e in self.current(rank) if e["e"] == "applied" and e["t"] > after_t]
            if applied:
                return int(applied[-1]["s"])
            if self.workers[rank].poll() is not None:
                break
            time.sleep(0.05)
        raise AssertionError(
            f"rank {rank} applied no step within {timeout_s}s: "
            f"{(self.folder / f'rank{rank}.log').read_text()[-3000:]}"
        )

    def kill_while_computing(self, rank: int, timeout_s: float = 30.0) -> int:
        """SIGKILL `rank` right after it logs a new `submit` (inside its compute sleep)."""
        path = self.folder / f"rank{rank}.jsonl"
        seen = path.stat().st_size
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with path.open("rb") as log:
                log.seek(seen)
                fresh = log.read()
            whole = fresh[: fresh.rfind(b"\n") + 1]  # a line being written waits
            seen += len(whole)
            lines = whole.decode().splitlines()
            if lines and json.loads(lines[-1])["e"] == "submit":
                self.workers[rank].send_signal(signal.SIGKILL)
                self.workers[rank].wait(timeout=10)
                return int(json.loads(lines[-1])["s"])
            time.sleep(0.002)
        raise AssertionError(f"rank {rank} submitted no step within {timeout_s}s")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("heal_path", ["grpc", "direct"])
def test_ranks_rejoining_a_sharded_job_abort_no_step_and_match_the_replay(
    tmp_path: Path, heal_path: str
) -> None:
    run = _Run(tmp_path, heal_path)
    try:
        run.start_coordinator()
        for rank in range(WORLD_SIZE):
            run.start_worker(rank)
        for rank in range(WORLD_SIZE):
            run.wait_applied(rank, 0.0, 120.0)
        for victim in VICTIMS:
            run.kill_while_computing(victim)
            run.start_worker(victim)
            back = time.time()
            run.wait_applied(victim, 0.0, 120.0)
            for rank in range(WORLD_SIZE):
                run.wait_applied(rank, back, 60.0)  # everyone trains on with the newcomer
        furthest = max(run.wait_applied(rank, 0.0, 10.0) for rank in range(WORLD_SIZE))
        (tmp_path / "stop").write_text(f"{furthest + 10}\n")
        for rank, process in run.workers.items():
            assert process.wait(timeout=90) == 0, (tmp_path / f"rank{rank}.log").read_text()[-3000:]
    finally:
        run.stop()
    incarnations = churn_checks.read_logs(tmp_path, WORLD_SIZE)
    aborted = [(i.rank, e["s"], e["why"]) for i in incarnations for e in i.of("aborted")]
    assert aborted == [], aborted
    joined = [i.of("joined")[0]["s"] for i in incarnations if i.of("joined")]
    assert len(joined) == WORLD_SIZE + len(VICTIMS)
    assert sorted(joined)[:WORLD_SIZE] == [0] * WORLD_SIZE and 0 not in sorted(joined)[WORLD_SIZE:]
    replicas = churn_checks.replicas_identical(incarnations, WORLD_SIZE)
    assert replicas["ok"], replicas
    once = churn_checks.applied_once(incarnations)
    assert once["ok"], once
    members, unresolved = churn_checks.contributions(incarnations)
    assert unresolved == [], unresolved
    assert sorted({len(ranks) for ranks in members.values()}) == [2, 3]  # a victim's steps
    digests: dict[int, str] = {}
    final_step = replicas["final_steps"][0]
    expected = churn_checks.replay(
        members, final_step, churn_checks.aborted_steps(incarnations), digests
    )
    assert churn_checks.first_divergence(incarnations, digests) is None
    compared = churn_checks.compare_to_replay(tmp_path, expected, replicas["live_ranks"])
    assert compared["bitwise"], compared
