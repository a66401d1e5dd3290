"""Prometheus metrics of a worker, and the HTTP endpoint both sides serve them on.

A worker's question is "how much of my step is spent waiting for the network?":
`gradsync_worker_exposed_comm_seconds` is the part of backward that did not
overlap with computation (the wait for averages once the last gradient is
ready), next to the bytes moved and each bucket's latency from hand-off to
average. Every metric carries the worker's `rank` as a label so that one
dashboard query splits by rank however the workers are scraped (one container
each, or several processes of one host behind one address).

Metrics live in a registry owned by the `WorkerMetrics` object (prometheus
client_python's `registry=` seam), never in the process-global one, so tests
and several wrappers in one process stay independent.

Metrics ports when several workers share a host: the base port comes from
`--metrics-port` or `$GRADSYNC_METRICS_PORT`, and each worker serves on
base + `$LOCAL_RANK` (torchrun sets LOCAL_RANK; a lone worker, e.g. one per
container, has none and uses the base itself). Base 0 asks the OS for a free
port per worker; the chosen port is logged. Neither set: metrics are off.
See `resolve_metrics_port`.

The HTTP side (`serve_metrics`) is shared with the coordinator and lives in
`gradsync_proto.net.exposition`.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Mapping

from gradsync_proto.net.exposition import LATENCY_BUCKETS_S, MAX_PORT, rank_metric
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from gradsync.config import ENV_LOCAL_RANK

log = logging.getLogger("gradsync.metrics")

#: Base port of the workers' metrics endpoints; each worker adds its LOCAL_RANK.
ENV_METRICS_PORT = "GRADSYNC_METRICS_PORT"
#: Interface of the workers' metrics endpoints (default loopback: nothing exposed by accident).
ENV_METRICS_HOST = "GRADSYNC_METRICS_HOST"


class WorkerMetrics:
    """The metrics one worker (one rank) exports.

    Args:
        registry: where the metrics are registered; a fresh private registry
            when None (never prometheus_client's global one).
        rank: this worker's rank, attached to every metric as the `rank` label.

    Raises:
        ValueError: `rank` is negative.
    """

    def __init__(self, registry: CollectorRegistry | None = None, rank: int = 0) -> None:
        if rank < 0:
            raise ValueError(f"rank must be >= 0, got {rank}")
        self.registry = CollectorRegistry() if registry is None else registry
        self.rank = rank
        # Every child but the abort counter's is bound to this rank once.
        counter = functools.partial(rank_metric, Counter, registry=self.registry, rank=rank)
        gauge = functools.partial(rank_metric, Gauge, registry=self.registry, rank=rank)
        histogram = functools.partial(rank_metric, Histogram, registry=self.registry, rank=rank)
        self._exposed_comm = histogram(
            "gradsync_worker_exposed_comm_seconds",
            "Time backward spends at its end waiting for averaged gradients "
            "(communication not hidden behind computation).",
            buckets=LATENCY_BUCKETS_S,
        )
        self._sent_bytes = counter(
            "gradsync_worker_sent_bytes_total", "Gradient payload bytes this worker uploaded."
        )
        self._received_bytes = counter(
            "gradsync_worker_received_bytes_total",
            "Averaged gradient payload bytes this worker received.",
        )
        self._bucket_latency = histogram(
            "gradsync_worker_bucket_latency_seconds",
            "From a bucket handed to the transport to its average complete on this worker.",
            buckets=LATENCY_BUCKETS_S,
        )
        self._steps = counter(
            "gradsync_worker_steps_total", "Synchronized steps this worker completed."
        )
        # Hierarchical aggregation (a local group of this host's ranks).
        self._local_reduce = histogram(
            "gradsync_worker_local_reduce_seconds",
            "A local leader's sum of one bucket over its host's ranks in shared memory "
            "(from every rank posted to every share summed).",
            buckets=LATENCY_BUCKETS_S,
        )
        self._host_sent_bytes = counter(
            "gradsync_worker_host_sent_bytes_total",
            "Gradient payload bytes this host's local group uploaded (counted by its leader).",
        )
        self._local_group_size = gauge(
            "gradsync_worker_local_group_size",
            "Ranks in this worker's local group (0: it aggregates flat).",
        )
        self._step_aborts = Counter(
            "gradsync_worker_step_aborts_total",
            "Steps this worker saw aborted, by reason (a gRPC status code name).",
            ["rank", "reason"],
            registry=self.registry,
        )

    def observe_exposed_comm(self, seconds: float) -> None:
        """Record how long the end of one backward waited for its averages."""
        self._exposed_comm.observe(seconds)

    def observe_sent(self, nbytes: int) -> None:
        """Count gradient payload bytes handed to the wire."""
        self._sent_bytes.inc(nbytes)

    def observe_received(self, nbytes: int) -> None:
        """Count averaged payload bytes received."""
        self._received_bytes.inc(nbytes)

    def observe_bucket_latency(self, seconds: float) -> None:
        """Record one bucket's time from hand-off to transport to its average complete."""
        self._bucket_latency.observe(seconds)

    def observe_local_reduce(self, seconds: float) -> None:
        """Record one bucket's local sum (leader)."""
        self._local_reduce.observe(seconds)

    def observe_host_sent(self, nbytes: int) -> None:
        """Count bytes a local leader uploaded for its whole host."""
        self._host_sent_bytes.inc(nbytes)

    def set_local_group_size(self, size: int) -> None:
        """The size of this worker's local group (0 = flat)."""
        self._local_group_size.set(size)

    def observe_step_done(self) -> None:
        """Count one completed synchronized step."""
        self._steps.inc()

    def observe_abort(self, reason: str) -> None:
        """Count one aborted step.

        Args:
            reason: a bounded name, e.g. the gRPC status code ("ABORTED",
                "DEADLINE_EXCEEDED"); never free text, which would make a new
                series per message.
        """
        self._step_aborts.labels(rank=str(self.rank), reason=reason).inc()


def resolve_metrics_port(explicit: int | None, environ: Mapping[str, str]) -> int | None:
    """The port a worker serves its metrics on, or None when metrics are off.

    The base port is `explicit` (the `--metrics-port` flag) if given, else
    `$GRADSYNC_METRICS_PORT`. Workers of one host are started with the same
    flags and environment (torchrun), so each adds its `$LOCAL_RANK` (0 when
    unset) to the base to get a port of its own. A base of 0 stays 0: every
    worker asks the OS for a free port, which `serve_metrics` logs.

    Args:
        explicit: the flag's value, None when the flag was not given.
        environ: the environment to read (`os.environ` in production).

    Returns:
        The TCP port (0 = any free port), or None when neither is set.

    Raises:
        ValueError: a value is not an integer, is negative, or the sum is past 65535.
    """
    if explicit is not None:
        base, source = explicit, "--metrics-port"
    else:
        raw = environ.get(ENV_METRICS_PORT, "").strip()
        if not raw:
            return None
        base, source = _parse_int(ENV_METRICS_PORT, raw), f"${ENV_METRICS_PORT}"
    if not 0 <= base <= MAX_PORT:
        raise ValueError(f"{source} must be in 0..{MAX_PORT}, got {base}")
    if base == 0:
        return 0
    raw_local_rank = environ.get(ENV_LOCAL_RANK, "").strip()
    local_rank = _parse_int(ENV_LOCAL_RANK, raw_local_rank) if raw_local_rank else 0
    if local_rank < 0:
        raise ValueError(f"${ENV_LOCAL_RANK} must be >= 0, got {local_rank}")
    port = base + local_rank
    if port > MAX_PORT:
        raise ValueError(
            f"metrics port {source}={base} + ${ENV_LOCAL_RANK}={local_rank} = {port} "
            f"is past {MAX_PORT}; choose a lower base port"
        )
    return port


def _parse_int(name: str, raw: str) -> int:
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"${name}={raw!r} is not an integer") from None
