"""Metrics, trace and log of a `gradsync.DiLoCo` rank: one record per outer round.

A DiLoCo user asks different questions than a per-step user: how long a
round takes against the inner steps it hides behind, how many bytes it moves
each way, how long the inner loop actually *waited* for it (the exposed
wait: all of the round without overlap, the part the overlap did not hide
with it), and how many ranks contributed. So a DiLoCo object keeps its own
registry, endpoint and trace, and the per-step wrappers it drives inside
(one per fragment) export none of theirs: their "steps" are rounds, and
their numbers would only repeat these under a misleading name.

Rank 0 also logs every round (rounds are rare, a line each is cheap), so the
numbers are there without a metrics stack.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from pathlib import Path

from gradsync_proto.net.exposition import (
    LATENCY_BUCKETS_S,
    MetricsServer,
    rank_metric,
    serve_metrics,
)
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from gradsync import defaults
from gradsync.path.trace import AUTOGRAD_TRACK, TRANSPORT_TRACK, StepTracer

log = logging.getLogger("gradsync.client")

#: Round times run from a fraction of a second (loopback) to minutes (a slow link).
ROUND_BUCKETS_S = (*LATENCY_BUCKETS_S, 120.0, 300.0, 600.0)


@dataclass(frozen=True)
class RoundRecord:
    """What one fragment's round did, as the rank saw it.

    Attributes:
        fragment: the fragment's index (0 without streaming).
        inner_step: the inner step the round started at.
        started, finished: `StepTracer.now()` readings at upload start and answer.
        sent_bytes: pseudo-gradient bytes uploaded, as sent (after the wire's cast).
        received_bytes: answer bytes received (the new global parameters).
        contributors: ranks whose on-time pseudo-gradients the round averaged (0 when
            this rank's own was late).
        exposed_s: how long the inner loop waited for the answer when it merged it.
        late: the round closed without this rank (it was handed the global parameters).
        merged_late: late contributions of earlier rounds merged into this one.
        staleness: the stalest of those, in rounds (0: none).
    """

    fragment: int
    inner_step: int
    started: float
    finished: float
    sent_bytes: int
    received_bytes: int
    contributors: int
    exposed_s: float
    late: bool = False
    merged_late: int = 0
    staleness: int = 0

    @property
    def seconds(self) -> float:
        return self.finished - self.started


class DiLoCoInstruments:
    """Metrics (when a port is given) and trace (when a path is given) of one rank.

    Args:
        rank: the rank, the `rank` label of every metric.
        metrics_port: port of /metrics (0 = a free one), None = no metrics.
        trace_path: Chrome trace file of the rounds, None = no trace.
        metrics_host: interface /metrics binds; None = loopback.
    """

    def __init__(
        self,
        rank: int,
        metrics_port: int | None,
        trace_path: Path | None,
        metrics_host: str | None = None,
    ) -> None:
        self.rank = rank
        self.registry: CollectorRegistry | None = None
        self.server: MetricsServer | None = None
        self.tracer = StepTracer(trace_path, rank) if trace_path is not None else None
        if metrics_port is None:
            return
        self.registry = CollectorRegistry()
        counter = functools.partial(rank_metric, Counter, registry=self.registry, rank=rank)
        gauge = functools.partial(rank_metric, Gauge, registry=self.registry, rank=rank)
        histogram = functools.partial(rank_metric, Histogram, registry=self.registry, rank=rank)
        self._inner_steps = counter(
            "gradsync_diloco_inner_steps_total",
            "Inner steps this rank took (calls of DiLoCo.step).",
        )
        self._rounds = Counter(
            "gradsync_diloco_rounds_total",
            "Outer rounds merged, per fragment.",
            ["rank", "fragment"],
            registry=self.registry,
        )
        self._round_seconds = histogram(
            "gradsync_diloco_round_seconds",
            "One fragment's round, from its upload's start to the new global parameters.",
            buckets=ROUND_BUCKETS_S,
        )
        self._exposed = histogram(
            "gradsync_diloco_exposed_wait_seconds",
            "Time the inner loop waited for a round's answer (communication not hidden).",
            buckets=ROUND_BUCKETS_S,
        )
        self._sent = counter(
            "gradsync_diloco_sent_bytes_total", "Pseudo-gradient bytes uploaded, as sent."
        )
        self._received = counter(
            "gradsync_diloco_received_bytes_total",
            "Global-parameter bytes received in rounds' answers.",
        )
        self._round_bytes = Gauge(
            "gradsync_diloco_last_round_bytes",
            "Bytes the latest round moved, by direction (up: sent, down: received).",
            ["rank", "direction"],
            registry=self.registry,
        )
        self._contributors = gauge(
            "gradsync_diloco_last_round_contributors",
            "Ranks whose pseudo-gradients the latest round averaged.",
        )
        self._late = counter(
            "gradsync_diloco_late_rounds_total",
            "Rounds that closed without this rank's contribution (it came late).",
        )
        self._merged_late = counter(
            "gradsync_diloco_merged_late_total",
            "Late contributions of earlier rounds merged into this rank's rounds.",
        )
        self._staleness = gauge(
            "gradsync_diloco_last_round_staleness",
            "Rounds of staleness of the stalest late contribution merged in the latest round.",
        )
        self.server = serve_metrics(
            metrics_port, self.registry, host=metrics_host or defaults.WORKER_METRICS_HOST
        )
        log.info("rank %d: DiLoCo metrics at %s", rank, self.server.url)

    def inner_step(self) -> None:
        """Count one inner step."""
        if self.registry is not None:
            self._inner_steps.inc()

    def round_merged(self, record: RoundRecord, round_number: int) -> None:
        """Record a merged round everywhere it is wanted."""
        if self.registry is not None:
            self._rounds.labels(rank=str(self.rank), fragment=str(record.fragment)).inc()
            self._round_seconds.observe(record.seconds)
            self._exposed.observe(record.exposed_s)
            self._sent.inc(record.sent_bytes)
            self._received.inc(record.received_bytes)
            self._round_bytes.labels(rank=str(self.rank), direction="up").set(record.sent_bytes)
            self._round_bytes.labels(rank=str(self.rank), direction="down").set(
                record.received_bytes
            )
            self._contributors.set(record.contributors)
            self._late.inc(int(record.late))
            self._merged_late.inc(record.merged_late)
            self._staleness.set(record.staleness)
        if self.tracer is not None:
            name = f"round (fragment {record.fragment})"
            self.tracer.span(
                name, round_number, record.started, record.finished, track=TRANSPORT_TRACK
            )
            if record.exposed_s > 0:
                finished = self.tracer.now()
                self.tracer.span(
                    "wait for round",
                    round_number,
                    finished - record.exposed_s,
                    finished,
                    track=AUTOGRAD_TRACK,
                )
            self.tracer.flush()
        if self.rank == 0:
            log.info(
                "round %d (fragment %d, from inner step %d): %.3f s, %.2f MB up, %.2f MB "
                "down, %d contributors%s, inner loop waited %.3f s",
                round_number,
                record.fragment,
                record.inner_step,
                record.seconds,
                record.sent_bytes / 1e6,
                record.received_bytes / 1e6,
                record.contributors,
                f", {record.merged_late} late merged (staleness {record.staleness})"
                if record.merged_late
                else " (this rank late)"
                if record.late
                else "",
                record.exposed_s,
            )

    def close(self) -> None:
        """Stop the endpoint and finish the trace. Idempotent."""
        if self.tracer is not None:
            self.tracer.close()
        if self.server is not None:
            self.server.close()
            self.server = None
