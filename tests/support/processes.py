"""Real processes for tests: a `gradsync serve` coordinator and worker ranks.

One launcher for worker ranks (`launch_ranks`; `run_ranks` runs them to completion
and collects their .npz files, as `run_workers` does for the end-to-end worker;
`start_workers` starts fault-worker ranks and returns at once), one banner parser
(the library's own, `gradsync_proto.net.launch.parse_banner`) and one `free_port`
(`gradsync_proto.net.launch.free_port`), shared by every tier that starts processes.
`reap` is the one place that kills what a test left running.
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from gradsync_proto.net.launch import parse_banner

WORKERS = Path(__file__).parent / "workers"
TRAIN_WORKER = WORKERS / "train_worker.py"
FAULT_WORKER = WORKERS / "fault_worker.py"

#: Starts one rank's argv somewhere (this host by default, or an emulated host).
RankLauncher = Callable[[int, list[str]], "subprocess.Popen[Any]"]


class CoordinatorProcess:
    """A `gradsync serve` subprocess bound to a free loopback port."""

    def __init__(self, world_size: int, *extra: str) -> None:
        self.process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "gradsync.cli",
                "serve",
                "--world-size",
                str(world_size),
                "--host",
                "127.0.0.1",
                "--port",
                "0",
                *extra,
            ],
            stderr=subprocess.PIPE,
            text=True,
        )
        assert self.process.stderr is not None
        self.startup_lines: list[str] = []
        for line in self.process.stderr:
            self.startup_lines.append(line)
            banner = parse_banner(line)
            if banner is not None:
                self.port = banner[1]
                break
        else:
            raise RuntimeError(f"coordinator exited early: {''.join(self.startup_lines)}")
        self.address = f"127.0.0.1:{self.port}"

    def stop(self, signal_first: bool = True) -> tuple[int, str]:
        """SIGTERM (unless already sent), wait, and return (exit code, rest of stderr)."""
        if signal_first and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            _, rest = self.process.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            _, rest = self.process.communicate()
        return self.process.returncode, rest


def children_of(pid: int) -> list[int]:
    """Process ids whose parent is `pid` (Linux /proc)."""
    children = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue  # gone meanwhile
        # The command name (field 2) may hold spaces: the parent id follows its ')'.
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
            children.append(int(entry.name))
    return children


def running(pid: int) -> bool:
    """Whether `pid` runs (Linux /proc; a zombie does not: its sockets are closed)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def reap(processes: Iterable[subprocess.Popen[Any]]) -> None:
    """SIGKILL and wait for every process that is still running (a test's cleanup)."""
    for process in processes:
        if process.poll() is None:
            process.kill()
            process.wait()


def wait_all(processes: Sequence[subprocess.Popen[Any]], timeout_s: float = 90) -> None:
    """Wait for every process to exit with status 0; reap them all whatever happens."""
    try:
        for process in processes:
            code = process.wait(timeout=timeout_s)
            assert code == 0, f"{shlex.join(map(str, process.args))} exited with {code}"
    finally:
        reap(processes)


def _local_quiet(rank: int, argv: list[str]) -> subprocess.Popen[bytes]:
    return subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def launch_ranks(
    script: Path,
    address: str,
    world_size: int,
    out_path: Callable[[int], Path],
    *extra: str,
    per_rank: dict[int, list[str]] | None = None,
    ranks: Sequence[int] | None = None,
    launch: RankLauncher = _local_quiet,
) -> list[subprocess.Popen[Any]]:
    """Start one process of the worker `script` per rank; return them in rank order.

    Args:
        script: a worker under tests/support/workers; it takes --coordinator, --rank,
            --world-size and --out.
        address: the coordinator's "host:port".
        world_size: the job's world size (all ranks are started unless `ranks` is given).
        out_path: where rank r writes its result.
        extra: flags every rank gets.
        per_rank: flags only some ranks get (fault injection), by rank.
        ranks: start only these ranks (a restarted rank).
        launch: how to start an argv (default: on this host, output discarded).
    """
    processes = []
    for rank in range(world_size) if ranks is None else ranks:
        argv = [
            sys.executable,
            str(script),
            "--coordinator",
            address,
            "--rank",
            str(rank),
            "--world-size",
            str(world_size),
            "--out",
            str(out_path(rank)),
            *extra,
            *(per_rank or {}).get(rank, []),
        ]
        processes.append(launch(rank, argv))
    return processes


def start_workers(
    address: str,
    world_size: int,
    out: Path,
    steps: int,
    per_rank: dict[int, list[str]] | None = None,
    *extra: str,
    launch: RankLauncher = _local_quiet,
    ranks: Sequence[int] | None = None,
) -> list[subprocess.Popen[Any]]:
    """Start fault-worker ranks that train `steps` steps; rank r reports to out/rank<r>.json."""
    return launch_ranks(
        FAULT_WORKER,
        address,
        world_size,
        lambda rank: out / f"rank{rank}.json",
        "--steps",
        str(steps),
        *extra,
        per_rank=per_rank,
        ranks=ranks,
        launch=launch,
    )


def launch_captured(rank: int, argv: list[str]) -> subprocess.Popen[str]:
    """Start `argv` on this host, its output (stdout and stderr) read back as text."""
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _local_captured(rank: int, argv: list[str]) -> subprocess.Popen[str]:
    return subprocess.Popen(
        argv,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=dict(os.environ, PYTHONWARNINGS="error"),
    )


def run_ranks(
    script: Path,
    address: str,
    world_size: int,
    out_dir: Path,
    *extra: str,
    timeout_s: float = 90.0,
    per_rank: dict[int, list[str]] | None = None,
) -> list[dict[str, np.ndarray]]:
    """Run every rank of the worker `script` to completion (warnings are errors); return
    the arrays each saved to out_dir/rank<r>.npz, in rank order (`per_rank`: flags only
    some ranks get, by rank).

    Raises:
        AssertionError: a rank exited with a non-zero status (its output is in the message).
    """
    processes = launch_ranks(
        script,
        address,
        world_size,
        lambda rank: out_dir / f"rank{rank}.npz",
        *extra,
        per_rank=per_rank,
        launch=_local_captured,
    )
    try:
        texts = [process.communicate(timeout=timeout_s)[0] for process in processes]
        failed = [rank for rank, process in enumerate(processes) if process.returncode != 0]
        assert not failed, "\n".join(f"rank {rank} failed:\n{texts[rank]}" for rank in failed)
    finally:
        reap(processes)
    outputs = []
    for rank in range(world_size):
        with np.load(out_dir / f"rank{rank}.npz") as data:
            outputs.append(dict(data))
    return outputs


def run_workers(
    address: str,
    world_size: int,
    scenario: str,
    out_dir: Path,
    *extra: str,
    timeout_s: float = 90.0,
) -> list[dict[str, np.ndarray]]:
    """Run `world_size` ranks of `TRAIN_WORKER` in `scenario`; return their saved outputs."""
    return run_ranks(
        TRAIN_WORKER,
        address,
        world_size,
        out_dir,
        "--scenario",
        scenario,
        *extra,
        timeout_s=timeout_s,
    )
