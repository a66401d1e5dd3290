"""Workers and coordinators forked from zygotes that have imported them (support/zygote.py).

The multiprocess and system tiers start hundreds of worker ranks and coordinators, and a
fresh interpreter spends about 1.3 CPU-seconds importing torch (a worker) or 0.3 importing
the coordinator before it does anything a test looks at: on the two-core development
machine those imports were a large share of the suite's CPU. While the suite runs,
`subprocess.Popen` is `PreforkedPopen` (installed by tests/conftest.py for the session): a
launch of one of the suite's worker programs, of `gradsync serve` or of `gradsync shard` is
answered by a fork of a zygote of its kind instead of an exec of a fresh interpreter; every
other launch (Redis, Prometheus, `ip netns exec`, `python -c`, the CLI's other commands) is
an ordinary exec.

What the worker sees is what ``python SCRIPT ARGS`` gives it (support/zygote.py says how):
its argv, environment, working directory, standard streams, pass_fds, session and process
group, a fresh seed for `random` and numpy, and its own exit status; the object the test
holds is a real `subprocess.Popen` whose pid is the worker's own, so signals, `poll`,
`wait`, `communicate` and `/proc` work as before. Exit statuses come from the zygote (the
worker's parent) over the connection that asked for it, not from `waitpid`.

A zygote is started per test process, lazily, per kind and set of start-up variables
(PYTHON*, OMP_*, torch's own...): a child that asks for other values gets a zygote started
with them, since an interpreter reads them only when it starts. ``GRADSYNC_TEST_PREFORK=0``
turns it all off (every launch an exec), to check that a failure is not the zygote's.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

ENV_SWITCH = "GRADSYNC_TEST_PREFORK"
ZYGOTE_SCRIPT = Path(__file__).with_name("zygote.py")
WORKER_SCRIPTS = Path(__file__).parent / "workers"
#: Prefixes of the environment variables an interpreter (or torch, as it is imported) reads
#: when it starts: a zygote serves only children that agree with it on all of them.
STARTUP_PREFIXES = ("PYTHON", "OMP_", "MKL_", "KMP_", "GOMP_", "TORCH_", "LD_", "MALLOC_")
#: The subcommands of the `gradsync` CLI, to find which one an argv runs.
CLI_COMMANDS = frozenset({"serve", "shard", "worker", "token", "status", "bench", "demo"})
#: What each kind of zygote imports before it forks: what its children would import first.
#: A coordinator's zygote never imports torch (a coordinator does not, and tests measure
#: its memory).
PRELOADS = {"worker": ("numpy", "torch"), "coordinator": ("gradsync", "gradsync_server.app")}
#: How long a new zygote may take to import torch and listen.
ZYGOTE_START_TIMEOUT_S = 60.0
#: The answers a zygote sends are a few dozen bytes.
ANSWER_BYTES = 4096

_ORIGINAL_POPEN = subprocess.Popen


def preforked_argv(args: Any) -> tuple[str, list[str]] | None:
    """The zygote kind and the interpreter's arguments when `args` launches a program the
    suite forks on this interpreter, else None (that launch is an ordinary exec).

    Workers are scripts under tests/support/workers, `-m gradsync_bench.<name>_worker` and
    `-m gradsync.cli worker`; coordinators are `-m gradsync[.cli] serve` and `shard`.
    """
    if isinstance(args, (str, bytes, os.PathLike)) or not args:
        return None
    argv = [os.fspath(arg) for arg in args]
    if any(not isinstance(arg, str) for arg in argv):
        return None
    if os.path.realpath(argv[0]) != os.path.realpath(sys.executable):
        return None
    rest = argv[1:]
    if rest[:1] == ["-u"]:
        rest = rest[1:]
    if rest[:1] == ["-m"] and len(rest) >= 2:
        module = rest[1]
        if module.startswith("gradsync_bench.") and module.endswith("_worker"):
            return "worker", rest
        if module in ("gradsync", "gradsync.cli"):
            command = next((arg for arg in rest[2:] if arg in CLI_COMMANDS), None)
            if command == "worker":
                return "worker", rest
            if command in ("serve", "shard"):
                return "coordinator", rest
        return None
    if rest and rest[0].endswith(".py") and not rest[0].startswith("-"):
        script = Path(rest[0]).resolve()
        return ("worker", rest) if script.parent == WORKER_SCRIPTS.resolve() else None
    return None


class Zygotes:
    """The zygotes of this test process, one per start-up environment, started on demand."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._folder: str | None = None
        self._running: dict[tuple[Any, ...], tuple[subprocess.Popen[bytes], str]] = {}
        #: How many children the zygotes have forked (asserted by the launcher's own tests).
        self.forked = 0

    def connect(self, kind: str, env: Mapping[str, str]) -> socket.socket:
        """A connection to the zygote of `kind` for `env`'s start-up variables (started if need
        be)."""
        startup = sorted((k, v) for k, v in env.items() if k.startswith(STARTUP_PREFIXES))
        key = (kind, *startup)
        with self._lock:
            entry = self._running.get(key)
            if entry is not None and entry[0].poll() is not None:
                _close_pipes(entry[0])  # died (killed): a new one takes its place
                entry = None
            if entry is None:
                entry = self._start(kind, env, len(self._running))
                self._running[key] = entry
        connection = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        connection.connect(entry[1])
        return connection

    def _start(
        self, kind: str, env: Mapping[str, str], number: int
    ) -> tuple[subprocess.Popen[bytes], str]:
        if self._folder is None:
            self._folder = tempfile.mkdtemp(prefix="gradsync-zygote-")
        path = os.path.join(self._folder, f"z{number}.sock")
        if os.path.exists(path):
            os.unlink(path)
        process = _ORIGINAL_POPEN(
            [sys.executable, str(ZYGOTE_SCRIPT), path, *PRELOADS[kind]],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=dict(env),
            cwd="/",
        )
        assert process.stdout is not None
        ready: list[bytes] = []
        reader = threading.Thread(target=lambda: ready.append(process.stdout.readline()))  # type: ignore[union-attr]
        reader.start()
        reader.join(ZYGOTE_START_TIMEOUT_S)
        if not ready or ready[0] != b"ready\n":
            process.kill()
            process.wait()
            raise RuntimeError(f"the test zygote did not start ({ready!r}): see its stderr")
        return process, path

    def close(self) -> None:
        """Stop every zygote (each SIGKILLs the children it still has)."""
        with self._lock:
            for process, _ in self._running.values():
                try:
                    assert process.stdin is not None
                    process.stdin.close()
                except BrokenPipeError:
                    pass  # it died first
                try:
                    process.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()
                _close_pipes(process)
            self._running.clear()
            if self._folder is not None:
                shutil.rmtree(self._folder, ignore_errors=True)
                self._folder = None


def _close_pipes(process: subprocess.Popen[bytes]) -> None:
    for pipe in (process.stdin, process.stdout):
        if pipe is not None:
            with contextlib.suppress(BrokenPipeError):
                pipe.close()


ZYGOTES = Zygotes()


class PreforkedPopen(subprocess.Popen):  # type: ignore[type-arg]
    """`subprocess.Popen` that forks the suite's worker programs from a zygote (module doc)."""

    _zygote: socket.socket | None = None

    def _execute_child(  # type: ignore[override]
        self,
        args: Any,
        executable: Any,
        preexec_fn: Any,
        close_fds: bool,
        pass_fds: Sequence[int],
        cwd: Any,
        env: Any,
        startupinfo: Any,
        creationflags: int,
        shell: bool,
        p2cread: int,
        p2cwrite: int,
        c2pread: int,
        c2pwrite: int,
        errread: int,
        errwrite: int,
        restore_signals: bool,
        gid: Any,
        gids: Any,
        uid: Any,
        umask: int,
        start_new_session: bool,
        process_group: int,
    ) -> None:
        everything = (args, executable, preexec_fn, close_fds, pass_fds, cwd, env, startupinfo)
        rest = (creationflags, shell, p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite)
        more = (restore_signals, gid, gids, uid, umask, start_new_session, process_group)
        launch = None
        if (
            not shell
            and executable is None
            and preexec_fn is None
            and (gid, gids, uid) == (None, None, None)
            and umask < 0
            and os.environ.get(ENV_SWITCH, "1") != "0"
        ):
            launch = preforked_argv(args)
        child_env = dict(os.environ if env is None else env)
        if launch is None or any(not isinstance(k, str) for k in child_env):
            super()._execute_child(*everything, *rest, *more)  # type: ignore[misc]
            return
        kind, python_argv = launch  # without a leading -u: it becomes the variable below
        if args[1] == "-u":
            child_env["PYTHONUNBUFFERED"] = "1"
        stdio = [
            p2cread if p2cread != -1 else 0,
            c2pwrite if c2pwrite != -1 else 1,
            errwrite if errwrite != -1 else 2,
        ]
        request = {
            "argv": python_argv,
            "env": child_env,
            "cwd": os.fspath(cwd) if cwd is not None else os.getcwd(),
            "new_session": bool(start_new_session),
            "process_group": process_group if process_group >= 0 else None,
            "targets": [0, 1, 2, *pass_fds],
        }
        connection = ZYGOTES.connect(kind, child_env)
        try:
            socket.send_fds(connection, [json.dumps(request).encode()], [*stdio, *pass_fds])
            answer = connection.recv(ANSWER_BYTES)
            if not answer:
                raise RuntimeError(f"the test zygote refused to start {args!r}: see its stderr")
            self.pid = json.loads(answer)["pid"]
        except BaseException:
            connection.close()
            raise
        self._zygote = connection
        self._child_created = True
        ZYGOTES.forked += 1
        self._close_pipe_fds(p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite)

    def _zygote_status(self, block: bool) -> int | None:
        """The child's raw wait status once it has exited (None: still running)."""
        connection = self._zygote
        assert connection is not None
        connection.setblocking(block)
        try:
            answer = connection.recv(ANSWER_BYTES)
        except BlockingIOError:
            return None
        connection.close()
        if not answer:
            # The zygote went first (it ends only with the session, or killed): say so in
            # the status rather than invent a clean exit.
            return 255 << 8
        return int(json.loads(answer)["status"])

    def _internal_poll(self, _deadstate: int | None = None, **_: Any) -> int | None:
        if self._zygote is None:
            return super()._internal_poll(_deadstate=_deadstate)  # type: ignore[no-any-return,misc]
        if self.returncode is None and self._waitpid_lock.acquire(False):  # type: ignore[attr-defined]
            try:
                if self.returncode is None and self._zygote.fileno() != -1:
                    status = self._zygote_status(block=False)
                    if status is not None:
                        self._handle_exitstatus(status)  # type: ignore[attr-defined]
            finally:
                self._waitpid_lock.release()  # type: ignore[attr-defined]
        return self.returncode

    def _try_wait(self, wait_flags: int) -> tuple[int, int]:
        if self._zygote is None:
            return super()._try_wait(wait_flags)  # type: ignore[no-any-return,misc]
        status = self._zygote_status(block=not wait_flags & os.WNOHANG)
        return (0, 0) if status is None else (self.pid, status)


def install() -> None:
    """Make `subprocess.Popen` fork workers from zygotes, for this process (test session)."""
    subprocess.Popen = PreforkedPopen  # type: ignore[misc]


def uninstall() -> None:
    """Restore `subprocess.Popen` and stop the zygotes."""
    subprocess.Popen = _ORIGINAL_POPEN  # type: ignore[misc]
    ZYGOTES.close()
