"""The Prometheus scrape endpoint that workers and the coordinator both serve.

Both ends expose their own registry (never prometheus_client's global one)
over plain HTTP at `/metrics`; the histogram buckets for latencies are shared
so that a dashboard can put a worker's and the coordinator's view of the same
bucket side by side.

The HTTP server is prometheus_client's WSGI app on a server of our own with a
bounded number of handler threads (prometheus_client's starts one thread per
connection, without limit) and a per-connection timeout, so that a port
reachable by strangers cannot be made to hold unbounded threads or sockets:
beyond `MAX_SCRAPE_THREADS` concurrent scrapes a connection is closed at once
(Prometheus retries at its next interval).
"""

from __future__ import annotations

import logging
import socket
import threading
from types import TracebackType
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app

log = logging.getLogger("gradsync.metrics")

#: Highest TCP port number.
MAX_PORT = 65535

#: Scrapes answered at once; a connection beyond them is closed at once.
MAX_SCRAPE_THREADS = 4
#: A scrape connection silent this long is dropped (it would hold a thread).
SCRAPE_TIMEOUT_S = 10.0

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


class _QuietHandler(WSGIRequestHandler):
    """Request handler with a socket timeout and no per-request log line on stderr."""

    timeout = SCRAPE_TIMEOUT_S

    def log_message(self, format: str, *args: Any) -> None:
        pass


class _BoundedServer(WSGIServer):
    """A WSGI server with at most MAX_SCRAPE_THREADS handler threads at a time."""

    daemon_threads = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._slots = threading.BoundedSemaphore(MAX_SCRAPE_THREADS)
        super().__init__(*args, **kwargs)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            self.shutdown_request(request)  # every slot busy: refuse rather than grow
            return
        threading.Thread(
            target=self._serve_one, args=(request, client_address), daemon=True
        ).start()

    def _serve_one(self, request: Any, client_address: Any) -> None:
        try:
            self.finish_request(request, client_address)
        except Exception:  # a broken scrape must not end the server
            self.handle_error(request, client_address)
        finally:
            self.shutdown_request(request)
            self._slots.release()


class _BoundedServer6(_BoundedServer):
    address_family = socket.AF_INET6


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
        httpd = _make_server(host, port, registry)
    except OSError as exc:
        raise OSError(
            exc.errno, f"could not serve metrics on {host}:{port}: {exc.strerror or exc}"
        ) from exc
    thread = threading.Thread(target=httpd.serve_forever, name="gradsync-metrics", daemon=True)
    thread.start()
    server = MetricsServer(httpd, thread, host)
    log.info("serving Prometheus metrics on %s", server.url)
    return server


def _make_server(host: str, port: int, registry: CollectorRegistry) -> WSGIServer:
    """Bind the bounded server on host:port (IPv4 or IPv6, as the host resolves)."""
    infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    family = infos[0][0] if infos else socket.AF_INET
    server_class = _BoundedServer6 if family == socket.AF_INET6 else _BoundedServer
    return make_server(
        host, port, make_wsgi_app(registry), server_class=server_class, handler_class=_QuietHandler
    )
