"""The leader's registry of its coordinator shards (pure logic).

A sharded coordinator is the leader (shard 0) plus `shard_count - 1` shard
processes that register over `Coordinator.ShardLink`. Jobs must not start
until every shard is registered (a worker would upload a range nobody
aggregates), and a shard that goes silent must be noticed within the
heartbeat timeout (every job then ends: its ranges are gone). This module
decides who may register and under which index, remembers when each shard
was last heard from and what its counters say, and describes what is
missing for the leader's periodic log line. The glue that owns the streams
is `gradsync_server.rpc.shard_control`; no gRPC, no asyncio here.

Indexes are stable per address: a shard that comes back at the address it
had keeps its index, so a restarted shard slots back into the shard map the
workers already know. A second registration at the address of a shard that
is still heard from is refused (ALREADY_EXISTS) rather than displacing it:
only a shard silent beyond the heartbeat timeout is replaced, so nobody can
take over a live shard's index by naming its address.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from gradsync_proto import auth, chunking
from gradsync_proto.codes import Code
from gradsync_proto.net.address import parse_address
from gradsync_proto.v1 import gradsync_pb2 as pb

from gradsync_server import defaults
from gradsync_server.defaults import MIB
from gradsync_server.text import quoted

__all__ = ["RegistrationRefused", "ShardRecord", "ShardRegistry", "shard_view"]


class RegistrationRefused(Exception):
    """A shard may not register: `code` and `message` go back to it (naming both values)."""

    def __init__(self, code: Code, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass
class ShardRecord:
    """One registered shard.

    Attributes:
        index: the range of every bucket it aggregates (1..shard_count-1).
        address: where workers reach it, as it advertised ("host:port" or ":port").
        version: its gradsync version.
        token: tells this registration from an earlier one of the same index, so
            that the end of a replaced stream does not remove its successor.
        last_heard: clock time of its latest message.
        stats: its latest counters.
        peer_host: the host its control stream came from (for ":port" addresses in status).
    """

    index: int
    address: str
    version: str
    token: int
    last_heard: float
    stats: pb.ShardStats = field(default_factory=pb.ShardStats)
    peer_host: str = ""

    @property
    def shown_address(self) -> str:
        """The address for people: ":port" completed with the host it registered from.

        Workers complete ":port" with the leader's host as they reach it; the
        leader cannot know that host, but a ":port" shard runs beside the leader,
        so the host its control stream came from names the same machine.
        """
        if self.address.startswith(":") and self.peer_host:
            return f"{self.peer_host}{self.address}"
        return self.address


@dataclass
class _Totals:
    """Monotonic byte counters of one index across its registrations (for Prometheus)."""

    received: int = 0
    sent: int = 0
    last_received: int = 0
    last_sent: int = 0

    def update(self, stats: pb.ShardStats) -> None:
        # A new registration restarts its counters at zero: count from there.
        received_delta = stats.bytes_received - self.last_received
        sent_delta = stats.bytes_sent - self.last_sent
        self.received += stats.bytes_received if received_delta < 0 else received_delta
        self.sent += stats.bytes_sent if sent_delta < 0 else sent_delta
        self.last_received, self.last_sent = stats.bytes_received, stats.bytes_sent

    def restart(self) -> None:
        self.last_received = self.last_sent = 0


class ShardRegistry:
    """Which shards are registered, under which index, and when they were last heard.

    Args:
        shard_count: shards of the coordinator, the leader included (1 = not sharded).
        version: the leader's gradsync version; a shard must run the same.
        chunk_bytes: the leader's chunk size; a shard must use the same.
        clock: monotonic time source (injectable for tests).
        flag: how the operator set `shard_count`, for messages ("--shards 3").
        live_s: a shard heard from within this many seconds is live: a registration
            at its address is refused instead of replacing it (the heartbeat timeout).

    Raises:
        ValueError: `shard_count` < 1.
    """

    def __init__(
        self,
        shard_count: int,
        version: str,
        chunk_bytes: int,
        clock: Callable[[], float],
        flag: str = "",
        live_s: float = defaults.HEARTBEAT_TIMEOUT_S,
    ) -> None:
        if shard_count < 1:
            raise ValueError(f"shard count must be at least 1, got {shard_count}")
        self.shard_count = shard_count
        self.version = version
        self.chunk_bytes = chunk_bytes
        self._clock = clock
        self._flag = flag or f"--wait-for-shards {shard_count - 1}"
        self.live_s = live_s
        self._shards: dict[int, ShardRecord] = {}
        #: The index each address last had, so a restarted shard gets it back.
        self._previous: dict[str, int] = {}
        #: The address each index was last shown with (status of a lost shard).
        self._last_shown: dict[int, str] = {}
        self._totals: dict[int, _Totals] = {}
        self._next_token = 1
        self._waiting_since = clock()

    # ------------------------------------------------------------------ views
    @property
    def expected(self) -> int:
        """Shards that must register (the leader not counted)."""
        return self.shard_count - 1

    @property
    def sharded(self) -> bool:
        """True when the coordinator has shards besides the leader."""
        return self.shard_count > 1

    def registered(self) -> list[ShardRecord]:
        """Registered shards by index."""
        return [self._shards[index] for index in sorted(self._shards)]

    def get(self, index: int) -> ShardRecord | None:
        """The shard registered under `index`, if any."""
        return self._shards.get(index)

    def complete(self) -> bool:
        """True when every expected shard is registered (always, unsharded)."""
        return len(self._shards) == self.expected

    def missing(self) -> list[int]:
        """Indexes no shard is registered under, ascending."""
        return [i for i in range(1, self.shard_count) if i not in self._shards]

    def waited_s(self) -> float:
        """Seconds since the registry last became incomplete (or was created)."""
        return self._clock() - self._waiting_since

    def describe_missing(self) -> str:
        """What the leader waits for, for its log: counts, indexes and known addresses."""
        missing = self.missing()
        if not missing:
            return f"all {self.expected} shards are registered"
        known = [f"{i} (was {self._last_shown[i]})" for i in missing if i in self._last_shown]
        registered = (
            ", ".join(f"{r.index} at {r.shown_address}" for r in self.registered()) or "none"
        )
        what = "; ".join(known) if known else ", ".join(str(i) for i in missing)
        return (
            f"waiting for {len(missing)} of {self.expected} shards ({self._flag}) for "
            f"{self.waited_s():.0f} s: missing shard(s) {what}; registered: {registered}"
        )

    def shard_map(self) -> list[pb.ShardAddress] | None:
        """The Welcome's shard list, None while some shard is missing ([] unsharded)."""
        if not self.sharded:
            return []
        if not self.complete():
            return None
        return [pb.ShardAddress(index=0, address="")] + [
            pb.ShardAddress(index=r.index, address=r.address) for r in self.registered()
        ]

    def last_address(self, index: int) -> str:
        """The address shard `index` is or was last shown with ("" when none ever registered)."""
        return self._last_shown.get(index, "")

    def totals(self, index: int) -> tuple[int, int]:
        """Bytes shard `index` received and sent, over all its registrations."""
        totals = self._totals.get(index)
        return (0, 0) if totals is None else (totals.received, totals.sent)

    def seconds_since_heard(self, record: ShardRecord) -> float:
        """Seconds since `record`'s shard was last heard from."""
        return self._clock() - record.last_heard

    def silent(self, timeout_s: float) -> list[ShardRecord]:
        """Registered shards not heard from for longer than `timeout_s`."""
        now = self._clock()
        return [r for r in self.registered() if now - r.last_heard > timeout_s]

    # -------------------------------------------------------------- changes
    def register(
        self, message: pb.ShardRegister, peer_host: str = ""
    ) -> tuple[ShardRecord, ShardRecord | None]:
        """Admit a shard; return its record and the silent one it replaced (same address).

        Args:
            message: its registration.
            peer_host: the host its control stream comes from (shown for ":port").

        Raises:
            RegistrationRefused: a version or configuration mismatch
                (FAILED_PRECONDITION), no address (INVALID_ARGUMENT), one shard
                too many (RESOURCE_EXHAUSTED), or a live shard at that address
                (ALREADY_EXISTS); the message names both values.
        """
        address = message.advertise
        # Both come from the network: quoted, so that they cannot forge a log line.
        who = f"shard at {quoted(address) if address else '?'}"
        if not self.sharded:
            raise RegistrationRefused(
                Code.FAILED_PRECONDITION,
                f"{who} tried to register, but this coordinator is not sharded "
                "(start it with --shards S or --wait-for-shards K)",
            )
        if not address:
            raise RegistrationRefused(
                Code.INVALID_ARGUMENT, "a shard registered without an address (--advertise)"
            )
        try:
            # Workers dial it: "host:port", or ":port" for the leader's own host.
            parse_address(f"placeholder{address}" if address.startswith(":") else address)
        except ValueError as exc:
            raise RegistrationRefused(
                Code.INVALID_ARGUMENT, f"{who} advertises an unusable address: {exc}"
            ) from exc
        if message.version != self.version:
            raise RegistrationRefused(
                Code.FAILED_PRECONDITION,
                f"{who} has version {quoted(message.version) or '?'}, the leader {self.version}: "
                "run the same gradsync version on the leader and every shard",
            )
        if message.chunk_bytes and message.chunk_bytes != self.chunk_bytes:
            raise RegistrationRefused(
                Code.FAILED_PRECONDITION,
                f"{who} has --chunk-mb {message.chunk_bytes / MIB:g} ({message.chunk_bytes} "
                f"bytes), the leader --chunk-mb {self.chunk_bytes / MIB:g} "
                f"({self.chunk_bytes} bytes): use the same --chunk-mb on both",
            )
        needed = self.chunk_bytes + chunking.HEADER_SLACK_BYTES
        if message.max_message_bytes < needed:
            raise RegistrationRefused(
                Code.FAILED_PRECONDITION,
                f"{who} accepts messages of at most {message.max_message_bytes} bytes, the "
                f"leader's chunks need {needed} (--chunk-mb {self.chunk_bytes / MIB:g} plus "
                f"{chunking.HEADER_SLACK_BYTES} bytes of header)",
            )
        advertised_host = address.rpartition(":")[0].strip("[]")
        if auth.is_loopback(advertised_host) and peer_host and not auth.is_loopback(peer_host):
            raise RegistrationRefused(
                Code.FAILED_PRECONDITION,
                f"{who} advertises a loopback address but connects from {peer_host}: workers "
                "on other hosts could not reach it; start it with --host set to an address "
                "they reach (or --host 0.0.0.0), or give --advertise HOST:PORT",
            )
        replaced = next((r for r in self._shards.values() if r.address == address), None)
        live_s = self.live_s
        if replaced is not None and self.seconds_since_heard(replaced) <= live_s:
            raise RegistrationRefused(
                Code.ALREADY_EXISTS,
                f"{who} asks for the address of shard {replaced.index}, which is registered "
                f"and was heard from {self.seconds_since_heard(replaced):.1f}s ago: a "
                f"registration replaces it only after {live_s:g}s of silence (the heartbeat "
                "timeout); a restarted shard is admitted once its predecessor is gone",
            )
        index = replaced.index if replaced is not None else self._free_index(address)
        if index is None:
            registered = ", ".join(f"{r.index} at {r.address}" for r in self.registered())
            raise RegistrationRefused(
                Code.RESOURCE_EXHAUSTED,
                f"{who} is one shard too many: the leader has {self.expected} shard(s) besides "
                f"itself ({self._flag}) and all are registered ({registered})",
            )
        now = self._clock()
        record = ShardRecord(
            index, address, message.version, self._next_token, now, peer_host=peer_host
        )
        self._next_token += 1
        self._shards[index] = record
        self._previous[address] = index
        self._last_shown[index] = record.shown_address
        self._totals.setdefault(index, _Totals()).restart()
        return record, replaced

    def _free_index(self, address: str) -> int | None:
        """The index `address` had before if free; else the lowest free one nobody else had."""
        free = self.missing()
        if not free:
            return None
        previous = self._previous.get(address)
        if previous in free:
            return previous
        claimed = {index for other, index in self._previous.items() if other != address}
        unclaimed = [index for index in free if index not in claimed]
        return (unclaimed or free)[0]

    def heard(self, record: ShardRecord, stats: pb.ShardStats | None = None) -> bool:
        """A message from `record`'s shard; False when that registration is gone."""
        if self._shards.get(record.index) is not record:
            return False
        record.last_heard = self._clock()
        if stats is not None:
            record.stats.CopyFrom(stats)
            self._totals[record.index].update(stats)
        return True

    def remove(self, record: ShardRecord) -> bool:
        """Forget `record` (its shard was lost); False when it was already replaced or gone."""
        if self._shards.get(record.index) is not record:
            return False
        if self.complete():
            self._waiting_since = self._clock()
        del self._shards[record.index]
        return True


def shard_view(message: pb.LeaderMessage, shard_index: int) -> pb.LeaderMessage:
    """A job view as shard `shard_index` gets it: each session replaced by its derivative.

    A shard needs only to recognise a rank's data streams to itself, so it never
    holds a session secret that would let it act for the rank anywhere else
    (`gradsync_proto.auth.shard_session`).
    """
    view = pb.LeaderMessage()
    view.CopyFrom(message)
    for member in view.job.members:
        member.session = auth.shard_session(member.session, shard_index)
    return view
