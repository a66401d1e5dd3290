"""Every default of the worker library and its command line, in one place.

`DistributedDataParallel`, `ClientConfig`, the flags of `gradsync worker`,
`demo` and `status` read their defaults from here; the defaults both ends
share (`gradsync_proto.defaults`) are re-exported. Units are in the names.
"""

from __future__ import annotations

from gradsync_proto.defaults import (
    CHUNK_BYTES as CHUNK_BYTES,
    ENV_REDIS_PASSWORD as ENV_REDIS_PASSWORD,
    HEARTBEAT_INTERVAL_S as HEARTBEAT_INTERVAL_S,
    MAX_COLLECTIVE_BYTES as MAX_COLLECTIVE_BYTES,
    MIB as MIB,
    SHARDED_CHUNK_BYTES as SHARDED_CHUNK_BYTES,
    SHUTDOWN_GRACE_S as SHUTDOWN_GRACE_S,
)

#: The interface a worker's /metrics binds (a scraper elsewhere needs --metrics-host).
WORKER_METRICS_HOST = "127.0.0.1"
#: The job id when none is given (all ranks of one job share it).
JOB_ID = "default"
#: Cap of every bucket but the first, as torch DDP's `bucket_cap_mb`.
BUCKET_CAP_MB = 25.0
#: Cap of the first bucket: small, so the first upload starts early in backward.
FIRST_BUCKET_MB = 1.0
#: Bound on each wait for a step's averaged gradients.
TIMEOUT_S = 300.0
#: Bound on the wait for all ranks to join (and rank 0's broadcast).
JOIN_TIMEOUT_S = 300.0
#: How long a worker tries to reach a restarted coordinator before giving up.
RECONNECT_TIMEOUT_S = 60.0
#: Rank 0 logs step time, exposed sync time and bytes every this many steps (INFO; 0 = never).
STEP_LOG_EVERY_STEPS = 100
#: How long a worker waits for the coordinator to ack a keepalive ping (one every 1 s)
#: before it ends the stream as frozen. Long enough for the bytes
#: queued ahead of a ping and its ack on a 200 Mbit/s link shared by 8 ranks; a frozen
#: coordinator is still found within seconds, not the step timeout.
KEEPALIVE_TIMEOUT_S = 15.0
#: Bound on a `gradsync status` query.
STATUS_TIMEOUT_S = 5.0
#: Bound on every wait of the example training job (`gradsync worker`, `gradsync demo`):
#: shorter than TIMEOUT_S, so a demo that cannot finish says so within minutes.
EXAMPLE_TIMEOUT_S = 120.0
