"""One parser for the coordinator's "host:port" address, used by the library and the CLI.

A mistyped address used to surface minutes later as a join timeout (gRPC
reads `http://host:50051` as a DNS name and retries it forever), so every
entry point checks the address at once with this parser: `ClientConfig`
raises `ValueError`, every `--coordinator` flag exits 2 naming the flag.
IPv6 literals are written in brackets, as in URLs: "[::1]:50051".
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Address", "parse_address"]

MAX_PORT = 65535


@dataclass(frozen=True)
class Address:
    """A checked coordinator address.

    Attributes:
        host: a host name or IP literal (IPv6 without brackets).
        port: 1..65535.
    """

    host: str
    port: int

    def __str__(self) -> str:
        """The gRPC target: "host:port", or "[v6]:port" for IPv6 literals."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"


def parse_address(text: str) -> Address:
    """Parse "host:port" (or "[ipv6]:port") into an `Address`.

    Raises:
        ValueError: the text is not a usable address; the message quotes it
            and says what is wrong (a scheme, no port, an empty host, a port
            out of range, ...).
    """
    if not isinstance(text, str):
        raise ValueError(f"address must be a 'host:port' string, got {type(text).__name__}")
    shown = repr(text)
    if not text.strip():
        raise ValueError("address is empty: expected host:port, e.g. 127.0.0.1:50051")
    if text != text.strip() or any(c.isspace() for c in text):
        raise ValueError(f"address {shown} contains whitespace: expected host:port")
    if "://" in text:
        scheme = text.split("://", 1)[0]
        raise ValueError(
            f"address {shown} has a scheme ({scheme}://): give only host:port, "
            f"e.g. {text.split('://', 1)[1].rstrip('/') or 'host:50051'}"
        )
    if "/" in text:
        raise ValueError(f"address {shown} contains a path ('/'): give only host:port")
    host, port_text = _split(text, shown)
    if not host:
        raise ValueError(f"address {shown} has an empty host: expected host:port")
    if not port_text:
        example = Address(host, 50051)
        raise ValueError(f"address {shown} has no port: expected host:port, e.g. {example}")
    if not port_text.isascii() or not port_text.isdigit():
        raise ValueError(f"address {shown} has port {port_text!r}, which is not a number")
    port = int(port_text)
    if not 1 <= port <= MAX_PORT:
        raise ValueError(f"address {shown} has port {port}, outside 1..{MAX_PORT}")
    return Address(host, port)


def _split(text: str, shown: str) -> tuple[str, str]:
    """(host, port text) of "host:port", "host", "[v6]:port" or "[v6]"."""
    if text.startswith("["):
        closing = text.find("]")
        if closing < 0:
            raise ValueError(f"address {shown} opens '[' without closing it: expected [v6]:port")
        host = text[1:closing]
        rest = text[closing + 1 :]
        if host and ":" not in host:
            raise ValueError(f"address {shown} puts {host!r} in brackets, which is not IPv6")
        if rest and not rest.startswith(":"):
            raise ValueError(f"address {shown} has {rest!r} after ']': expected [v6]:port")
        return host, rest[1:]
    if text.count(":") > 1:
        raise ValueError(
            f"address {shown} has several ':': write an IPv6 address in brackets, e.g. [::1]:50051"
        )
    host, _, port_text = text.partition(":")
    return host, port_text
