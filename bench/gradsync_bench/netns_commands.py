"""The kernel-command layer of the emulated cluster: running ``ip``/``tc`` and reporting failures.

:class:`~gradsync_bench.netns.Cluster` builds and tears down its hosts through a few dozen ``ip``
and ``tc`` invocations, and :mod:`gradsync_bench.netns_probe` runs the same kind of commands on
throwaway objects. This module is the one place that starts those commands, bounds them with a
timeout and turns any failure into a :class:`NetnsError` naming the exact command line and its
stderr. It is separate from the topology code so that the error boundary and the naming limits
(interface name length, the host-side interface name) are shared by the cluster and the probe
without either importing the other.
"""

from __future__ import annotations

import shlex
import subprocess
from collections.abc import Sequence

__all__ = [
    "COMMAND_TIMEOUT_S",
    "HOST_IFNAME",
    "MAX_IFNAME",
    "NetnsError",
    "link_exists",
    "netns_exists",
    "run_command",
    "run_ip",
    "run_tc",
]

#: Linux limits interface names to IFNAMSIZ - 1 = 15 bytes.
MAX_IFNAME = 15
#: Upper bound for every `ip`/`tc` call; they normally take milliseconds, so hitting this means
#: the kernel or a lock is wedged, and failing loudly beats hanging a test run.
COMMAND_TIMEOUT_S = 10.0
#: Name of the host-side interface inside every namespace (namespaces isolate names, so all
#: hosts can use the same, familiar one).
HOST_IFNAME = "eth0"


class NetnsError(RuntimeError):
    """An ``ip``/``tc`` (or other) command failed; carries the command and its stderr.

    The message always names the exact command line and what it printed, because "RTNETLINK
    answers: File exists" alone says nothing about which of a few dozen setup steps failed.
    """

    def __init__(
        self, argv: Sequence[str], returncode: int | None, stderr: str, what: str = ""
    ) -> None:
        self.argv = list(argv)
        self.returncode = returncode
        self.stderr = stderr
        if not what:
            what = f"failed with exit code {returncode}"
        detail = stderr.strip() or "(no stderr)"
        super().__init__(f"command `{shlex.join(self.argv)}` {what}: {detail}")


def _text(data: str | bytes | None) -> str:
    if data is None:
        return ""
    if isinstance(data, bytes):
        return data.decode(errors="replace")
    return data


def run_command(argv: Sequence[str], *, timeout: float = COMMAND_TIMEOUT_S) -> str:
    """Run one command to completion and return its stdout; raise NetnsError on any failure."""
    try:
        done = subprocess.run(
            list(argv), capture_output=True, text=True, timeout=timeout, check=False
        )
    except subprocess.TimeoutExpired as exc:
        raise NetnsError(argv, None, _text(exc.stderr), f"timed out after {timeout:g} s") from exc
    except OSError as exc:
        raise NetnsError(argv, None, str(exc), "could not be started") from exc
    if done.returncode != 0:
        raise NetnsError(argv, done.returncode, done.stderr)
    return done.stdout


def run_ip(*args: str) -> str:
    """Run ``ip ARGS...`` (see :func:`run_command`)."""
    return run_command(["ip", *args])


def netns_exists(name: str) -> bool:
    """Whether namespace ``name`` exists; True when that cannot be told (so teardown reports)."""
    try:
        listing = run_ip("netns", "list")
    except NetnsError:
        return True
    return any(line.split()[0] == name for line in listing.splitlines() if line.strip())


def link_exists(name: str) -> bool:
    """Whether root-namespace interface ``name`` exists; True when that cannot be told."""
    try:
        shown = subprocess.run(
            ["ip", "link", "show", "dev", name],
            capture_output=True,
            timeout=COMMAND_TIMEOUT_S,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return True
    return shown.returncode == 0


def run_tc(argv: list[str]) -> None:
    """Run a tc command, explaining the most likely cause of "unknown qdisc"."""
    try:
        run_command(argv)
    except NetnsError as exc:
        if "qdisc kind is unknown" in exc.stderr:
            kind = "netem" if "netem" in argv else "tbf"
            exc.add_note(f"this kernel lacks the {kind} qdisc (CONFIG_NET_SCH_{kind.upper()})")
        raise
