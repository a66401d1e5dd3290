"""The bench's processes: waiting for a suite's ranks, ending them, and what /proc and
/sys tell about them. The orchestrators use the first half, the rank scripts the second.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from gradsync_proto.net.launch import free_port


def progress(line: str) -> None:
    """Tell on stderr, at once, what a long run is doing (stdout is left to results)."""
    print(line, file=sys.stderr, flush=True)


def flag_args(**flags: object) -> list[str]:
    """`--name value` for each of `flags`, in order: underscores become dashes, values
    strings (str()); a flag whose value is None is left out."""
    argv: list[str] = []
    for name, value in flags.items():
        if value is not None:
            argv += [f"--{name.replace('_', '-')}", str(value)]
    return argv


def kill_all(processes: Sequence[subprocess.Popen[Any]]) -> None:
    """SIGKILL every process of `processes` that still runs, and reap it (30 s at most)."""
    for process in processes:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=30)


def wait_ranks(
    processes: Sequence[subprocess.Popen[Any]],
    timeout_s: float,
    failed: Callable[[int, int, str], str],
    timed_out: Callable[[int], str] | None = None,
) -> None:
    """Wait for the ranks in order, all within one deadline; kill the rest on the way out.

    A rank that exits non-zero raises RuntimeError(failed(rank, exit code, its piped stderr
    or "")); one still running at the deadline raises TimeoutError(timed_out(rank)), or
    subprocess.TimeoutExpired without `timed_out`.
    """
    deadline = time.monotonic() + timeout_s
    try:
        for rank, process in enumerate(processes):
            try:
                _, err = process.communicate(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired as exc:
                if timed_out is None:
                    raise
                raise TimeoutError(timed_out(rank)) from exc
            if process.returncode != 0:
                raise RuntimeError(failed(rank, process.returncode, err or ""))
    finally:
        kill_all(processes)


def run_module_ranks(
    module: str,
    world_size: int,
    out: Path,
    flags: Sequence[str],
    env: dict[str, str],
    *,
    timeout_s: float,
    what: str,
    stderr_path: Callable[[int], Path] | None = None,
) -> list[dict[str, Any]]:
    """Run `world_size` ranks of `python -m module --out out *flags` on this host, as
    torchrun starts them (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR and
    a free MASTER_PORT over `env`, OMP_NUM_THREADS=1); wait for them all within
    `timeout_s` (`wait_ranks`) and return the record each wrote to <out>-<rank>.json.

    Args:
        what: names the run in a failure ("latency flat W=8").
        stderr_path: each rank's stderr goes to that file (many ranks: pipes read one
            after the other could fill and block); by default it is piped.

    Raises:
        RuntimeError: a rank failed, naming it, its exit status and its stderr's tail.
    """
    master_port = str(free_port())
    processes: list[subprocess.Popen[str]] = []
    try:
        for rank in range(world_size):
            rank_env = dict(
                env,
                RANK=str(rank),
                WORLD_SIZE=str(world_size),
                LOCAL_RANK=str(rank),
                LOCAL_WORLD_SIZE=str(world_size),
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=master_port,
                OMP_NUM_THREADS="1",
            )
            argv = [sys.executable, "-m", module, *flag_args(out=out), *flags]
            if stderr_path is None:
                processes.append(
                    subprocess.Popen(argv, env=rank_env, stderr=subprocess.PIPE, text=True)
                )
                continue
            with stderr_path(rank).open("w") as stderr:
                processes.append(subprocess.Popen(argv, env=rank_env, stderr=stderr, text=True))
    except BaseException:
        kill_all(processes)
        raise

    def failed(rank: int, code: int, err: str) -> str:
        tail = err if stderr_path is None else stderr_path(rank).read_text()
        return f"{what}: rank {rank} failed (exit {code}): {tail[-2000:]}"

    wait_ranks(processes, timeout_s, failed)
    return [
        json.loads(out.with_name(f"{out.name}-{rank}.json").read_text())
        for rank in range(world_size)
    ]


def wait_until(
    ready: Callable[[], object], timeout_s: float, failure: str, interval_s: float = 0.05
) -> None:
    """Poll `ready` every `interval_s` until it returns something true.

    Raises:
        RuntimeError: `failure`, once `timeout_s` passed without that.
    """
    deadline = time.monotonic() + timeout_s
    while not ready():
        if time.monotonic() > deadline:
            raise RuntimeError(failure)
        time.sleep(interval_s)


def stop_process(process: subprocess.Popen[Any]) -> None:
    """SIGTERM `process` if it still runs; SIGKILL it if it has not exited 15 s later.

    The wait after SIGKILL is bounded too: a process stuck in the kernel (an NFS read, a
    dying namespace) must not hang the benchmark; TimeoutExpired then names it.
    """
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=30)


def proc_status(pid: int) -> dict[str, int]:
    """The memory figures of /proc/<pid>/status (VmRSS, VmHWM, ...) in KiB; {} once it is gone."""
    values = {}
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            key, _, rest = line.partition(":")
            if key.startswith("Vm"):
                values[key] = int(rest.split()[0])
    except OSError:
        pass
    return values


def process_cpu_s(pid: int) -> float:
    """user + system CPU seconds of another process, from /proc (0 once it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def with_descendants(pids: list[int]) -> list[int]:
    """`pids` and every process below them (`serve --shards S` starts its shards as children)."""
    found: list[int] = []
    pending = list(pids)
    while pending:
        pid = pending.pop()
        if pid in found:
            continue
        found.append(pid)
        for children in Path(f"/proc/{pid}/task").glob("*/children"):
            try:
                pending.extend(int(child) for child in children.read_text().split())
            except (FileNotFoundError, ProcessLookupError):
                continue
    return found


def server_cpu_s(pids: list[int]) -> dict[str, float]:
    """CPU seconds so far of each server process (and its descendants), by pid."""
    return {str(pid): process_cpu_s(pid) for pid in with_descendants(pids)}


def link_bytes(interface: str | None) -> dict[str, int]:
    """This host's tx/rx byte counters of `interface` so far ({} without one)."""
    if interface is None:
        return {}
    statistics = Path("/sys/class/net") / interface / "statistics"
    return {d: int((statistics / f"{d}_bytes").read_text()) for d in ("tx", "rx")}


def stop_step(path: Path) -> int | None:
    """The step a rank stops at, once the orchestrator wrote it into `path`."""
    try:
        return int(path.read_text().strip())
    except (FileNotFoundError, ValueError):
        return None


def exit_now() -> None:
    """End a rank script at once, after flushing its output, skipping the interpreter's exit.

    torch and gloo sometimes abort in their own thread teardown at interpreter exit under
    CPU contention ("terminate called without an active exception"), after the rank has
    written its results; call this once they are written.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
