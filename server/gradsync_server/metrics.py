"""Prometheus metrics of the coordinator, and straggler attribution.

The coordinator sees every byte of every rank, so it is where throughput,
per-bucket and per-step latency, and *which rank is late* can be measured.
`CoordinatorMetrics` owns the metric objects in a registry of its own (never
prometheus_client's global one, so tests and several coordinators in one
process stay independent) and offers one method per event the servicer
observes. Those methods run per chunk or per bucket, so labelled children are
bound once and each call is a counter increment or a histogram observation.

Label sets are bounded: `rank` by the world size (no `job` label: job ids
are chosen by users, unbounded over a coordinator's life), `reason` by the
gRPC status code names, `kind` by the error kinds the caller chooses. A step number is
never a label (each step would be a new series); the latest one is the
`gradsync_current_step` gauge.

`CoordinatorMetrics` is the core's `StepObserver`
(`gradsync_server.dataplane.observer`): the open step reports to it without
importing Prometheus. Its `lag_tracker` (pure, in the observer module) names
the ranks that are persistently behind.
"""

from __future__ import annotations

import functools
import math
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import TypeVar, cast

from gradsync_proto.codes import Code
from gradsync_proto.net.exposition import LATENCY_BUCKETS_S
from gradsync_proto.v1 import gradsync_pb2 as pb
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.registry import Collector

from gradsync_server.dataplane.observer import LagTracker
from gradsync_server.recovery_metrics import RecoveryMetrics

__all__ = ["CoordinatorMetrics", "LagTracker", "ShardSample"]

#: How many recent buckets `ShardStats.mean_bucket_s` averages over.
BUCKET_TIMES_KEPT = 100


#: A metric family (`Counter`, `Histogram`, ...): `_child` returns one of its own kind.
_Family = TypeVar("_Family", bound=MetricWrapperBase)


class CoordinatorMetrics:
    """The metrics the coordinator exports, and the straggler tracker fed with them.

    Args:
        registry: where the metrics are registered; a fresh private registry
            when None (never prometheus_client's global one).
        lag_window: window of the `lag_tracker`'s per-rank means.
        shard: a coordinator shard's metrics: the same names (one dashboard query
            covers the leader and every shard), plus `gradsync_shard_index`.

    Attributes:
        registry: serve it with `gradsync_proto.net.exposition.serve_metrics`.
        lag_tracker: per-rank windowed mean lag, fed by `observe_bucket_arrival`.
    """

    def __init__(
        self, registry: CollectorRegistry | None = None, lag_window: int = 50, shard: bool = False
    ) -> None:
        self.registry = CollectorRegistry() if registry is None else registry
        self.lag_tracker = LagTracker(lag_window)
        # Every metric of this coordinator lives in its own registry.
        counter = functools.partial(Counter, registry=self.registry)
        gauge = functools.partial(Gauge, registry=self.registry)
        histogram = functools.partial(Histogram, registry=self.registry)
        self._shard_index: Gauge | None = None
        if shard:
            self._shard_index = gauge(
                "gradsync_shard_index",
                "The index this coordinator shard serves (-1 until its leader accepts it).",
            )
            self._shard_index.set(-1)
        self._received_bytes = counter(
            "gradsync_received_bytes_total", "Gradient payload bytes received from workers."
        )
        self._sent_bytes = counter(
            "gradsync_sent_bytes_total",
            "Averaged gradient payload bytes sent to workers (counted once per receiving rank).",
        )
        self._segment_bytes = counter(
            "gradsync_segment_bytes",
            "Gradient payload bytes read from (and averages written into) the shared-memory "
            "segments of same-host local leaders instead of TCP (also counted in the "
            "received/sent totals).",
            ["direction"],
        )
        self._chunks_received = counter(
            "gradsync_chunks_received_total", "Gradient chunks received."
        )
        self._buckets_completed = counter(
            "gradsync_buckets_completed_total", "Buckets whose average was sent to every rank."
        )
        self._steps_completed = counter(
            "gradsync_steps_completed_total", "Steps whose every bucket was averaged."
        )
        self._bucket_round_trip = histogram(
            "gradsync_bucket_round_trip_seconds",
            "From the first chunk of a bucket arriving to its last averaged chunk sent.",
            buckets=LATENCY_BUCKETS_S,
        )
        self._step_sync = histogram(
            "gradsync_step_sync_seconds",
            "From the first chunk of a step arriving to the step complete.",
            buckets=LATENCY_BUCKETS_S,
        )
        self._workers_alive = gauge(
            "gradsync_workers_alive", "Workers currently joined, over all jobs."
        )
        self._membership_epoch = gauge(
            "gradsync_membership_epoch", "Membership epoch after the latest membership change."
        )
        self._current_step = gauge(
            "gradsync_current_step", "Step number of the latest completed step."
        )
        self._jobs = gauge("gradsync_jobs", "Jobs the coordinator currently holds.")
        self._rank_lag_family = histogram(
            "gradsync_rank_lag_seconds",
            "Per bucket (a process group's: per collective), how long after the first "
            "rank's arrival this rank's arrival came (the first rank observes 0).",
            ["rank"],
            buckets=LATENCY_BUCKETS_S,
        )
        self._rejected_family = counter(
            "gradsync_rejected_messages_total",
            "Worker messages refused, by reason (a gRPC status code name).",
            ["reason"],
        )
        self._aborts_family = counter(
            "gradsync_step_aborts_total",
            "Steps aborted, by reason (a gRPC status code name).",
            ["reason"],
        )
        self._nonfinite_family = counter(
            "gradsync_nonfinite_contributions_total",
            "Contributions (one rank's bucket of one step) that held NaN or Inf, by rank "
            "(counted under --nonfinite report and abort; allow checks nothing).",
            ["rank"],
        )
        self._contribution_norm = gauge(
            "gradsync_contribution_norm",
            "The norm of each rank's contribution (DiLoCo: pseudo-gradient; DDP: gradient) "
            "in the latest round or step (over the byte range this process screens).",
            ["rank"],
        )
        self._contribution_cosine = gauge(
            "gradsync_contribution_cosine",
            "Cosine of each rank's contribution in the latest round or step to the "
            "sum of the other ranks' (NaN where there is none or it is not measured).",
            ["rank"],
        )
        self._contribution_excluded = counter(
            "gradsync_contribution_excluded_total",
            "Rounds or steps in which the screen left (part of) a rank's contribution out.",
            ["rank"],
        )
        self._contribution_flagged = counter(
            "gradsync_contribution_flagged_total",
            "Rounds or steps in which the screen flagged a rank's contribution (any policy).",
            ["rank"],
        )
        self._collectives_family = counter(
            "gradsync_collectives_total",
            "Collectives completed (the backend's operations and the wrappers' collectives), "
            'by op ("all_reduce_sum", "broadcast", "reduce_scatter_avg", ...).',
            ["op"],
        )
        self._collective_bytes_family = counter(
            "gradsync_collective_bytes_total",
            "Payload bytes of completed collectives, by op and direction: received (every "
            "rank's input) and sent (every rank's result, counted once per receiving rank).",
            ["op", "direction"],
        )
        self._errors_family = counter(
            "gradsync_errors_total", "Unexpected errors inside the coordinator, by kind.", ["kind"]
        )
        self._round_window = gauge(
            "gradsync_round_window_seconds",
            'The adaptive grace window of DiLoCo rounds (round_deadline_s="auto") after '
            "the latest round closed; NaN while there is none yet.",
        )
        self._round_missed_family = counter(
            "gradsync_round_missed_total",
            "DiLoCo rounds with the adaptive deadline that closed without this rank.",
            ["rank"],
        )
        # Bound children by family and label values (`_child`): `.labels()` takes a
        # lock and builds a tuple key on every call, too much for the per-bucket path.
        self._children: dict[tuple[object, ...], MetricWrapperBase] = {}
        #: Time to detect, time to recover, restarts and steps recomputed.
        self.recovery = RecoveryMetrics(self.registry)
        # Plain copies of the gradient counters: a sharded coordinator reports them
        # (ShardStats, ShardStatus) without reading prometheus_client's internals.
        self._totals = _Totals()

    # Per chunk.
    def observe_chunk(self, nbytes: int) -> None:
        """One gradient chunk with `nbytes` of payload arrived from a worker."""
        self._chunks_received.inc()
        self._received_bytes.inc(nbytes)
        self._totals.received += nbytes

    def observe_segment_bytes(self, direction: str, nbytes: int) -> None:
        """`nbytes` moved through a worker's segment: direction "read" or "written"."""
        self._segment_bytes.labels(direction).inc(nbytes)

    # Per bucket.
    def observe_bucket_arrival(self, rank: int, lag_s: float) -> None:
        """`rank`'s contribution to a bucket began `lag_s` after the first rank's (0 if first);
        a process group's collectives report their inputs' lag the same way.

        Feeds both the per-rank histogram and `lag_tracker`.
        """
        self.lag_tracker.record(rank, lag_s)
        self._child(self._rank_lag_family, str(rank)).observe(lag_s)

    def observe_bucket_done(self, round_trip_s: float, sent_bytes: int) -> None:
        """A bucket's average went out to every rank.

        Args:
            round_trip_s: from its first chunk arriving to its last averaged chunk sent.
            sent_bytes: averaged payload bytes sent, summed over the receiving ranks.
        """
        self._buckets_completed.inc()
        self._bucket_round_trip.observe(round_trip_s)
        self._sent_bytes.inc(sent_bytes)
        totals = self._totals
        totals.sent += sent_bytes
        totals.buckets += 1
        totals.bucket_times.append(round_trip_s)

    # Per step.
    def observe_step_done(self, sync_s: float, step: int) -> None:
        """Step `step` completed `sync_s` after its first chunk arrived."""
        self._steps_completed.inc()
        self._step_sync.observe(sync_s)
        self._current_step.set(step)
        self.recovery.step_done()

    def observe_restart(self, continued: bool, steps_recomputed: int) -> None:
        """A restarted job went on: from the ranks' own state or from a checkpoint."""
        self.recovery.restarted(continued, steps_recomputed)

    def observe_round_window(self, window_s: float | None, missed: tuple[int, ...]) -> None:
        """A round with the adaptive deadline closed: its next window, and who missed it."""
        self._round_window.set(math.nan if window_s is None else window_s)
        for rank in missed:
            self._round_missed_family.labels(rank=str(rank)).inc()

    # Per collective.
    def observe_collective(self, op: str, received_bytes: int, sent_bytes: int) -> None:
        """A collective completed: `op` its name, the bytes of its inputs and results."""
        self._child(self._collectives_family, op).inc()
        self._child(self._collective_bytes_family, op, "received").inc(received_bytes)
        self._child(self._collective_bytes_family, op, "sent").inc(sent_bytes)

    # Rare events.
    def observe_rejection(self, reason: str) -> None:
        """A worker message was refused; `reason` is a status code name, e.g. INVALID_ARGUMENT."""
        self._child(self._rejected_family, reason).inc()

    def observe_step_aborted(self, aborted: pb.StepAborted) -> None:
        """Count a StepAborted sent to workers: by reason, and a rejection by its code."""
        reason = pb.AbortReason.Name(aborted.reason).removeprefix("ABORT_REASON_")
        if aborted.reason == pb.ABORT_REASON_PEER_MESSAGE_REJECTED:
            return  # the culprit's own message counts this abort once
        if aborted.reason == pb.ABORT_REASON_MESSAGE_REJECTED:
            self.observe_rejection(Code(aborted.code).name)
        self.observe_abort(reason)

    def observe_abort(self, reason: str) -> None:
        """A step was aborted; `reason` is a status code name, e.g. ABORTED."""
        self._child(self._aborts_family, reason).inc()

    def observe_nonfinite(self, rank: int) -> None:
        """`rank` sent NaN or Inf in a bucket (counted once per rank, step and bucket)."""
        self._child(self._nonfinite_family, str(rank)).inc()

    def observe_contribution(
        self, rank: int, norm: float, cosine: float, flagged: bool, excluded: bool
    ) -> None:
        """`rank`'s contribution to a round or step: its norm, cosine, what the screen did."""
        label = str(rank)
        self._contribution_norm.labels(label).set(norm)
        self._contribution_cosine.labels(label).set(cosine)
        if flagged:
            self._contribution_flagged.labels(label).inc()
        if excluded:
            self._contribution_excluded.labels(label).inc()

    def observe_error(self, kind: str) -> None:
        """An unexpected error; `kind` is a bounded name (the exception class), not a message."""
        self._child(self._errors_family, kind).inc()

    def _child(self, family: _Family, *values: str) -> _Family:
        """`family`'s child of these label values, bound once."""
        key = (id(family), *values)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = family.labels(*values)
        return cast(_Family, child)

    def set_membership(self, workers_alive: int, epoch: int, jobs: int) -> None:
        """After a join, leave or loss: the live workers, the new epoch, the jobs held."""
        self._workers_alive.set(workers_alive)
        self._membership_epoch.set(epoch)
        self._jobs.set(jobs)

    def slowest(self, k: int) -> list[tuple[int, float]]:
        """The `k` ranks with the largest mean lag (see `LagTracker.slowest`)."""
        return self.lag_tracker.slowest(k)

    def stats(self, buffered_bytes: int, connections: int) -> pb.ShardStats:
        """This process's gradient counters as a ShardStats (a shard's sign of life).

        Args:
            buffered_bytes: gradient bytes held right now (the caller's budget knows).
            connections: worker streams open right now.
        """
        totals = self._totals
        times = totals.bucket_times
        mean = math.fsum(times) / len(times) if times else 0.0
        return pb.ShardStats(
            bytes_received=totals.received,
            bytes_sent=totals.sent,
            buckets_completed=totals.buckets,
            mean_bucket_s=mean,
            buffered_bytes=buffered_bytes,
            connections=connections,
        )

    def set_shard_index(self, index: int) -> None:
        """A shard's leader accepted it as `index` (-1: lost it); nothing at a leader."""
        if self._shard_index is not None:
            self._shard_index.set(index)

    def watch_shards(self, source: Callable[[], Iterable[ShardSample]]) -> None:
        """Export the leader's view of its shards, read from `source` at every scrape.

        A collector rather than labelled gauges: shards come and go and change
        address, and a scrape must show exactly the current ones.
        """
        self.registry.register(_ShardCollector(source))


@dataclass
class _Totals:
    """Lifetime gradient totals kept beside the Prometheus counters (read for ShardStats)."""

    received: int = 0
    sent: int = 0
    buckets: int = 0
    #: The latest buckets' round trips: `ShardStats.mean_bucket_s` averages these
    #: (a lifetime mean would hide a shard that became slow).
    bucket_times: deque[float] = field(default_factory=lambda: deque(maxlen=BUCKET_TIMES_KEPT))


@dataclass(frozen=True)
class ShardSample:
    """One shard as the leader's metrics show it (index 0 = the leader itself)."""

    index: int
    address: str
    up: bool
    bytes_received_total: int
    bytes_sent_total: int
    last_seen_s: float


class _ShardCollector(Collector):
    """gradsync_shards_registered and the per-shard series, built at scrape time."""

    def __init__(self, source: Callable[[], Iterable[ShardSample]]) -> None:
        self._source = source

    def collect(self) -> Iterator[Metric]:
        samples = list(self._source())
        registered = GaugeMetricFamily(
            "gradsync_shards_registered",
            "Shards registered with the leader and alive (the leader, shard 0, not counted).",
        )
        registered.add_metric([], sum(1 for s in samples if s.up and s.index != 0))
        up = GaugeMetricFamily(
            "gradsync_shard_up",
            "1 while the shard is registered and heard from within the heartbeat timeout.",
            labels=["shard", "address"],
        )
        received = CounterMetricFamily(
            "gradsync_shard_bytes_received",
            "Gradient bytes the shard received from workers.",
            labels=["shard"],
        )
        sent = CounterMetricFamily(
            "gradsync_shard_bytes_sent",
            "Averaged gradient bytes the shard sent to workers.",
            labels=["shard"],
        )
        last_seen = GaugeMetricFamily(
            "gradsync_shard_last_seen_seconds",
            "Seconds since the leader last heard from the shard.",
            labels=["shard"],
        )
        for sample in samples:
            shard = str(sample.index)
            up.add_metric([shard, sample.address], 1.0 if sample.up else 0.0)
            received.add_metric([shard], sample.bytes_received_total)
            sent.add_metric([shard], sample.bytes_sent_total)
            last_seen.add_metric([shard], sample.last_seen_s)
        yield from (registered, up, received, sent, last_seen)
