"""A joiner the direct heal channel cannot serve is healed through the coordinator.

Real processes (the heal benchmark's three ranks, an MLP with Adam, a real
coordinator on loopback, a real SIGKILL), and a real local attacker: a forked
process of the workers' own user that watches /proc/net/unix for heal sockets
and floods each with silent connections, so that the donor drops the joiner's
connection (the oldest waiting for its token) before it reads the token. The
joiner's direct read fails; it rejoins with `Join.heal_relayed`, the coordinator
asks the donor for the state itself (`StateRequest.relay`), and the joiner must
end with the donor's parameters and optimizer state bitwise.
"""

from __future__ import annotations

import collections
import contextlib
import os
import signal
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from gradsync_bench import heal

#: Silent connections the attacker keeps open at once (its oldest closed beyond).
_HELD = 2000


def _heal_sockets() -> dict[str, str]:
    """The abstract heal sockets every local user sees in /proc/net/unix: name -> inode."""
    names = {}
    for line in Path("/proc/net/unix").read_text().splitlines()[1:]:
        fields = line.split()
        if len(fields) >= 8 and fields[-1].startswith("@gradsync-heal-"):
            names[fields[-1][1:]] = fields[6]
    return names


def _descendants(ancestor: int) -> list[int]:
    """Every process below `ancestor` (the ranks may be forked from a zygote it started)."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                stat = (entry / "stat").read_text()
                parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    below, frontier = [], [ancestor]
    while frontier:
        parent = frontier.pop()
        children = [pid for pid, ppid in parents.items() if ppid == parent]
        below += children
        frontier += children
    return below


def _socket_inodes(pids: list[int]) -> set[str]:
    """The socket inodes `pids` hold."""
    inodes = set()
    for pid in pids:
        with contextlib.suppress(OSError):
            for fd in os.listdir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    link = os.readlink(f"/proc/{pid}/fd/{fd}")
                    if link.startswith("socket:["):
                        inodes.add(link[len("socket:[") : -1])
    return inodes


def _flood_forever() -> None:  # the attacker's body (a forked child)
    # Ahead of the workers for the CPU (root may raise its priority; others try): the
    # race is between the attacker seeing the socket and the joiner connecting to it.
    with contextlib.suppress(OSError):
        os.nice(-10)
    held: collections.deque[socket.socket] = collections.deque()
    # Only the heal sockets of this test's own ranks (below the test process): tests
    # running beside it keep their direct heals.
    test_process = os.getppid()
    ranks: list[int] = []
    looked_at = 0.0
    ours: dict[str, bool] = {}  # socket name -> a rank of this test serves it
    while True:
        if time.monotonic() - looked_at > 0.2:
            ranks, looked_at = _descendants(test_process), time.monotonic()
        names = []
        for name, inode in _heal_sockets().items():
            if name not in ours:
                ours[name] = inode in _socket_inodes(ranks)
            if ours[name]:
                names.append(name)
        if not names:
            time.sleep(0.0005)
            continue
        for name in names:
            for _ in range(256):
                conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                conn.setblocking(False)
                try:
                    conn.connect("\0" + name)
                except OSError:  # a full backlog, or the socket is gone
                    conn.close()
                    break
                held.append(conn)
                if len(held) > _HELD:
                    held.popleft().close()


@contextmanager
def _attacker() -> Iterator[int]:
    pid = os.fork()
    if pid == 0:
        try:
            _flood_forever()
        finally:
            os._exit(0)
    try:
        yield pid
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)


#: Healings tried until the attacker wins one (it races the joiner to the new socket).
_TRIES = 3


@pytest.mark.timeout(300)
def test_a_joiner_whose_direct_heal_is_held_up_is_healed_through_the_coordinator(
    tmp_path: Path,
) -> None:
    logs = []
    for attempt in range(_TRIES):
        workdir = tmp_path / f"try{attempt}"
        workdir.mkdir()
        with _attacker():
            row = heal.heal_once(3, 4.0, workdir, "direct", timeout_s=180.0)
        assert row["bitwise"], row  # the joiner holds the donor's state, whichever way
        logs.append((workdir / "joiner2.log").read_text())
        if "rejoining to be healed through the coordinator instead" in logs[-1]:
            break
    joiner_log = logs[-1]
    # The direct read failed (the attacker's doing) and the joiner did not give up: it
    # rejoined and read the state relayed by the coordinator.
    assert "rejoining to be healed through the coordinator instead" in joiner_log, logs
    assert "through the coordinator, into its own parameters" in joiner_log, joiner_log[-3000:]
