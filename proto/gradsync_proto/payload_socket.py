"""The same-host payload path's registration: what a local leader sends, what it hears back.

When a local leader shares the coordinator's host (and network namespace:
see `gradsync_proto.host`), gradient payloads need not cross TCP: the
coordinator reads them from, and writes the averages into, the group's
shared-memory segment. gRPC stays the control channel (each chunk still
travels as a header-only `GradientChunk` with `in_segment` set); the segment
itself is handed over once, on an abstract Unix socket the coordinator names
in `Welcome.payload_socket`, as a file descriptor (SCM_RIGHTS) beside one
small request:

    request = JSON {"job_id": str, "rank": int, "session": hex of Welcome.session}
    reply   = b"OK" | b"NO " + the reason (UTF-8)

The coordinator admits only a peer of its own uid (SO_PEERCRED) presenting
the session of a running job's local leader. Both ends bound every wait.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Mapping
from dataclasses import dataclass

#: Workers: "0" turns the path off (payloads go over TCP), for debugging.
ENV_PAYLOAD_SOCKET = "GRADSYNC_PAYLOAD_SOCKET"
#: The largest registration request (a job id is at most a few hundred bytes).
MAX_REQUEST_BYTES = 4096
#: The largest reply.
MAX_REPLY_BYTES = 1024
#: How long either end waits for the other at each exchange.
EXCHANGE_TIMEOUT_S = 5.0
OK = b"OK"
_REFUSED = b"NO "


@dataclass(frozen=True)
class Registration:
    """Who registers a segment: job, rank and the session its Welcome issued."""

    job_id: str
    rank: int
    session: bytes


def new_socket_name() -> str:
    """A fresh random abstract socket name (one per coordinator process, never reused)."""
    return f"gradsync-payload-{secrets.token_hex(16)}"


def address(name: str) -> str:
    """The abstract-namespace address of `name` (a leading NUL: no file, gone with the process)."""
    return "\0" + name


def enabled(environ: Mapping[str, str]) -> bool:
    """False when `$GRADSYNC_PAYLOAD_SOCKET` is "0" (or "false", "no", "off")."""
    value = environ.get(ENV_PAYLOAD_SOCKET, "").strip().lower()
    return value not in ("0", "false", "no", "off")


def encode_request(registration: Registration) -> bytes:
    """The request bytes (the descriptor travels beside them)."""
    return json.dumps(
        {
            "job_id": registration.job_id,
            "rank": registration.rank,
            "session": registration.session.hex(),
        }
    ).encode()


def decode_request(raw: bytes) -> Registration:
    """Parse a request.

    Raises:
        ValueError: it is not one (too long, not JSON, wrong types).
    """
    if len(raw) > MAX_REQUEST_BYTES:
        raise ValueError(f"a registration of {len(raw)} bytes (at most {MAX_REQUEST_BYTES})")
    try:
        fields = json.loads(raw.decode())
        job_id, rank, session = fields["job_id"], fields["rank"], fields["session"]
        if not isinstance(job_id, str) or not isinstance(session, str):
            raise TypeError("job_id and session must be strings")
        if not isinstance(rank, int) or isinstance(rank, bool) or rank < 0:
            raise TypeError(f"rank must be a non-negative integer, got {rank!r}")
        return Registration(job_id, rank, bytes.fromhex(session))
    except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"not a payload segment registration: {exc}") from None


def refusal(reason: str) -> bytes:
    """The reply that refuses a registration, saying why (cut to fit)."""
    return (_REFUSED + reason.encode())[:MAX_REPLY_BYTES]


def reply_problem(reply: bytes) -> str | None:
    """None for an acceptance, else the coordinator's reason (or what is wrong with the reply)."""
    if reply == OK:
        return None
    if reply.startswith(_REFUSED):
        return reply[len(_REFUSED) :].decode(errors="replace")
    return f"an unexpected reply of {len(reply)} bytes"
