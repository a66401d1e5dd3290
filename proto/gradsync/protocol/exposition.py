"""The Prometheus scrape endpoint that workers and the coordinator both serve.

Both ends expose their own registry (never prometheus_client's global one)
over plain HTTP at `/metrics`; the histogram buckets for latencies are shared
so that a dashboard can put a worker's and the coordinator's view of the same
bucket side by side.
"""

from __future__ import annotations

import logging
import threading
from types import TracebackType
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, start_http_server

log = logging.getLogger("gradsync.metrics")

#: Highest TCP port number.
MAX_PORT = 65535

#: Histogram buckets (seconds) for synchronization latencies: 1 ms (a small
#: bucket on loopback) up to 60 s (a large model over a slow link, or a rank
#: that stalls until the step's deadline).
LATENCY_BUCKETS_S: tuple[float, ...] = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
)


class MetricsServer:
    """An HTTP server answering Prometheus scrapes of one registry, on a daemon thread.

    Use it as a context manager or call `close()`; `port` is the bound port
    (the real one when 0 was asked for).
    """

    def __init__(self, httpd: WSGIServer, thread: threading.Thread, host: str) -> None:
        self._httpd = httpd
        self._thread = thread
        self.host = host
        self.port: int = httpd.server_port
        self._closed = False

    @property
    def url(self) -> str:
        """The scrape URL, e.g. "http://127.0.0.1:9100/metrics"."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/metrics"

    def close(self) -> None:
        """Stop serving and release the port; idempotent."""
        if self._closed:
            return
        self._closed = True
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5)

    def __enter__(self) -> MetricsServer:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()


def serve_metrics(port: int, registry: CollectorRegistry, host: str = "0.0.0.0") -> MetricsServer:
    """Serve `registry` at http://host:port/metrics until the server is closed.

    Args:
        port: TCP port; 0 picks a free one (read it from `.port`).
        registry: the registry to expose (a `CoordinatorMetrics` or
            `WorkerMetrics` object's `.registry`).
        host: interface to bind; the default is every interface, as the
            scraper (Prometheus) normally runs on another host or container.

    Raises:
        OSError: the port cannot be bound (in use, or privileged).
    """
    if not 0 <= port <= MAX_PORT:
        raise ValueError(f"metrics port must be in 0..{MAX_PORT}, got {port}")
    try:
        httpd, thread = start_http_server(port, addr=host, registry=registry)
    except OSError as exc:
        raise OSError(
            exc.errno, f"could not serve metrics on {host}:{port}: {exc.strerror or exc}"
        ) from exc
    server = MetricsServer(httpd, thread, host)
    log.info("serving Prometheus metrics on %s", server.url)
    return server
