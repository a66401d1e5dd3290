"""A worker's metrics and step trace, fed by the model wrapper and the transport.

One object fans each event out to the Prometheus metrics (when a metrics port
is set) and the Chrome trace (when a trace path is set); with neither it does
nothing, so the hot path pays one attribute lookup. It also keeps the running
totals behind rank 0's periodic step log ("steps 100-199: 41.2 ms/step, exposed
sync 3.1 ms/step, 2.4 MB up/step"), the numbers a user checks first when
training is slower than expected, without a metrics stack.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from gradsync_proto.net.exposition import MetricsServer, serve_metrics
from gradsync_proto.v1 import gradsync_pb2 as pb

from gradsync import defaults
from gradsync.errors import StepAbortedError
from gradsync.metrics import WorkerMetrics
from gradsync.path.trace import TRANSPORT_TRACK, StepTracer

log = logging.getLogger("gradsync.client")


class Instruments:
    """Metrics and tracing of one rank.

    Args:
        rank: the worker's rank.
        metrics_port: port for /metrics (0 = a free one), or None for no metrics.
        trace_path: Chrome trace file, or None for no trace.
        bucket_bytes: size of each bucket (for byte counters).
        log_every_steps: rank 0 logs step timing every this many steps (0 = never).
        metrics_host: interface /metrics binds; None = loopback (a worker's metrics are
            exposed beyond its host only when asked).
    """

    def __init__(
        self,
        rank: int,
        metrics_port: int | None,
        trace_path: Path | None,
        bucket_bytes: list[int],
        log_every_steps: int = 0,
        *,
        metrics_host: str | None = None,
    ) -> None:
        if log_every_steps < 0:
            raise ValueError(f"log_every_steps must be >= 0, got {log_every_steps}")
        self._rank = rank
        self._bucket_bytes = bucket_bytes
        self._lock = threading.Lock()
        self._submitted: dict[tuple[int, int], tuple[float, int]] = {}
        #: Local sums in progress (hierarchical aggregation): (step, bucket) -> start.
        self._local_started: dict[tuple[int, int], float] = {}
        self._backward_started = 0.0
        #: Gradient bytes handed to the link since construction (as sent: a comm
        #: hook that compresses to 16 bits halves them).
        self.bytes_sent = 0
        self._log_every_steps = log_every_steps if rank == 0 else 0
        self._window: _Window | None = None
        self.metrics: WorkerMetrics | None = None
        self.server: MetricsServer | None = None
        if metrics_port is not None:
            self.metrics = WorkerMetrics(rank=rank)
            self.server = serve_metrics(
                metrics_port,
                self.metrics.registry,
                host=metrics_host or defaults.WORKER_METRICS_HOST,
            )
            log.info("rank %d: metrics at %s", rank, self.server.url)
        self.tracer = StepTracer(trace_path, rank) if trace_path is not None else None

    @staticmethod
    def now() -> float:
        """The clock every span uses."""
        return time.perf_counter()

    def backward_started(self, step: int) -> None:
        """The first gradient of a synchronized backward pass landed."""
        self._backward_started = self.now()

    def bucket_ready(self, step: int, bucket_index: int, num_bytes: int) -> None:
        """A bucket's gradients (`num_bytes` on the wire) are handed to the transport."""
        with self._lock:
            self._submitted[(step, bucket_index)] = (self.now(), num_bytes)
            self.bytes_sent += num_bytes
        if self.metrics is not None:
            self.metrics.observe_sent(num_bytes)
        if self.tracer is not None:
            self.tracer.instant("ready", step, bucket_index)

    def on_bucket_event(self, event: str, step: int, bucket_index: int) -> None:
        """Transport-thread events: upload start / end, average complete.

        With hierarchical aggregation also (on the local leader's I/O thread)
        "local_reduce_start" / "local_reduce_end" of a bucket's local sum,
        "host_upload" when that sum is handed to the coordinator, and
        "local_group" once the group formed (`step` is then its size).
        """
        if event.startswith(("local_", "host_")):
            self._on_local_event(event, step, bucket_index)
            return
        if self.tracer is not None:
            if event == "upload_start":
                self.tracer.begin("upload", step, bucket_index)
            elif event == "upload_end":
                self.tracer.end("upload", step, bucket_index, TRANSPORT_TRACK)
        if event != "averaged":
            return
        finished = self.now()
        with self._lock:
            entry = self._submitted.pop((step, bucket_index), None)
        if entry is None:
            return
        submitted, num_bytes = entry
        if self.metrics is not None:
            self.metrics.observe_bucket_latency(finished - submitted)
            self.metrics.observe_received(num_bytes)
        if self.tracer is not None:
            self.tracer.span(
                "until averaged", step, submitted, finished, bucket_index, TRANSPORT_TRACK
            )

    def _on_local_event(self, event: str, step: int, bucket_index: int) -> None:
        if event == "local_group":
            if self.metrics is not None:
                self.metrics.set_local_group_size(step)
            return
        if event == "host_upload":
            if self.metrics is not None and 0 <= bucket_index < len(self._bucket_bytes):
                self.metrics.observe_host_sent(self._bucket_bytes[bucket_index])
            return
        key = (step, bucket_index)
        if event == "local_reduce_start":
            with self._lock:
                self._local_started[key] = self.now()
            return
        finished = self.now()
        with self._lock:
            started = self._local_started.pop(key, None)
        if started is None:
            return
        if self.metrics is not None:
            self.metrics.observe_local_reduce(finished - started)
        if self.tracer is not None:
            self.tracer.span("local reduce", step, started, finished, bucket_index, TRANSPORT_TRACK)

    def step_done(
        self, step: int, wait_started: float, report: pb.StepReport | None = None
    ) -> None:
        """The averages of `step` are in place; backward is about to return.

        `report` is the coordinator's latest StepReport (who was slowest), if any.
        """
        finished = self.now()
        if self.metrics is not None:
            self.metrics.observe_exposed_comm(finished - wait_started)
            self.metrics.observe_step_done()
        if self._log_every_steps:
            self._log_step(step, finished, finished - wait_started, report)
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
            self._local_started.clear()

    def _log_step(
        self, step: int, finished: float, exposed_s: float, report: pb.StepReport | None
    ) -> None:
        """Rank 0's periodic step log: means over the last `log_every_steps` steps."""
        window = self._window
        if window is None:
            # The first step has no predecessor to time it from: it opens the window.
            self._window = _Window(step + 1, finished, self.bytes_sent)
            return
        window.exposed_s += exposed_s
        window.steps += 1
        if window.steps < self._log_every_steps:
            return
        steps = window.steps
        # The coordinator sees every rank's buckets arrive: it names the laggard.
        slowest = "slowest rank unknown"
        if report is not None:
            slowest = (
                "no rank lagging"
                if report.slowest_rank < 0
                else f"slowest rank {report.slowest_rank} "
                f"(+{1e3 * report.slowest_lag_s:.1f} ms per bucket)"
            )
        log.info(
            "rank %d: steps %d-%d: %.1f ms/step, exposed sync %.1f ms/step, %.2f MB up/step, %s",
            self._rank,
            window.first_step,
            step,
            1e3 * (finished - window.started) / steps,
            1e3 * window.exposed_s / steps,
            (self.bytes_sent - window.bytes_sent) / steps / 1e6,
            slowest,
        )
        self._window = _Window(step + 1, finished, self.bytes_sent)

    def close(self) -> None:
        """Stop the metrics server and finish the trace file."""
        if self.tracer is not None:
            self.tracer.close()
        if self.server is not None:
            self.server.close()


@dataclass
class _Window:
    """Totals since rank 0's last step log."""

    first_step: int
    started: float
    bytes_sent: int
    exposed_s: float = 0.0
    steps: int = 0
