"""The Prometheus scrape endpoint that workers and the coordinator both serve.

Both ends expose their own registry (never prometheus_client's global one)
over plain HTTP at `/metrics`; the histogram buckets for latencies are shared
so that a dashboard can put a worker's and the coordinator's view of the same
bucket side by side.

The HTTP server is prometheus_client's WSGI app on a server of our own, built so
that a port reachable by strangers cannot be made to hold threads or sockets
(prometheus_client's starts one thread per connection, without limit; a small
fixed pool of threads that each wait for their request is held by a handful of
silent connections). One thread reads every connection's request head without
blocking, with a deadline for the whole head (`REQUEST_READ_TIMEOUT_S`, so a
slow-loris client that drips a byte at a time is dropped as surely as a silent
one), and at most `MAX_PENDING_CONNECTIONS` at a time: a new connection beyond
them evicts the oldest, which a real scraper, sending its request the moment it
connects, never is. Only a request that has fully arrived reaches one of the
`MAX_SCRAPE_THREADS` handler threads, which answer it in milliseconds.
"""

from __future__ import annotations

import contextlib
import io
import logging
import queue
import selectors
import socket
import threading
import time
from types import TracebackType
from typing import Any, TypeVar
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer

from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.metrics import MetricWrapperBase

log = logging.getLogger("gradsync.metrics")

#: Highest TCP port number.
MAX_PORT = 65535

#: Threads answering complete requests; a scrape holds one for milliseconds.
MAX_SCRAPE_THREADS = 4
#: Complete requests waiting for a handler thread; a connection beyond them is closed.
MAX_QUEUED_SCRAPES = 32
#: Connections whose request head has not fully arrived; one more evicts the oldest.
MAX_PENDING_CONNECTIONS = 64
#: A connection's whole request head must arrive within this long of its accept.
REQUEST_READ_TIMEOUT_S = 3.0
#: Writing one answer may take this long; a scraper that stops reading is dropped.
SCRAPE_WRITE_TIMEOUT_S = 5.0
#: A request head longer than this is refused (a scrape's is a few hundred bytes).
MAX_REQUEST_HEAD_BYTES = 16 * 1024
#: How often an idle handler thread looks whether the server is stopping.
_HANDLER_POLL_S = 0.25

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

Metric = TypeVar("Metric", bound=MetricWrapperBase)


def rank_metric(
    kind: type[Metric],
    name: str,
    documentation: str,
    *,
    registry: CollectorRegistry,
    rank: int,
    buckets: tuple[float, ...] | None = None,
) -> Metric:
    """A metric labelled by `rank` alone, already bound to this rank's child.

    A worker's metrics carry its rank so that one dashboard query splits by rank
    however the workers are scraped. The child is bound once: `.labels()` takes a
    lock and formats strings, which the per-chunk paths should not pay each time.
    """
    options: dict[str, Any] = {} if buckets is None else {"buckets": buckets}
    return kind(name, documentation, ["rank"], registry=registry, **options).labels(rank=str(rank))


class _QuietHandler(WSGIRequestHandler):
    """Answers one request whose head was already read; no per-request log line on stderr."""

    #: Applies to the writes only: the request was read before this handler ran.
    timeout = SCRAPE_WRITE_TIMEOUT_S

    def __init__(self, request: socket.socket, client_address: Any, server: Any, head: bytes):
        self._head = head
        super().__init__(request, client_address, server)

    def setup(self) -> None:
        super().setup()
        # The request head is already here; a GET has no body to read from the socket.
        self.rfile.close()
        self.rfile = io.BytesIO(self._head)

    def log_message(self, format: str, *args: Any) -> None:
        pass


class _Pending:
    """A connection whose request head is still arriving, and its deadline."""

    __slots__ = ("address", "connection", "deadline", "head")

    def __init__(self, connection: socket.socket, address: Any, deadline: float) -> None:
        self.connection = connection
        self.address = address
        self.deadline = deadline
        self.head = bytearray()

    def head_complete(self, searched_up_to: int) -> bool:
        """Whether a blank line ended the head (CRLF or bare LF, as http.server accepts)."""
        start = max(0, searched_up_to - 2)
        return self.head.find(b"\n\n", start) >= 0 or self.head.find(b"\n\r\n", start) >= 0


class _ScrapeServer(WSGIServer):
    """Reads request heads on one selector thread; answers complete ones on a few threads.

    `serve_forever` runs until `stop()`; the listening socket is WSGIServer's (so
    are the WSGI environment and `shutdown_request`), the loop is ours.
    """

    #: Connections the kernel queues while the loop thread is busy.
    request_queue_size = MAX_PENDING_CONNECTIONS

    def __init__(self, address: tuple[str, int], registry: CollectorRegistry) -> None:
        # Made first: a failed bind calls server_close, which closes them.
        self._wake_reader, self._wake_writer = socket.socketpair()
        self._wake_reader.setblocking(False)
        # The handler class given here goes unused: `_answer_loop` makes a `_QuietHandler`
        # with the request head it read.
        super().__init__(address, WSGIRequestHandler)
        self.set_app(make_wsgi_app(registry))
        self.socket.setblocking(False)
        self._stopping = threading.Event()
        # Insertion order is accept order, hence deadline order and eviction order.
        self._pending: dict[socket.socket, _Pending] = {}
        self._ready: queue.Queue[_Pending] = queue.Queue(MAX_QUEUED_SCRAPES)

    def serve_forever(self, poll_interval: float = 0.5) -> None:
        handlers = [
            threading.Thread(target=self._answer_loop, name="gradsync-metrics-answer", daemon=True)
            for _ in range(MAX_SCRAPE_THREADS)
        ]
        for handler in handlers:
            handler.start()
        selector = selectors.DefaultSelector()
        selector.register(self.socket, selectors.EVENT_READ)
        selector.register(self._wake_reader, selectors.EVENT_READ)
        try:
            while not self._stopping.is_set():
                for key, _ in selector.select(self._next_timeout()):
                    if key.fileobj is self.socket:
                        self._accept(selector)
                    elif key.fileobj is self._wake_reader:
                        self._drain_wake()
                    else:
                        self._read(selector, key.data)
                self._expire(selector, time.monotonic())
        finally:
            for pending in list(self._pending.values()):
                self._drop(selector, pending)
            selector.close()
            for handler in handlers:
                handler.join(timeout=SCRAPE_WRITE_TIMEOUT_S)
            while not self._ready.empty():
                self.shutdown_request(self._ready.get_nowait().connection)

    def stop(self) -> None:
        """Make `serve_forever` return (it closes what it holds on its way out)."""
        self._stopping.set()
        with contextlib.suppress(OSError):  # already woken (the buffer is full) or closed
            self._wake_writer.send(b"\0")

    def server_close(self) -> None:
        super().server_close()
        self._wake_reader.close()
        self._wake_writer.close()

    def _next_timeout(self) -> float | None:
        for pending in self._pending.values():  # the first one has the nearest deadline
            return max(0.0, pending.deadline - time.monotonic())
        return None

    def _drain_wake(self) -> None:
        with contextlib.suppress(OSError):
            self._wake_reader.recv(64)

    def _accept(self, selector: selectors.BaseSelector) -> None:
        for _ in range(MAX_PENDING_CONNECTIONS):  # then read: a flood cannot starve the reads
            try:
                connection, address = self.socket.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # out of descriptors, say: make room, try again later
                log.warning("metrics endpoint could not accept a connection: %s", exc)
                if self._pending:
                    self._drop(selector, next(iter(self._pending.values())))
                else:  # nothing of ours to free: do not spin on the still-readable socket
                    time.sleep(_HANDLER_POLL_S)
                return
            connection.setblocking(False)
            if len(self._pending) >= MAX_PENDING_CONNECTIONS:
                # The oldest has had the longest to send its request; a scraper sends
                # its own at once, so the one evicted is the one holding the slot idle.
                self._drop(selector, next(iter(self._pending.values())))
            pending = _Pending(connection, address, time.monotonic() + REQUEST_READ_TIMEOUT_S)
            self._pending[connection] = pending
            selector.register(connection, selectors.EVENT_READ, pending)

    def _read(self, selector: selectors.BaseSelector, pending: _Pending) -> None:
        if self._pending.get(pending.connection) is not pending:
            return  # evicted by an accept earlier in the same round of events
        try:
            data = pending.connection.recv(4096)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:  # the peer went away before finishing its request
            self._drop(selector, pending)
            return
        searched_up_to = len(pending.head)
        pending.head += data
        if pending.head_complete(searched_up_to):
            selector.unregister(pending.connection)
            del self._pending[pending.connection]
            try:
                self._ready.put_nowait(pending)
            except queue.Full:  # every handler is stuck writing to slow readers
                self.shutdown_request(pending.connection)
        elif len(pending.head) > MAX_REQUEST_HEAD_BYTES:
            self._drop(selector, pending)

    def _expire(self, selector: selectors.BaseSelector, now: float) -> None:
        for pending in list(self._pending.values()):
            if pending.deadline > now:
                return
            self._drop(selector, pending)

    def _drop(self, selector: selectors.BaseSelector, pending: _Pending) -> None:
        selector.unregister(pending.connection)
        del self._pending[pending.connection]
        pending.connection.close()

    def _answer_loop(self) -> None:
        while not self._stopping.is_set():
            try:
                pending = self._ready.get(timeout=_HANDLER_POLL_S)
            except queue.Empty:
                continue
            try:
                _QuietHandler(pending.connection, pending.address, self, bytes(pending.head))
            except Exception:  # a broken scrape must not end the server
                log.debug("a metrics scrape from %s failed", pending.address, exc_info=True)
            finally:
                self.shutdown_request(pending.connection)


class _ScrapeServer6(_ScrapeServer):
    address_family = socket.AF_INET6


class MetricsServer:
    """An HTTP server answering Prometheus scrapes of one registry, on a daemon thread.

    Use it as a context manager or call `close()`; `port` is the bound port
    (the real one when 0 was asked for).
    """

    def __init__(self, httpd: _ScrapeServer, thread: threading.Thread, host: str) -> None:
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
        self._httpd.stop()
        self._thread.join(timeout=SCRAPE_WRITE_TIMEOUT_S + 1)
        self._httpd.server_close()

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


def _make_server(host: str, port: int, registry: CollectorRegistry) -> _ScrapeServer:
    """Bind the scrape server on host:port (IPv4 or IPv6, as the host resolves)."""
    infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    family = infos[0][0] if infos else socket.AF_INET
    server_class = _ScrapeServer6 if family == socket.AF_INET6 else _ScrapeServer
    return server_class((host, port), registry)
