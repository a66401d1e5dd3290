"""A coordinator shard's metrics: the leader's metric names, plus what its leader is told.

A shard aggregates with the same `OpenStep` as the leader, which reports to a
`CoordinatorMetrics`; subclassing it keeps the metric names identical (one
dashboard query covers the leader and every shard) and lets the shard keep
the few totals it sends its leader in every `ShardStats` without a second
set of hooks. Pure logic (Prometheus objects only), no gRPC, no asyncio.
"""

from __future__ import annotations

import math
from collections import deque

from gradsync_proto.v1 import gradsync_pb2 as pb
from prometheus_client import CollectorRegistry, Gauge

from gradsync_server.metrics import CoordinatorMetrics

#: How many recent buckets `ShardStats.mean_bucket_s` averages over (a lifetime mean
#: would hide a shard that became slow).
BUCKET_TIMES_KEPT = 100


class ShardMetrics(CoordinatorMetrics):
    """`CoordinatorMetrics` plus `gradsync_shard_index` and the totals of `ShardStats`.

    Args:
        registry: where the metrics are registered (a private one when None).
    """

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        super().__init__(registry)
        self._shard_index = Gauge(
            "gradsync_shard_index",
            "The index this coordinator shard serves (-1 until its leader accepts it).",
            registry=self.registry,
        )
        self._shard_index.set(-1)
        self.bytes_received = 0
        self.bytes_sent = 0
        self.buckets_completed = 0
        self._bucket_times: deque[float] = deque(maxlen=BUCKET_TIMES_KEPT)

    def set_shard_index(self, index: int) -> None:
        """The leader accepted this shard as `index` (-1: lost it)."""
        self._shard_index.set(index)

    def observe_chunk(self, nbytes: int) -> None:
        super().observe_chunk(nbytes)
        self.bytes_received += nbytes

    def observe_bucket_done(self, round_trip_s: float, sent_bytes: int) -> None:
        super().observe_bucket_done(round_trip_s, sent_bytes)
        self.bytes_sent += sent_bytes
        self.buckets_completed += 1
        self._bucket_times.append(round_trip_s)

    def stats(self, buffered_bytes: int, connections: int) -> pb.ShardStats:
        """The shard's sign of life for its leader, with its counters."""
        times = self._bucket_times
        return pb.ShardStats(
            bytes_received=self.bytes_received,
            bytes_sent=self.bytes_sent,
            buckets_completed=self.buckets_completed,
            mean_bucket_s=math.fsum(times) / len(times) if times else 0.0,
            buffered_bytes=buffered_bytes,
            connections=connections,
        )
