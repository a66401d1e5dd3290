"""The same-host payload path, worker side: a local leader hands its segment to the coordinator.

When the coordinator runs on this host (same host id, so same network
namespace) and is not sharded, its Welcome to a local leader names its
payload socket (`Welcome.payload_socket`). The leader then registers the
group's segment there once, by descriptor, with its session; from then on
each bucket's chunks travel as header-only messages saying where in the
segment the bytes lie, and the coordinator writes the averages straight
back into the result region: no payload crosses TCP, and nothing is copied
into or out of gRPC messages. gRPC stays the control channel.

This is an optimization only: any failure to register is logged once and
the leader carries on over TCP. `$GRADSYNC_PAYLOAD_SOCKET=0` turns it off
(debugging).
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Mapping

from gradsync_proto.payload_socket import (
    EXCHANGE_TIMEOUT_S,
    MAX_REPLY_BYTES,
    Registration,
    address,
    enabled,
    encode_request,
    reply_problem,
)

log = logging.getLogger("gradsync.client")


def register_segment(
    socket_name: str,
    registration: Registration,
    fd: int,
    *,
    timeout_s: float = EXCHANGE_TIMEOUT_S,
    environ: Mapping[str, str] | None = None,
) -> bool:
    """Hand the segment `fd` to the coordinator's payload socket; True if it took it.

    Never raises: a refusal or an error is logged (once, here) and False
    returned, so that the caller goes on over TCP.
    """
    if not socket_name or not enabled(os.environ if environ is None else environ):
        return False
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(timeout_s)
            sock.connect(address(socket_name))
            socket.send_fds(sock, [encode_request(registration)], [fd])
            sock.shutdown(socket.SHUT_WR)
            reply = sock.recv(MAX_REPLY_BYTES)
    except OSError as exc:
        log.warning(
            "rank %d: could not hand the local group's segment to the coordinator (%s); "
            "gradient payloads go over TCP",
            registration.rank,
            exc,
        )
        return False
    problem = reply_problem(reply)
    if problem is not None:
        log.warning(
            "rank %d: the coordinator refused the local group's segment (%s); gradient "
            "payloads go over TCP",
            registration.rank,
            problem,
        )
        return False
    log.info(
        "rank %d: gradient payloads move through shared memory with the coordinator",
        registration.rank,
    )
    return True
