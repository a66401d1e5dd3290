"""The churn soak's failures, injected one every interval, and the monitor that times them.

Five kinds, cycled in this order (a kind left out with `--churn-kinds` is
skipped): SIGKILL of a worker (its supervisor starts it again: it rejoins and
is healed), SIGSTOP of a worker for the heartbeat timeout + 2 s (the elastic
policy drops it; woken by SIGCONT it gets an error from the library, exits 3
and its supervisor starts it again, like a killed one), SIGKILL of the active
coordinator (the standby takes over; the killed one is started again as the
new standby), SIGKILL of one of the active leader's local shard processes
(the leader starts it again at its port) and a restart of redis-server
(SIGKILL, then the same port and data folder; every write was fsynced).

The `Monitor` samples the active coordinator's job status (membership epoch,
open step) ten times a second and the coordinators' resident memory every
two seconds; the soak's report computes each failure's time to detect and to
recover from these samples and the workers' logs (`churn_checks`).
"""

from __future__ import annotations

import os
import signal
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from gradsync_bench.churn_cluster import HEARTBEAT_TIMEOUT_S, Cluster, rss_mib

KINDS = ("worker-kill", "worker-stop", "coordinator-kill", "shard-kill", "redis-restart")
#: How long a SIGSTOPped worker stays frozen: past the heartbeat timeout, so it is dropped.
STOP_S = HEARTBEAT_TIMEOUT_S + 2.0
STATUS_POLL_S = 0.1
RSS_POLL_S = 2.0


@dataclass
class Failure:
    """One injected failure: what, when (wall clock, as the workers' logs), on whom."""

    kind: str
    at: float
    target: str
    detail: dict[str, Any] = field(default_factory=dict)


class Schedule:
    """Inject a failure every `interval_s`, cycling over `kinds`, until stopped."""

    def __init__(self, cluster: Cluster, kinds: tuple[str, ...], interval_s: float) -> None:
        self.cluster = cluster
        self.kinds = kinds
        self.interval_s = interval_s
        self.failures: list[Failure] = []
        self.errors: list[str] = []
        #: Failures not injected for want of a target (a rank restarting, no active leader).
        self.skipped: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="schedule", daemon=True)
        self._victims = 0

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=60)

    def _run(self) -> None:
        index = 0
        while not self._stop.wait(self.interval_s):
            kind = self.kinds[index % len(self.kinds)]
            index += 1
            try:
                failure = self.inject(kind)
            except Exception as exc:
                self.errors.append(f"{kind}: {type(exc).__name__}: {exc}")
                continue
            if failure is not None:
                self.failures.append(failure)
            else:
                self.skipped.append(f"{kind}: no target at {time.time():.3f}")

    def _active_index(self) -> int | None:
        """The active coordinator; asked up to 3 times (a health check can time out on a
        loaded host, and a failure then would silently not be injected)."""
        for _ in range(3):
            index = self.cluster.active_index()
            if index is not None:
                return index
            time.sleep(0.2)
        return None

    def _next_rank(self) -> int:
        rank = self._victims % self.cluster.config.world_size
        self._victims += 1
        return rank

    def inject(self, kind: str) -> Failure | None:
        """Inject one failure of `kind` now; None when it had no target (e.g. no shard)."""
        cluster = self.cluster
        if kind == "worker-kill":
            rank = self._next_rank()
            process = cluster.workers[rank].process
            if process is None:
                return None
            at = time.time()
            os.kill(process.pid, signal.SIGKILL)
            return Failure(kind, at, f"rank {rank}", {"pid": process.pid})
        if kind == "worker-stop":
            rank = self._next_rank()
            slot = cluster.workers[rank]
            process = slot.process
            if process is None:
                return None
            cluster.hold(slot, True)
            at = time.time()
            os.kill(process.pid, signal.SIGSTOP)
            self._stop.wait(STOP_S)
            os.kill(process.pid, signal.SIGCONT)
            cluster.hold(slot, False)
            return Failure(kind, at, f"rank {rank}", {"pid": process.pid, "stopped_s": STOP_S})
        if kind == "coordinator-kill":
            index = self._active_index()
            if index is None:
                return None
            process = cluster.coordinators[index].process
            if process is None:
                return None
            shards = cluster.shard_pids(index)
            at = time.time()
            os.kill(process.pid, signal.SIGKILL)
            return Failure(
                kind, at, f"coordinator{index}", {"pid": process.pid, "shard_pids": shards}
            )
        if kind == "shard-kill":
            index = self._active_index()
            shards = [] if index is None else cluster.shard_pids(index)
            if not shards:
                return None
            at = time.time()
            os.kill(shards[0], signal.SIGKILL)
            return Failure(kind, at, f"shard 1 of coordinator{index}", {"pid": shards[0]})
        if kind == "redis-restart":
            at = time.time()
            cluster.kill_redis()
            cluster.start_redis()
            return Failure(kind, at, "redis", {"down_s": time.time() - at})
        raise ValueError(f"unknown failure kind {kind!r}; known: {', '.join(KINDS)}")


@dataclass
class Sample:
    """One status sample of the active coordinator."""

    t: float
    active: int | None
    epoch: int
    open_step: int
    members: int


class Monitor:
    """Samples the job status and the coordinators' memory in a background thread."""

    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster
        self.samples: list[Sample] = []
        #: Per coordinator process (pid): [(t, leader RSS MiB, leader + shards RSS MiB)].
        self.rss: dict[int, list[tuple[float, float, float]]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="monitor", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    def _run(self) -> None:
        from gradsync import query_status

        last_rss = 0.0
        while not self._stop.wait(STATUS_POLL_S):
            now = time.time()
            active = self.cluster.active_index()
            if active is not None:
                try:
                    reply = query_status(self.cluster.addresses[active], "default", timeout_s=1)
                except ConnectionError:
                    reply = None
                if reply is not None and reply.jobs:
                    job = reply.jobs[0]
                    self.samples.append(
                        Sample(
                            now,
                            active,
                            int(job.membership_epoch),
                            int(job.open_step),
                            len(job.members),
                        )
                    )
            if now - last_rss >= RSS_POLL_S:
                last_rss = now
                self._sample_rss(now)

    def _sample_rss(self, now: float) -> None:
        for index, slot in enumerate(self.cluster.coordinators):
            process = slot.process
            if process is None or process.poll() is not None:
                continue
            leader = rss_mib(process.pid)
            if leader is None:
                continue
            total = leader + sum(rss_mib(pid) or 0.0 for pid in self.cluster.shard_pids(index))
            self.rss.setdefault(process.pid, []).append((now, leader, total))
