"""A worker's metrics and step trace, fed by the model wrapper and the transport.

One object fans each event out to the Prometheus metrics (when a metrics port
is set) and the Chrome trace (when a trace path is set); with neither it does
nothing, so the hot path pays one attribute lookup.
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

from gradsync.errors import StepAbortedError
from gradsync.metrics import WorkerMetrics
from gradsync.protocol.exposition import MetricsServer, serve_metrics
from gradsync.trace import TRANSPORT_TRACK, StepTracer

log = logging.getLogger("gradsync.client")


class Instruments:
    """Metrics and tracing of one rank.

    Args:
        rank: the worker's rank.
        metrics_port: port for /metrics (0 = a free one), or None for no metrics.
        trace_path: Chrome trace file, or None for no trace.
        bucket_bytes: size of each bucket (for byte counters).
    """

    def __init__(
        self, rank: int, metrics_port: int | None, trace_path: Path | None, bucket_bytes: list[int]
    ) -> None:
        self._bucket_bytes = bucket_bytes
        self._lock = threading.Lock()
        self._submitted: dict[tuple[int, int], float] = {}
        self._backward_started = 0.0
        self.metrics: WorkerMetrics | None = None
        self.server: MetricsServer | None = None
        if metrics_port is not None:
            self.metrics = WorkerMetrics(rank=rank)
            self.server = serve_metrics(metrics_port, self.metrics.registry)
            log.info("rank %d: metrics at %s", rank, self.server.url)
        self.tracer = StepTracer(trace_path, rank) if trace_path is not None else None

    @staticmethod
    def now() -> float:
        """The clock every span uses."""
        return time.perf_counter()

    def backward_started(self, step: int) -> None:
        """The first gradient of a synchronized backward pass landed."""
        self._backward_started = self.now()

    def bucket_ready(self, step: int, bucket_index: int) -> None:
        """A bucket's gradients are complete and handed to the transport."""
        with self._lock:
            self._submitted[(step, bucket_index)] = self.now()
        if self.metrics is not None:
            self.metrics.observe_sent(self._bucket_bytes[bucket_index])
        if self.tracer is not None:
            self.tracer.instant("ready", step, bucket_index)

    def on_bucket_event(self, event: str, step: int, bucket_index: int) -> None:
        """Transport-thread events: upload start / end, average complete."""
        if self.tracer is not None:
            if event == "upload_start":
                self.tracer.begin("upload", step, bucket_index)
            elif event == "upload_end":
                self.tracer.end("upload", step, bucket_index, TRANSPORT_TRACK)
        if event != "averaged":
            return
        finished = self.now()
        with self._lock:
            submitted = self._submitted.pop((step, bucket_index), None)
        if submitted is None:
            return
        if self.metrics is not None:
            self.metrics.observe_bucket_latency(finished - submitted)
            self.metrics.observe_received(self._bucket_bytes[bucket_index])
        if self.tracer is not None:
            self.tracer.span(
                "until averaged", step, submitted, finished, bucket_index, TRANSPORT_TRACK
            )

    def step_done(self, step: int, wait_started: float) -> None:
        """The averages of `step` are in place; backward is about to return."""
        finished = self.now()
        if self.metrics is not None:
            self.metrics.observe_exposed_comm(finished - wait_started)
            self.metrics.observe_step_done()
        if self.tracer is not None:
            self.tracer.span("wait for averages", step, wait_started, finished)
            self.tracer.span("backward", step, self._backward_started, finished)
            self.tracer.flush()

    def step_aborted(self, error: StepAbortedError) -> None:
        """A step ended in an abort instead of averages."""
        if self.metrics is not None:
            self.metrics.observe_abort(type(error).__name__)
        with self._lock:
            self._submitted.clear()

    def close(self) -> None:
        """Stop the metrics server and finish the trace file."""
        if self.tracer is not None:
            self.tracer.close()
        if self.server is not None:
            self.server.close()
