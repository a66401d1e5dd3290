"""The lease driver of a `--lease` / `--standby` coordinator: take over, renew, demote.

A standby polls the lease every `poll_interval_s(ttl)` and takes it when the key is absent
(expired or released); the active one renews every ttl/3. A holder that misses its own
deadline or finds another value at the key is demoted, and goes back to standing by
(`stand_down`): the gate closes first (every new call is refused), every stream ends with
UNAVAILABLE (the workers move on), its local shards stop, and its servicer, whose jobs
are of a history the new holder no longer shares, is replaced by a fresh one behind the
same port, health and gate, so a later takeover starts like a coordinator freshly
restarted on the store. Fenced store writes make a late write from the old servicer
harmless: it holds no lease, so its store refuses before sending, and Redis refuses
after.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Gauge

from gradsync_server.local_shards import LocalShards
from gradsync_server.rpc.standby_gate import StandbyGate
from gradsync_server.store.lease import (
    LeaseRecord,
    LeaseView,
    RedisLease,
    SuspectWatch,
    poll_interval_s,
    renew_interval_s,
    standby_pause_s,
    takeover_delay_s,
)
from gradsync_server.store.stores import parse_store_url

if TYPE_CHECKING:
    from gradsync_server.app import Running
    from gradsync_server.config import CoordinatorConfig
    from gradsync_server.rpc.leader_role import LeaderRole

log = logging.getLogger("gradsync.server.standby")


def holder_id() -> str:
    """Unique per process start: a restarted coordinator is a new holder with a new fence."""
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def _shown(record: LeaseRecord | None) -> str:
    if record is None:
        return "unknown (no lease holder now)"
    return f"{record.address} (holder {record.holder}, fence {record.fence})"


#: While Redis cannot be read, a standby says so at most this often (and once it can again).
_UNREADABLE_REPORT_S = 10.0


#: What a standby calls with True when the holder looks dead (`holder_late`), and with
#: False when it is seen renewing again.
Warm = Callable[[bool], Awaitable[None]]


def holder_late(ttl_s: float, left_s: float) -> bool:
    """True when the holder's key has under half its ttl left: the holder renews every
    ttl/3, so it has missed a renewal by at least half an interval (dead, frozen or cut off
    from Redis; or only slow, which costs a warm-up that is undone)."""
    return left_s < ttl_s / 2


async def _stand_by(
    lease: RedisLease, gate: StandbyGate, clock: Callable[[], float], warm: Warm | None = None
) -> LeaseRecord:
    """Refuse every call until this coordinator holds the lease; return our record.

    It looks at the key and its time to live (`RedisLease.observe`), sleeps until just
    after that deadline (`standby_pause_s`), and tries to take an absent key at once, or
    one poll interval later if it came up less than a ttl ago while another held it
    (`takeover_delay_s`): the standby that was there all along wins the takeover. A value
    no coordinator of ours wrote (`lease.suspicion`) is treated as expired once it has
    stayed unchanged for a ttl (`_evict_if_stale`).

    `warm(True)` is awaited when the holder is late (`holder_late`), so that what a
    takeover needs (local shard processes) starts during the rest of the ttl instead of
    after it; `warm(False)` when the holder is seen renewing again. Only a standby that
    has watched the lease for a ttl warms up.
    """
    ttl_s = lease.timer.ttl_s
    watch_started = clock()
    last_seen: LeaseRecord | None = None
    seen_since = clock()
    unreadable_since: float | None = None
    reported_at = 0.0
    suspects = SuspectWatch(ttl_s)
    while True:
        try:
            view = await asyncio.to_thread(lease.observe)
            if await _evict_if_stale(lease, view, suspects, clock):
                view = await asyncio.to_thread(lease.observe)
            taken = None
            if view.value is None:
                delay_s = takeover_delay_s(ttl_s, clock() - watch_started, last_seen is not None)
                if delay_s > 0:
                    await asyncio.sleep(delay_s)
                taken = await asyncio.to_thread(lease.try_acquire)
                if taken is None:  # another took it first (or it was renewed meanwhile)
                    view = await asyncio.to_thread(lease.observe)
        except Exception as exc:  # Redis down: stay a standby, say so, retry
            now = clock()
            if unreadable_since is None:
                unreadable_since = now
            if now - reported_at >= _UNREADABLE_REPORT_S:
                reported_at = now
                log.warning("standby: cannot read the lease (%s); retrying", exc)
            await asyncio.sleep(poll_interval_s(ttl_s))
            continue
        current, left_s = view.record, view.left_s
        if unreadable_since is not None:
            log.warning(
                "standby: the lease is readable again after %.1fs (held by %s)",
                clock() - unreadable_since,
                _shown(taken or current),
            )
            unreadable_since, reported_at = None, 0.0
        if taken is not None:
            log.warning(
                "took over the lease with fence %d (previous holder %s, last seen holding it "
                "%.2fs ago)",
                taken.fence,
                _shown(last_seen),
                clock() - seen_since,
            )
            return taken
        if current is not None:  # (seen holding it now: the takeover says how long ago)
            last_seen, seen_since = current, clock()
            # A junior standby (up less than a ttl, `takeover_delay_s`) leaves the takeover,
            # and the warm-up, to the senior one.
            if warm is not None and view.suspect is None and clock() - watch_started >= ttl_s:
                await warm(holder_late(ttl_s, left_s))
        gate.close(_shown(current))
        await asyncio.sleep(
            standby_pause_s(ttl_s, left_s)
            if current is not None and view.suspect is None
            else poll_interval_s(ttl_s)
        )


async def _evict_if_stale(
    lease: RedisLease, view: LeaseView, suspects: SuspectWatch, clock: Callable[[], float]
) -> bool:
    """Delete a suspect lease value that stayed a whole ttl (an ERROR line); True if deleted.

    A value without a deadline, or one our scripts could not have written, would keep
    every standby out for ever (and it demoted the holder that found it): after the
    lease's ttl it is treated as expired, as a holder's value would have expired by then.
    """
    if view.value is None or view.suspect is None:
        suspects.clear()
        return False
    held_s = suspects.held_s(view.value, clock())
    if held_s is None:
        return False
    log.error(
        "the lease key %s holds %r, which no coordinator wrote: %s; unchanged for %.1fs, "
        "longer than the lease's ttl (%gs): treated as expired and taken over (whoever can "
        "write to this Redis can disturb the lease: protect it)",
        lease.key,
        view.value[:200],
        view.suspect,
        held_s,
        lease.timer.ttl_s,
    )
    suspects.clear()
    return await asyncio.to_thread(lease.evict, view.value)


async def drive_lease(
    lease: RedisLease,
    gate: StandbyGate,
    on_active: Callable[[LeaseRecord], None],
    clock: Callable[[], float] = time.monotonic,
    warm: Warm | None = None,
) -> LeaseRecord | None:
    """Run until demoted; return the record that took over (None if unknown).

    Redis calls are blocking with the client's socket timeout; they run in a thread so
    the gRPC loop keeps serving (or refusing) meanwhile. `warm`: see `_stand_by`.
    """
    ttl_s = lease.timer.ttl_s
    taken = await _stand_by(lease, gate, clock, warm)
    gate.open()
    on_active(taken)
    while True:
        await asyncio.sleep(renew_interval_s(ttl_s))
        try:
            renewed = await asyncio.to_thread(lease.renew)
        except Exception as exc:  # one failed renewal is survivable; the deadline decides
            log.warning("lease renewal failed (%s)", exc)
            renewed = lease.held is not None and not lease.timer.expired()
        if not renewed:
            break
    try:
        winner = await asyncio.to_thread(lease.current)
    except Exception:
        winner = None
    gate.close(_shown(winner))
    log.error("demoted: coordinator at %s took over", _shown(winner))
    return winner


class LeaseMetrics:
    """gradsync_takeovers_total, gradsync_lease_fence and gradsync_coordinator_active."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.takeovers = Counter(
            "gradsync_takeovers", "times this coordinator took over the lease", registry=registry
        )
        self.fence = Gauge(
            "gradsync_lease_fence",
            "fencing number of the lease this coordinator holds (0: none)",
            registry=registry,
        )
        self.active = Gauge(
            "gradsync_coordinator_active",
            "1 while this coordinator holds the lease, else 0",
            registry=registry,
        )


def lease_for(
    config: CoordinatorConfig, port: int, registry: CollectorRegistry
) -> tuple[RedisLease, LeaseMetrics]:
    """The lease handle of a `--lease` coordinator on its redis:// checkpoint store."""
    import redis

    # Bounded below the ttl so a hung Redis cannot hold a renewal past the deadline unseen.
    timeout_s = min(config.store_timeout_s, max(0.2, config.lease_ttl_s / 3))
    url = parse_store_url(config.checkpoint_store or "").target
    client = redis.Redis.from_url(
        url,
        password=config.redis_password,
        socket_timeout=timeout_s,
        socket_connect_timeout=timeout_s,
    )
    lease = RedisLease(client, holder_id(), config.advertised(port), ttl_s=config.lease_ttl_s)
    return lease, LeaseMetrics(registry)


async def take_part(
    config: CoordinatorConfig,
    running: Running[LeaderRole],
    lease: RedisLease,
    metrics: LeaseMetrics,
    stop: asyncio.Event,
    set_health: Callable[..., Awaitable[None]],
) -> int:
    """Stand by, take over, serve, and stand by again when demoted; return 0 on SIGTERM."""
    gate = running.gate
    if gate is None:
        raise RuntimeError("take_part needs a coordinator started with a standby gate")
    # A standby has nothing to watch (no job, no stream, no shard) and would only log that
    # its shards are missing: the watchdog runs while this coordinator is active.
    if running.watchdog is not None:
        running.watchdog.cancel()
    stopped = asyncio.create_task(stop.wait())
    sharded = config.local_shards and config.shard_count > 1

    async def warm(holder_is_late: bool) -> None:
        # A leader's local shards are its children, started with the servicer's config,
        # which holds the shard token `app.start` generated (the caller's `config` has
        # none). Their processes take a second or more to start: a standby starts them as
        # soon as the holder is late, and they register once it has taken over.
        if not sharded or gate.active:
            return
        if holder_is_late and running.local_shards is None:
            log.info("the lease holder missed a renewal: starting the local shards ahead")
            running.local_shards = LocalShards(running.servicer.config, running.port)
            await running.local_shards.start()
        elif not holder_is_late and running.local_shards is not None:
            log.info("the lease holder renews again: stopping the local shards started ahead")
            await running.local_shards.stop()
            running.local_shards = None

    while not stop.is_set():
        became_active = asyncio.Event()

        def on_active(record: LeaseRecord, became_active: asyncio.Event = became_active) -> None:
            # A job restarted from now on recovers from this moment, not from process start.
            running.servicer.metrics.recovery.became_active(record.fence)
            metrics.takeovers.inc()
            metrics.fence.set(record.fence)
            metrics.active.set(1)
            became_active.set()

        driver = asyncio.create_task(drive_lease(lease, gate, on_active, warm=warm))
        activated = asyncio.create_task(became_active.wait())
        pending: set[asyncio.Task[Any]] = {driver, stopped, activated}
        while True:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            if activated in done:
                running.watchdog = asyncio.create_task(running.servicer.watchdog.run())
                await set_health(running.health, running.config, serving=True)
                if sharded and running.local_shards is None:  # (none started ahead: `warm`)
                    running.local_shards = LocalShards(running.servicer.config, running.port)
                    await running.local_shards.start()
                continue
            break
        for task in pending - {stopped}:
            task.cancel()
        metrics.active.set(0)
        metrics.fence.set(0)
        if stopped in done:
            break
        running.servicer.metrics.recovery.lease_lost()
        await stand_down(running, set_health)
        log.warning(
            "standing by again: this coordinator serves nothing until it takes the lease back"
        )
    running.servicer.metrics.recovery.lease_lost()
    await asyncio.to_thread(lease.release)
    await running.stop()
    return 0


async def stand_down(
    running: Running[LeaderRole], set_health: Callable[..., Awaitable[None]]
) -> None:
    """Drop everything a demoted coordinator served and put a fresh servicer behind its port.

    The gate is already closed (`drive_lease`), so nothing reaches the new servicer
    before the next takeover, and the old one gets no new call while it winds down.
    """
    from gradsync_server.rpc.leader_role import LeaderRole

    old = running.servicer
    if running.switch is None:
        raise RuntimeError("stand_down needs a coordinator started with a servicer switch")
    await set_health(running.health, running.config, serving=False)
    await old.drain(0)  # every stream ends UNAVAILABLE (SHUTTING_DOWN): the workers move on
    old.shard_control.close_links()
    if running.local_shards is not None:
        await running.local_shards.stop()
        running.local_shards = None
    if running.watchdog is not None:
        running.watchdog.cancel()
    old.segments.close()
    old.checkpointer.close()  # its threads only: the store stays, fenced, for the next one
    fresh = LeaderRole(old.config, old.checkpointer.store, metrics=old.metrics)
    fresh.payload_endpoint = old.payload_endpoint  # the socket stays; the switch routes it
    running.servicer = fresh
    running.switch.switch(fresh)
    fresh.watchdog.check()  # one pass: the membership gauges say "no job" again
    log.info("demoted: dropped %d job(s) of the old history", len(old.jobs))
