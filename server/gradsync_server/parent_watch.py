"""A child that must not outlive its parent: a leader's `--shards N` local shard processes.

A leader that is SIGKILLed (or OOM-killed) runs no cleanup, so its children would go on
holding their ports, and a leader restarted on the same port could not start its own
shards there (they would find the port taken, and the orphan would keep knocking on the
new leader with an old shard token). Two mechanisms, because neither is enough alone:

- on Linux, `prctl(PR_SET_PDEATHSIG, SIGTERM)`: the kernel sends the signal the moment
  the parent dies, and the shard's own SIGTERM handler drains and exits;
- everywhere, a watcher that compares `os.getppid()` with the parent's pid every
  `PARENT_POLL_S` (a reparented child has a new parent), covering other systems, a
  failed prctl, and a parent that died before the prctl ran (then the signal never
  comes: the check right after the prctl catches that).
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import logging
import os
import signal
import sys

log = logging.getLogger("gradsync.server")

#: How often the fallback watcher checks that the parent is still there.
PARENT_POLL_S = 0.5
#: linux/prctl.h: PR_SET_PDEATHSIG.
_PR_SET_PDEATHSIG = 1


def set_parent_death_signal(signum: int = signal.SIGTERM) -> bool:
    """Ask the kernel to send `signum` to this process when its parent dies (Linux only).

    Returns:
        True if the kernel accepted it; False elsewhere or when the call failed (the
        watcher of `watch_parent` then does the job alone, a poll period later).
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        result = int(libc.prctl(_PR_SET_PDEATHSIG, signum, 0, 0, 0))
    except (OSError, AttributeError) as exc:
        log.warning("cannot ask for a parent-death signal (%s); polling the parent instead", exc)
        return False
    if result != 0:
        error = ctypes.get_errno()
        log.warning(
            "prctl(PR_SET_PDEATHSIG) failed (%s); polling the parent instead", os.strerror(error)
        )
        return False
    return True


async def watch_parent(parent_pid: int, poll_s: float = PARENT_POLL_S) -> None:
    """Return when `parent_pid` is no longer this process's parent (it died).

    Also arms the parent-death signal first (`set_parent_death_signal`), so on Linux the
    process usually hears of it at once, through its SIGTERM handler, before this returns.
    """
    set_parent_death_signal()
    while os.getppid() == parent_pid:  # (a reparented child has another parent)
        await asyncio.sleep(poll_s)
    log.warning(
        "the parent process %d is gone (now the child of %d): stopping", parent_pid, os.getppid()
    )
