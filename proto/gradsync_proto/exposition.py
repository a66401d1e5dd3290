"""Moved to `gradsync_proto.net.exposition` (an HTTP endpoint, not part of the wire).

This name stays only for `gradsync_server.shard_app`, which is being
rewritten with the shard link and will import the new path then; every
other module already does. Delete this file with that import.
"""

from __future__ import annotations

from gradsync_proto.net.exposition import (
    LATENCY_BUCKETS_S,
    MAX_PORT,
    MAX_SCRAPE_THREADS,
    SCRAPE_TIMEOUT_S,
    MetricsServer,
    serve_metrics,
)

__all__ = [
    "LATENCY_BUCKETS_S",
    "MAX_PORT",
    "MAX_SCRAPE_THREADS",
    "SCRAPE_TIMEOUT_S",
    "MetricsServer",
    "serve_metrics",
]
