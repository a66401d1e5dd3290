"""Which host a process runs on: the worker's Join says it, the coordinator compares it.

Ranks that report the same host id in their Join are grouped by the
coordinator into one local group, which sums its gradients in shared memory
and meets at an abstract Unix socket. Both are per host, and the abstract
socket is also per network namespace (and System V IPC per IPC namespace):
two containers on one machine with their own network namespaces cannot meet
there, so they must not get the same id. The id is therefore the hostname
(for people reading logs and Status) plus a hash of the kernel's boot id and
the inodes of this process's network and IPC namespaces.

`$GRADSYNC_HOST_ID` overrides it: tests emulate several hosts on one machine
with it, and a user can turn grouping off for some workers by giving each its
own id. It is read when called, never at import.

The coordinator computes its own id the same way at start: a local leader
whose id equals it shares the coordinator's host and network namespace, so
its payloads can move through its shared-memory segment (an abstract Unix
socket passes the descriptor; `gradsync_proto.payload_socket`) instead of
TCP. A coordinator in another network namespace gets another id: the
abstract socket would not be reachable from there.
"""

from __future__ import annotations

import hashlib
import os
import socket
from collections.abc import Mapping

#: Overrides the computed host id (tests emulate hosts on loopback with it).
ENV_HOST_ID = "GRADSYNC_HOST_ID"
#: The coordinator refuses longer ids (Join.host_id).
MAX_HOST_ID_CHARS = 256

_BOOT_ID = "/proc/sys/kernel/random/boot_id"
_NAMESPACES = ("/proc/self/ns/net", "/proc/self/ns/ipc")


def host_id(environ: Mapping[str, str] | None = None) -> str:
    """This process's host id: `$GRADSYNC_HOST_ID`, else "<hostname>/<16 hex digits>".

    The digits hash the boot id and the network and IPC namespace inodes, so
    that only processes that can share an abstract Unix socket and /dev/shm
    get the same id. Where /proc is not there (not Linux), only the hostname
    is hashed: grouping then relies on it alone.

    Raises:
        ValueError: `$GRADSYNC_HOST_ID` is longer than 256 characters.
    """
    env = os.environ if environ is None else environ
    override = env.get(ENV_HOST_ID, "").strip()
    if override:
        if len(override) > MAX_HOST_ID_CHARS:
            raise ValueError(
                f"${ENV_HOST_ID} is {len(override)} characters long; at most "
                f"{MAX_HOST_ID_CHARS} are allowed"
            )
        return override
    hostname = socket.gethostname()
    digest = hashlib.sha256(hostname.encode())
    digest.update(_read(_BOOT_ID).encode())
    for path in _NAMESPACES:
        try:
            digest.update(str(os.stat(path).st_ino).encode())
        except OSError:
            digest.update(b"-")
    return f"{hostname[: MAX_HOST_ID_CHARS - 17]}/{digest.hexdigest()[:16]}"


def _read(path: str) -> str:
    try:
        with open(path, encoding="ascii") as file:
            return file.read().strip()
    except OSError:
        return ""
