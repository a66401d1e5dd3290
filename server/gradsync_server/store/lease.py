"""The coordinator lease in Redis: which coordinator is active, with a fencing number.

Two coordinators on one store must never both write it (a standby taking over while the
old active one is only paused would otherwise interleave checkpoints of two histories).
One key holds "fence|holder|address" with a deadline (`SET ... PX ttl`); a coordinator
takes it only when the key is absent, and the same Lua script INCRs a fence counter, so
every holder ever has a larger fence than the one before. Renewing (every ttl/3) succeeds
only while the key still holds our exact value. Every store write of a leased coordinator
runs in a Lua script that first compares the lease key with our value (`fence_script`), so
a demoted coordinator's write is refused by Redis itself, atomically, even if it has not
noticed yet that it lost the lease.

A value at the key that none of our scripts could have written (one without a deadline,
one that does not parse, or one whose fence is not the last fence the counter issued) is a
foreign writer's: left alone, it would demote the holder and keep every standby out for
ever. A standby that sees the same such value for a whole ttl treats the lease as expired:
it logs an ERROR naming the key, the value and why, deletes that exact value and takes the
lease (`suspicion`, `SuspectWatch`, `RedisLease.evict`).

The pure part (`LeaseRecord`, `LeaseTimer`, `suspicion`, `SuspectWatch`) has no Redis import
so it is unit-tested alone.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import redis

log = logging.getLogger("gradsync.server.lease")

#: The lease lasts this long after its last renewal unless told otherwise (`--lease-ttl-s`).
DEFAULT_LEASE_TTL_S = 3.0
#: The separator of the fields in the lease value; refused inside a holder or address.
_SEPARATOR = "|"

_ACQUIRE_SCRIPT = """
local current = redis.call('GET', KEYS[1])
if current then
  return {0, current}
end
local fence = redis.call('INCR', KEYS[2])
local value = fence .. '|' .. ARGV[1] .. '|' .. ARGV[2]
redis.call('SET', KEYS[1], value, 'PX', ARGV[3])
return {1, value}
"""

_RENEW_SCRIPT = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 1
end
return 0
"""

_OBSERVE_SCRIPT = """
local value = redis.call('GET', KEYS[1])
if not value then
  return {0, '', ''}
end
return {redis.call('PTTL', KEYS[1]), value, redis.call('GET', KEYS[2]) or ''}
"""

#: Evicting a lease and releasing our own are the same write: delete it if it still holds ARGV[1].
_DELETE_IF_HELD_SCRIPT = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""

#: Prepended to a write script by `fence_script`: the LAST key is the lease key and the
#: LAST argument our lease value, so the write's own KEYS[1..]/ARGV[1..] keep their numbers.
_FENCE_GUARD = """
if redis.call('GET', KEYS[#KEYS]) ~= ARGV[#ARGV] then
  return redis.error_reply('FENCED: the lease no longer holds ' .. ARGV[#ARGV])
end
"""


class LeaseError(Exception):
    """A lease value that cannot be parsed, or a write refused because the lease is lost."""


class FencedWriteError(LeaseError):
    """Redis refused a write: this coordinator's lease (holder, fence) is no longer current."""


@dataclass(frozen=True)
class LeaseRecord:
    """What the lease key holds: who is active, its fencing number, where workers reach it.

    Attributes:
        fence: the fencing number, larger for every new holder (never reused).
        holder: the holder's id (host, pid and a random part, so a restart is a new holder).
        address: the "host:port" workers should use (`--advertise`).
    """

    fence: int
    holder: str
    address: str

    def __post_init__(self) -> None:
        if self.fence < 1:
            raise LeaseError(f"lease fence must be >= 1, got {self.fence}")
        for name, text in (("holder", self.holder), ("address", self.address)):
            if not text or _SEPARATOR in text:
                raise LeaseError(f"lease {name} {text!r} must be non-empty and free of '|'")

    def encode(self) -> str:
        """The value stored at the lease key; the Lua scripts compare it byte for byte."""
        return f"{self.fence}{_SEPARATOR}{self.holder}{_SEPARATOR}{self.address}"

    @classmethod
    def decode(cls, value: str | bytes) -> LeaseRecord:
        """Parse a lease value read from Redis (a peer's claim: checked, not trusted).

        Raises:
            LeaseError: not "fence|holder|address" with a positive integer fence.
        """
        text = value.decode() if isinstance(value, bytes) else value
        parts = text.split(_SEPARATOR)
        if len(parts) != 3 or not parts[0].isascii() or not parts[0].isdigit():
            raise LeaseError(f"lease value {text!r} is not 'fence|holder|address'")
        return cls(fence=int(parts[0]), holder=parts[1], address=parts[2])


@dataclass(frozen=True)
class LeaseView:
    """The lease key as a standby reads it.

    Attributes:
        record: the holder (None: the key is absent, or its value does not parse).
        left_s: its seconds left to live (0 when absent).
        value: the value at the key as read (None: absent).
        suspect: why no coordinator of ours could have written `value` (None: it could).
    """

    record: LeaseRecord | None
    left_s: float
    value: str | None = None
    suspect: str | None = None


def suspicion(value: str, ttl_ms: int, last_fence: str) -> tuple[LeaseRecord | None, str | None]:
    """The record at the key and why it cannot be a holder's of ours (None: it can be).

    Our scripts always write the key with a deadline and the fence they just drew from
    the counter, so a holder's value has a ttl and the counter's latest fence.

    Args:
        value: the key's value; ttl_ms: its PTTL (-1: no deadline); last_fence: the
            counter's value ("" when absent).
    """
    try:
        record = LeaseRecord.decode(value)
    except LeaseError:
        return None, "it is not 'fence|holder|address'"
    if ttl_ms < 0:
        return record, "it has no deadline (TTL), which every holder's value has"
    if last_fence != str(record.fence):
        issued = last_fence or "none"
        return record, f"its fence {record.fence} is not the last one issued ({issued})"
    return record, None


class SuspectWatch:
    """How long one suspect value has stayed at the lease key; expired after a ttl."""

    def __init__(self, ttl_s: float) -> None:
        self.ttl_s = ttl_s
        self._value: str | None = None
        self._since = 0.0

    def held_s(self, value: str, now: float) -> float | None:
        """Seconds `value` has been seen unchanged once that reaches the ttl, else None."""
        if value != self._value:
            self._value, self._since = value, now
        held = now - self._since
        return held if held >= self.ttl_s else None

    def clear(self) -> None:
        """The key holds no suspect value now."""
        self._value = None


def renew_interval_s(ttl_s: float) -> float:
    """How often the holder renews: ttl/3, so two renewals may fail before the deadline."""
    return ttl_s / 3


def poll_interval_s(ttl_s: float) -> float:
    """How often a standby looks at the lease: every 0.5 s, or ttl/6 for a short ttl."""
    return min(0.5, ttl_s / 6)


#: A standby wakes this long after the key's deadline (Redis expires it at the deadline).
EXPIRY_MARGIN_S = 0.02


def standby_pause_s(ttl_s: float, left_s: float) -> float:
    """How long a standby sleeps after seeing the lease held with `left_s` to live.

    It wakes just after the deadline rather than at its next poll, so a takeover costs
    the rest of the ttl, not that plus up to a poll interval; a renewal in between only
    means one more look.
    """
    return max(0.0, min(poll_interval_s(ttl_s), left_s + EXPIRY_MARGIN_S))


def takeover_delay_s(ttl_s: float, watched_s: float, seen_held: bool) -> float:
    """How long a standby that finds the key absent waits before it tries to take it.

    A standby that has watched the lease for a whole ttl takes it at once. One that came
    up while another held it, less than a ttl ago (typically the killed coordinator,
    restarted on its port by a supervisor within the lease's life), waits one poll
    interval: the standby that was there all along wins, instead of a coin toss between
    the two (the churn soak's finding 3). With no senior standby left it takes over that
    much later. A coordinator that never saw a holder (the first of a cluster) does
    not wait.
    """
    if not seen_held or watched_s >= ttl_s:
        return 0.0
    return poll_interval_s(ttl_s)


class LeaseTimer:
    """The holder's own view of its deadline, measured from before each renewal was sent.

    Redis starts the ttl when it runs the script, which is after we sent it, so counting
    from the send time makes our local deadline no later than Redis's: a holder that
    believes it is still active really is (short of clock-rate differences far below ttl).
    """

    def __init__(self, ttl_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        if not 0 < ttl_s < float("inf"):
            raise ValueError(f"lease ttl must be a positive number of seconds, got {ttl_s}")
        self.ttl_s = ttl_s
        self._clock = clock
        self._renewed_at: float | None = None

    def attempt(self) -> float:
        """The time a renewal (or acquisition) is about to be sent; pass it to `renewed`."""
        return self._clock()

    def renewed(self, sent_at: float) -> None:
        """Redis confirmed a renewal (or acquisition) that was sent at `sent_at`."""
        self._renewed_at = sent_at

    def lost(self) -> None:
        """The lease is gone (demoted); `expired` stays true until the next acquisition."""
        self._renewed_at = None

    def since_renewal_s(self) -> float | None:
        """Seconds since the last confirmed renewal was sent, None if never held."""
        return None if self._renewed_at is None else self._clock() - self._renewed_at

    def expired(self) -> bool:
        """True when the local deadline passed (or the lease was never held): demote."""
        since = self.since_renewal_s()
        return since is None or since >= self.ttl_s


def must_demote(ours: LeaseRecord, seen: LeaseRecord | None) -> bool:
    """Whether a holder that reads `seen` at the lease key has lost the lease.

    An absent key also demotes: the deadline passed in Redis, so a standby may take over at
    any moment; writing on would race it.
    """
    return seen is None or seen.fence != ours.fence or seen.holder != ours.holder


def _text(raw: object) -> str:
    """A Redis reply as text ("" for none)."""
    return raw.decode(errors="replace") if isinstance(raw, bytes) else str(raw or "")


def fence_script(body: str) -> str:
    """A write script guarded by the lease: run with the lease key appended to its keys and
    our lease value appended to its arguments (`RedisLease.fenced_call` does both)."""
    return _FENCE_GUARD + body


class RedisLease:
    """One coordinator's handle on the lease keys `gradsync:lease:<name>` (and `:fence`)."""

    def __init__(
        self,
        client: redis.Redis,
        holder: str,
        address: str,
        ttl_s: float = DEFAULT_LEASE_TTL_S,
        name: str = "coordinator",
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """Args:
        client: a redis-py client (with socket timeouts: every wait is bounded).
        holder: this coordinator's id, unique per process start.
        address: the "host:port" shown to workers and the other coordinator.
        ttl_s: the lease's lifetime after each renewal.
        name: the lease's name in the keys; coordinators of one job share it.
        clock: monotonic seconds (a test seam).
        """
        if not name or ":" in name:
            raise ValueError(f"lease name {name!r} must be non-empty and free of ':'")
        self.client = client
        self.holder = holder
        self.address = address
        self.timer = LeaseTimer(ttl_s, clock)
        self.key = f"gradsync:lease:{name}"
        self.fence_key = f"gradsync:lease:{name}:fence"
        #: Our record while we hold the lease, None as a standby.
        self.held: LeaseRecord | None = None
        #: Writes Redis refused because the lease was no longer ours.
        self.refused_writes = 0
        self._acquire = client.register_script(_ACQUIRE_SCRIPT)
        self._renew = client.register_script(_RENEW_SCRIPT)
        self._observe = client.register_script(_OBSERVE_SCRIPT)
        self._release = self._evict = client.register_script(_DELETE_IF_HELD_SCRIPT)
        # Checked at once so a bad holder/address fails at start, not at the first takeover.
        LeaseRecord(1, holder, address)

    @property
    def ttl_ms(self) -> int:
        return max(1, round(self.timer.ttl_s * 1000))

    def current(self) -> LeaseRecord | None:
        """The lease as Redis holds it now (None: no holder, anyone may take it)."""
        value = self.client.get(self.key)
        return None if value is None else LeaseRecord.decode(value)

    def observe(self) -> LeaseView:
        """The lease now, its seconds left to live and the fence counter, read atomically."""
        left_ms, raw, last_fence = self._observe(keys=[self.key, self.fence_key])
        if not raw:
            return LeaseView(None, 0.0)
        value = _text(raw)
        record, suspect = suspicion(value, int(left_ms), _text(last_fence))
        # PTTL -1 (a key without deadline) cannot come from our scripts: a full ttl, so a
        # standby keeps looking at its usual pace until the value is treated as expired.
        left_s = int(left_ms) / 1000 if int(left_ms) >= 0 else self.timer.ttl_s
        return LeaseView(record, left_s, value, suspect)

    def evict(self, value: str) -> bool:
        """Delete the key if it still holds exactly `value` (a suspect one); True if it did."""
        return bool(int(self._evict(keys=[self.key], args=[value])))

    def try_acquire(self) -> LeaseRecord | None:
        """Take the lease if nobody holds it; return our record, or None (someone does)."""
        sent_at = self.timer.attempt()
        taken, value = self._acquire(
            keys=[self.key, self.fence_key], args=[self.holder, self.address, self.ttl_ms]
        )
        if not int(taken):
            return None
        record = LeaseRecord.decode(value)
        self.timer.renewed(sent_at)
        self.held = record
        return record

    def renew(self) -> bool:
        """Extend our lease; False (and demoted locally) if it is no longer ours or late."""
        if self.held is None:
            return False
        sent_at = self.timer.attempt()
        if self.timer.expired():
            # Past our own deadline a standby may already be active: renewing now could
            # "succeed" only if nobody took it, but writes in between were unsafe. Demote.
            self._demote("missed the renewal deadline")
            return False
        if int(self._renew(keys=[self.key], args=[self.held.encode(), self.ttl_ms])):
            self.timer.renewed(sent_at)
            return True
        self._demote("the lease key no longer holds our value")
        return False

    def release(self) -> None:
        """Give the lease up (graceful shutdown) so a standby takes over without waiting."""
        if self.held is not None:
            self._release(keys=[self.key], args=[self.held.encode()])
            self._demote("released")

    def fenced_call(self, script: Any, keys: Sequence[Any], args: Sequence[Any]) -> Any:
        """Run a `fence_script` write with the lease key and our value appended.

        Raises:
            FencedWriteError: we hold no lease, or Redis found another value at the key.
        """
        import redis as redis_module

        held = self._current()
        try:
            return script(keys=[*keys, self.key], args=[*args, held.encode()])
        except redis_module.ResponseError as exc:
            if "FENCED" not in str(exc):
                raise
            self.refused_writes += 1
            self._demote("Redis refused a fenced write")
            raise FencedWriteError(
                f"write refused by Redis: coordinator {self.holder} with fence {held.fence} "
                f"lost the lease ({exc})"
            ) from exc

    def write_token(self) -> tuple[str, str]:
        """(lease key, our value) for a store write to check in Redis, atomically with it.

        Raises:
            FencedWriteError: we hold no current lease (refused before any write).
        """
        return self.key, self._current().encode()

    def _current(self) -> LeaseRecord:
        """Our record, if we hold a lease that has not expired by our own clock.

        Raises:
            FencedWriteError: we do not (counted as a refused write).
        """
        if self.held is None or self.timer.expired():
            self.refused_writes += 1
            raise FencedWriteError(
                f"write refused: coordinator {self.holder} holds no current lease "
                f"(fence {self.held.fence if self.held else 'none'})"
            )
        return self.held

    def _demote(self, why: str) -> None:
        if self.held is not None:
            log.warning(
                "lease %s: demoted (%s); holder %s, fence %d",
                self.key,
                why,
                self.holder,
                self.held.fence,
            )
        self.held = None
        self.timer.lost()
