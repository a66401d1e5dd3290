"""The suite's worker launcher (support/prefork.py): a worker forked from the zygote sees what
a fresh ``python SCRIPT`` sees, and the test holds a Popen that behaves as one.

Each fact is checked on a forked worker and on a fresh exec of the same script
(GRADSYNC_TEST_PREFORK=0), so the zygote cannot drift from the interpreter it stands for.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from support import prefork

PROBE = prefork.WORKER_SCRIPTS / "probe_worker.py"


@pytest.fixture(params=["forked", "exec"])
def mode(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == "exec":
        monkeypatch.setenv(prefork.ENV_SWITCH, "0")
    assert subprocess.Popen is prefork.PreforkedPopen, "the session did not install the launcher"
    return str(request.param)


def _facts(output: str) -> dict[str, Any]:
    return dict(json.loads(output.splitlines()[0]))


def test_a_worker_runs_with_its_argv_cwd_env_streams_and_status(mode: str, tmp_path: Path) -> None:
    forked_before = prefork.ZYGOTES.forked
    result = subprocess.run(
        [sys.executable, str(PROBE), "--exit", "3", "--read-stdin"],
        input="hello\n",
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=dict(os.environ, GRADSYNC_PROBE="seen"),
        timeout=60,
    )
    facts = _facts(result.stdout)
    assert result.returncode == 3
    assert result.stderr == "to stderr\n"
    assert facts["argv"] == ["--exit", "3", "--read-stdin"]
    assert facts["cwd"] == str(tmp_path)
    assert facts["probe_env"] == "seen"
    assert facts["stdin"] == "hello\n"
    assert facts["main_file"] == PROBE.name
    forked = prefork.ZYGOTES.forked - forked_before
    if mode == "forked":  # the zygote really was used: torch came with the fork
        assert (forked, facts["torch_before"]) == (1, True)
        assert facts["ppid"] != os.getpid()
    else:
        assert (forked, facts["torch_before"]) == (0, False)
        assert facts["ppid"] == os.getpid()


def test_stderr_to_stdout_pass_fds_and_a_new_session(mode: str) -> None:
    read_end, write_end = os.pipe()
    try:
        result = subprocess.run(
            [sys.executable, "-u", str(PROBE), "--write-fd", str(write_end)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            pass_fds=(write_end,),
            start_new_session=True,
            text=True,
            timeout=60,
        )
        os.close(write_end)
        write_end = -1
        with os.fdopen(read_end) as passed:
            read_end = -1
            assert passed.read() == f"fd {result.args[4]}\n"
    finally:
        for fd in (read_end, write_end):
            if fd != -1:
                os.close(fd)
    facts = _facts(result.stdout)
    assert result.stdout.splitlines()[1:] == ["to stderr"]
    assert facts["sid"] == facts["pid"]  # its own session, as start_new_session asks


def test_signals_poll_wait_and_timeouts(mode: str) -> None:
    process = subprocess.Popen(
        [sys.executable, str(PROBE), "--sleep-s", "60"], stdout=subprocess.PIPE, text=True
    )
    try:
        assert process.stdout is not None
        facts = _facts(process.stdout.readline())
        assert facts["pid"] == process.pid  # the Popen's pid is the worker itself
        assert process.poll() is None
        with pytest.raises(subprocess.TimeoutExpired):
            process.wait(timeout=0.2)
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == -signal.SIGTERM
        assert process.poll() == -signal.SIGTERM
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        assert process.stdout is not None
        process.stdout.close()


def test_each_worker_draws_its_own_random_numbers(mode: str) -> None:
    draws = []
    for _ in range(2):
        output = subprocess.run(
            [sys.executable, str(PROBE)], capture_output=True, text=True, timeout=60, check=True
        ).stdout
        facts = _facts(output)
        draws.append((facts["random"], facts["numpy"]))
    assert draws[0][0] != draws[1][0]
    assert draws[0][1] != draws[1][1]


def test_a_killed_zygote_is_a_failed_worker_not_a_hang(monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker whose zygote dies is reported with status 255 at once (never 0, never a hang);
    the next launch gets a new zygote. A private set of zygotes, so the session's stay."""
    zygotes = prefork.Zygotes()
    monkeypatch.setattr(prefork, "ZYGOTES", zygotes)
    try:
        process = subprocess.Popen([sys.executable, str(PROBE), "--sleep-s", "60"])
        ((zygote, _),) = zygotes._running.values()
        zygote.kill()
        zygote.wait()
        started = time.monotonic()
        assert process.wait(timeout=30) == 255
        assert time.monotonic() - started < 10
        os.kill(process.pid, signal.SIGKILL)  # orphaned by its zygote: not ours to leave
        again = subprocess.run([sys.executable, str(PROBE)], capture_output=True, timeout=60)
        assert again.returncode == 0
        assert zygotes.forked == 2
    finally:
        zygotes.close()


def test_only_workers_and_coordinators_are_forked() -> None:
    python = sys.executable
    worker = [python, "-m", "gradsync.cli", "worker", "--rank", "0"]
    assert prefork.preforked_argv([python, str(PROBE), "--x"]) == ("worker", [str(PROBE), "--x"])
    assert prefork.preforked_argv([python, "-m", "gradsync_bench.heal_worker"])[0] == "worker"  # type: ignore[index]
    assert prefork.preforked_argv(worker) == ("worker", worker[1:])
    serve = [python, "-m", "gradsync.cli", "serve", "--world-size", "2"]
    assert prefork.preforked_argv(serve) == ("coordinator", serve[1:])
    shard = [python, "-m", "gradsync", "--log-level", "INFO", "shard", "--leader", "x"]
    assert prefork.preforked_argv(shard) == ("coordinator", shard[1:])
    for argv in (
        [python, "-m", "gradsync.cli", "status", "--coordinator", "x"],
        [python, "-m", "gradsync.cli", "demo"],
        [python, "-c", "print(1)"],
        [python, "elsewhere.py"],
        ["redis-server", "--port", "0"],
        "python worker.py",
    ):
        assert prefork.preforked_argv(argv) is None, argv


def test_a_coordinator_is_forked_without_torch(coordinator_factory: Any) -> None:
    """`gradsync serve` comes from the coordinator zygote: the coordinator's modules
    preloaded, never torch (tests measure a coordinator's memory)."""
    forked_before = prefork.ZYGOTES.forked
    coordinator = coordinator_factory(1)
    assert prefork.ZYGOTES.forked == forked_before + 1
    zygote = int(
        Path(f"/proc/{coordinator.process.pid}/stat").read_text().rsplit(")", 1)[1].split()[1]
    )
    preloaded = Path(f"/proc/{zygote}/cmdline").read_bytes().split(b"\0")
    assert b"gradsync_server.app" in preloaded and b"torch" not in preloaded
    maps = Path(f"/proc/{coordinator.process.pid}/maps").read_text()
    assert "libtorch" not in maps
    code, _ = coordinator.stop()
    assert code == 0
