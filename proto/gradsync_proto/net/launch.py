"""Start a coordinator process and learn its port (for `gradsync demo` and `gradsync bench`)."""

from __future__ import annotations

import re
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from typing import IO

#: The banner line `gradsync serve` prints once it listens.
BANNER = re.compile(r"listening on (\S+):(\d+)")

Launcher = Callable[[list[str]], "subprocess.Popen[str]"]


def parse_banner(line: str) -> tuple[str, int] | None:
    """(host, port) from a `gradsync serve` banner line, or None for any other line."""
    match = BANNER.search(line)
    if match is None:
        return None
    return match.group(1), int(match.group(2))


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free on `host` a moment ago (for servers that cannot bind 0)."""
    with socket.socket() as probe:
        probe.bind((host, 0))
        return int(probe.getsockname()[1])


def gradsync_argv(module: str, *words: str, flags: Mapping[str, object]) -> list[str]:
    """`python -m module words...`, then each of `flags` and its value (as `str`), in order."""
    pairs = [text for flag, value in flags.items() for text in (flag, str(value))]
    return [sys.executable, "-m", module, *words, *pairs]


def local_launch(argv: list[str]) -> subprocess.Popen[str]:
    """Start `argv` on this host with its stderr piped (where the banner is read)."""
    return subprocess.Popen(argv, stderr=subprocess.PIPE, text=True)


def start_coordinator(
    world_size: int,
    *extra: str,
    launch: Launcher = local_launch,
    host: str = "127.0.0.1",
    port: int = 0,
    timeout_s: float = 60.0,
    forward_log: bool = True,
) -> tuple[subprocess.Popen[str], int]:
    """Start `gradsync serve` (on this host, or through `launch`); return it and its port.

    The port is read from the banner, so port 0 (a free port) works. With `forward_log`
    the log lines after the banner are copied to this process's stderr; a caller that
    reads `process.stderr` itself passes False (and must keep reading it: a coordinator
    whose log pipe is full blocks).

    Raises:
        RuntimeError: the coordinator exited or printed no banner within `timeout_s`.
    """
    ours = {"--world-size": world_size, "--host": host, "--port": port, "--shutdown-grace-s": 1}
    argv = gradsync_argv("gradsync.cli", "--log-level", "WARNING", "serve", flags=ours)
    process = launch([*argv, *extra])
    assert process.stderr is not None
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        line = process.stderr.readline()
        if not line:
            break
        banner = parse_banner(line)
        if banner is not None:
            if forward_log:
                _forward(process.stderr)
            return process, banner[1]
    process.kill()
    process.wait()
    raise RuntimeError("the coordinator did not start (no banner on its stderr)")


def _forward(stream: IO[str]) -> None:
    """Copy the coordinator's log lines after the banner to this process's stderr.

    Nobody else reads that pipe once the banner is found: a coordinator that logs more
    than the pipe holds (64 KiB on Linux) would block in its next log write, with every
    task of its event loop behind it, and a long run would hang without a word. The
    copy runs on a daemon thread until the pipe ends (the coordinator exits or the
    caller closes its end).
    """

    def copy() -> None:
        try:
            for line in stream:
                sys.stderr.write(f"[coordinator] {line}")
        except (OSError, ValueError):  # the caller closed the pipe: nothing more to copy
            return

    threading.Thread(target=copy, name="coordinator-log", daemon=True).start()
