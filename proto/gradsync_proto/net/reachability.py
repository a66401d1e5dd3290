"""Why a coordinator address cannot be reached, in words a person can act on.

gRPC retries an unreachable target quietly (a worker may start before its
coordinator, so the transport waits with `wait_for_ready`) and does not say
why it is not connected. While a worker waits, the transport asks this module
every ~10 s and logs the answer: "connection refused" (nothing listening:
the coordinator is not started yet, or on another port), "name not resolved"
(a typo in the host, or DNS not ready yet), "connection timed out" (a
firewall dropping packets), "TLS handshake failed" (TLS on one end only).
The probe is a plain TCP connect (plus a TLS handshake when a TLS context is
given), bounded in time; the name lookup runs in a daemon thread because the
system resolver has no timeout of its own.
"""

from __future__ import annotations

import errno
import socket
import ssl
import threading
from typing import Any

__all__ = ["describe_connect_error", "diagnose"]

_ERRNO_WORDS = {
    errno.ECONNREFUSED: "connection refused",
    errno.ETIMEDOUT: "connection timed out",
    errno.ENETUNREACH: "network unreachable",
    errno.EHOSTUNREACH: "host unreachable",
    errno.ECONNRESET: "connection reset",
    errno.EADDRNOTAVAIL: "address not available",
}


def describe_connect_error(exc: BaseException) -> str:
    """The reason an attempt to connect failed, in words ("connection refused", ...)."""
    if isinstance(exc, socket.gaierror):
        return f"name not resolved ({exc.strerror or exc})"
    if isinstance(exc, ssl.SSLError):
        detail = getattr(exc, "reason", None) or (exc.args[0] if exc.args else exc)
        return f"TLS handshake failed ({detail})"
    if isinstance(exc, TimeoutError):
        return "connection timed out"
    if isinstance(exc, OSError) and exc.errno in _ERRNO_WORDS:
        return _ERRNO_WORDS[exc.errno]
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror.lower()
    return str(exc) or type(exc).__name__


def diagnose(
    host: str, port: int, timeout_s: float = 2.0, tls: ssl.SSLContext | None = None
) -> str | None:
    """Try to reach host:port over TCP (and TLS, with `tls`); say why it failed.

    Args:
        host: a host name or IP literal (IPv6 without brackets).
        port: the TCP port.
        timeout_s: bound on the name lookup and on each connection attempt.
        tls: when given, also complete a TLS handshake with this context.

    Returns:
        None when a connection (and handshake) succeeded, else the reason in
        words for the last address tried.
    """
    try:
        addresses = _resolve(host, port, timeout_s)
    except OSError as exc:
        return describe_connect_error(exc)
    reason = f"name not resolved ({host} has no address)"
    for family, kind, proto, _, sockaddr in addresses:
        try:
            with socket.socket(family, kind, proto) as sock:
                sock.settimeout(timeout_s)
                sock.connect(sockaddr)
                if tls is not None:
                    with tls.wrap_socket(sock, server_hostname=host) as secure:
                        _await_verdict(secure, timeout_s)
            return None
        except OSError as exc:  # ssl.SSLError and socket.timeout are OSErrors too
            reason = describe_connect_error(exc)
    return reason


#: Why a TLS server that hangs up at once did so: it refused (or got no) client certificate.
CLOSED_AFTER_HANDSHAKE = (
    "the server closed the connection right after the handshake: it requires a client "
    "certificate and got none, or refused the one presented (expired, or from another CA)"
)
#: How long a finished TLS handshake waits for the server's first bytes (or its alert).
_VERDICT_WAIT_S = 0.5


def _await_verdict(secure: ssl.SSLSocket, timeout_s: float) -> None:
    """Wait briefly for the server's first bytes after a TLS handshake.

    Under TLS 1.3 the client's side of the handshake ends before the server has
    checked the client's certificate: a server that refuses it (missing,
    expired, from another CA) says so in an alert that arrives as the first
    read, raised here as `ssl.SSLError`. A gRPC server sends its HTTP/2
    settings at once, so an accepted client returns quickly.
    """
    secure.settimeout(min(_VERDICT_WAIT_S, timeout_s))
    try:
        first = secure.recv(1)
    except TimeoutError:
        return
    if not first:
        raise ssl.SSLError(CLOSED_AFTER_HANDSHAKE)


_AddressInfo = tuple[socket.AddressFamily, socket.SocketKind, int, str, tuple[Any, ...]]


def _resolve(host: str, port: int, timeout_s: float) -> list[_AddressInfo]:
    """getaddrinfo, bounded by `timeout_s` (the system resolver may block far longer)."""
    found: list[list[_AddressInfo]] = []
    failed: list[OSError] = []

    def lookup() -> None:
        try:
            found.append(list(socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)))
        except OSError as exc:
            failed.append(exc)

    thread = threading.Thread(target=lookup, name="gradsync-resolve", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if failed:
        raise failed[0]
    if not found:
        raise socket.gaierror(errno.ETIMEDOUT, f"lookup of {host} timed out after {timeout_s:g}s")
    return found[0]
