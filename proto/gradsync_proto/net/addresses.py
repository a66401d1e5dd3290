"""The coordinator addresses a worker (or a shard) may reach, and the order it tries them in.

With a standby coordinator (README "Fault tolerance") a worker is given several addresses,
"a:50051,b:50051", or one DNS name that resolves to several; only the active coordinator
serves, the others answer UNAVAILABLE. The session tries one address per attempt and moves
to the next after an UNAVAILABLE, so it finds the active one within one pass. A dedicated
shard's `--leader` takes the same list and follows the active leader the same way (here,
not in the client, because both sides use it). A DNS name is
resolved again at every pass (the active one may have moved). One address that resolves
to one host is used verbatim, so a single-address job behaves exactly as before.
"""

from __future__ import annotations

import socket
from collections.abc import Callable
from typing import Any

from gradsync_proto.net.address import Address, parse_address

__all__ = ["PER_ADDRESS_JOIN_S", "AddressRotation", "parse_addresses"]

#: With several addresses, a join waits at most this long for a connection to come up at
#: one of them (a dead host's connect retries would otherwise use the whole join budget).
PER_ADDRESS_JOIN_S = 3.0

#: socket.getaddrinfo's signature, injectable so tests resolve without a DNS server.
Resolver = Callable[..., list[tuple[Any, ...]]]


def parse_addresses(text: str) -> tuple[Address, ...]:
    """Parse "host:port[,host:port...]" into checked addresses, in the order given.

    Raises:
        ValueError: an entry is empty or not host:port (the message names the entry), or
            an address is listed twice.
    """
    if not isinstance(text, str):
        raise ValueError(f"address must be a 'host:port' string, got {type(text).__name__}")
    if "," not in text:
        return (parse_address(text),)
    addresses: list[Address] = []
    for position, entry in enumerate(text.split(","), start=1):
        if not entry:
            raise ValueError(f"address list {text!r} has an empty entry at position {position}")
        try:
            address = parse_address(entry)
        except ValueError as exc:
            raise ValueError(f"address list {text!r}, entry {position}: {exc}") from None
        if address in addresses:
            raise ValueError(f"address list {text!r} names {address} twice")
        addresses.append(address)
    return tuple(addresses)


class AddressRotation:
    """The gRPC targets to try, in turn; `advance` moves on after an UNAVAILABLE."""

    def __init__(self, text: str, resolver: Resolver = socket.getaddrinfo) -> None:
        self.addresses = parse_addresses(text)
        self._text = text
        self._resolver = resolver
        self._targets: list[str] = []
        self._position = 0
        self._refresh()

    @property
    def several(self) -> bool:
        """True when there is more than one target (the session logs which one it joined)."""
        return len(self._targets) > 1

    @property
    def count(self) -> int:
        """How many targets one pass tries."""
        return len(self._targets)

    @property
    def wrapped(self) -> bool:
        """True at the first target of a pass (after `advance` went past the last one)."""
        return self._position == 0

    def current(self) -> str:
        """The target to try now."""
        return self._targets[self._position]

    def advance(self) -> str:
        """Move to the next target; after the last, resolve the names again and start over."""
        self._position += 1
        if self._position >= len(self._targets):
            self._refresh()
        return self.current()

    def move_on(self, why: object) -> str:
        """Advance, the current target having not served because of `why`; say so in words."""
        tried = self.current()
        return f"{tried} did not serve ({why}); trying {self.advance()}"

    def _refresh(self) -> None:
        self._position = 0
        if len(self.addresses) == 1:
            resolved = self._resolve(self.addresses[0])
            # One host: keep the text as given, so gRPC sees exactly what it saw before.
            self._targets = resolved if len(resolved) > 1 else [self._text]
            return
        targets: list[str] = []
        for address in self.addresses:
            for target in self._resolve(address):
                if target not in targets:
                    targets.append(target)
        self._targets = targets

    def _resolve(self, address: Address) -> list[str]:
        """Every distinct IP `address.host` resolves to, as targets, when it names several
        hosts; the name itself otherwise, or if it does not resolve now (gRPC then reports
        it unavailable and the rotation moves on)."""
        try:
            infos = self._resolver(address.host, address.port, 0, socket.SOCK_STREAM)
        except (OSError, UnicodeError):
            return [str(address)]
        targets: list[str] = []
        families: dict[Any, int] = {}
        for info in infos:
            target = str(Address(str(info[4][0]), address.port))
            if target not in targets:
                targets.append(target)
                families[info[0]] = families.get(info[0], 0) + 1
        # Only several addresses of one family mean several coordinators ("localhost" is
        # ::1 and 127.0.0.1, one host): otherwise keep the name, as gRPC resolved it before.
        if max(families.values(), default=0) < 2:
            return [str(address)]
        return targets
