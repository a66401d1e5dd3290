"""Every default of the coordinator (leader and shards), in one place.

Flags, `CoordinatorConfig` and the components read their defaults
from here, so a default is changed once and `gradsync serve --help`, the
library and the coordinator can never disagree. The defaults both ends share
(`gradsync_proto.defaults`) are re-exported. Units are in the names.
"""

from __future__ import annotations

from gradsync_proto.defaults import (
    CHUNK_BYTES as CHUNK_BYTES,
    ENV_REDIS_PASSWORD as ENV_REDIS_PASSWORD,
    HEADER_SLACK_BYTES as HEADER_SLACK_BYTES,
    HEARTBEAT_INTERVAL_S as HEARTBEAT_INTERVAL_S,
    MAX_COLLECTIVE_BYTES as MAX_COLLECTIVE_BYTES,
    MIB as MIB,
    SHARDED_CHUNK_BYTES as SHARDED_CHUNK_BYTES,
    SHUTDOWN_GRACE_S as SHUTDOWN_GRACE_S,
)

#: The largest chunk a coordinator may be configured with.
MAX_CHUNK_BYTES = 64 * MIB
#: The coordinator's gRPC port.
PORT = 50051
#: The interface `gradsync serve` and `gradsync shard` bind: loopback, so that nothing
#: is exposed by accident (beyond it a token or client certificates are required).
HOST = "127.0.0.1"
#: Cap on gradient bytes held in partial reductions, across all jobs.
MAX_BUFFERED_BYTES = 2048 * MIB
#: Cap on averaged bytes queued for one worker that is not reading them: a few default
#: buckets (BUCKET_CAP_MB), so a slow reader cannot hold much; beyond it the worker is dropped.
MAX_OUTBOX_BYTES = 128 * MIB
#: The largest checkpoint (or healing state) a coordinator accepts; its bytes count in the
#: job's share of the buffer budget while they arrive.
MAX_CHECKPOINT_BYTES = 1024 * MIB
#: Concurrent streams (worker, shard data and shard control) a coordinator serves.
MAX_CONNECTIONS = 1024
#: How long a new stream may take to send its first message (Join, ShardHello, ShardRegister).
FIRST_MESSAGE_TIMEOUT_S = 10.0
#: How long a job may assemble (its first rank waiting for the last) before it is refused.
ASSEMBLY_TIMEOUT_S = 600.0
#: Concurrent jobs the coordinator accepts.
MAX_JOBS = 64
#: Silence after which a worker is declared dead.
HEARTBEAT_TIMEOUT_S = 5.0
#: A step older than this logs which ranks and buckets it waits for.
STALL_WARNING_S = 10.0
#: Rank 0 uploads a checkpoint every this many steps; 0: only when the training loop asks.
CHECKPOINT_EVERY_STEPS = 0
#: Deadline of one checkpoint store call (a load at Join, a save). A hung store fails the
#: call (and refuses or warns, per policy) after this, while other jobs train on.
STORE_TIMEOUT_S = 30.0
#: What a NaN/Inf gradient contribution does: "report" it (log, metric, status; the step
#: goes on with NaN/Inf in its average, as DDP would), "abort" the step for every rank,
#: or "allow" it silently (no check).
NONFINITE = "report"
#: The `--nonfinite` policies, in the order `--help` lists them.
NONFINITE_POLICIES = ("report", "abort", "allow")
#: Per job, at most this many non-finite contributions are logged per window (the rest
#: are counted, and the next line logged says how many were not).
NONFINITE_LOG_LINES = 5
NONFINITE_LOG_WINDOW_S = 10.0
#: The floor of every DiLoCo job's contribution screen (`--screen`): a job's own
#: `screen=` applies when it is stricter (`gradsync_server.dataplane.screening`).
SCREEN = "report"
#: The screen policies, from the weakest to the strictest.
SCREEN_POLICIES = ("report", "clip", "exclude", "trimmed_mean", "median")
#: What losing a worker does: "abort" the job, or go on ("elastic").
ON_FAILURE = "abort"
#: Under the elastic policy, the fewest live workers a job goes on with.
MIN_WORKERS = 1
#: How often a job that assembles logs (and tells its waiting ranks) who is missing.
ASSEMBLY_REPORT_PERIOD_S = 10.0
#: Coordinator shards, the leader included (1 = not sharded).
SHARDS = 1
#: How long a sharded leader waits at start-up for every shard to register before it exits 1.
SHARD_WAIT_TIMEOUT_S = 300.0
#: How often a leader that waits for shards logs which are missing.
SHARD_WAIT_REPORT_PERIOD_S = 10.0
#: Bound on a shard's wait for the leader's answer to ShardRegister.
REGISTER_TIMEOUT_S = 10.0
#: Longest pause between two attempts of a shard to reach its leader.
RECONNECT_BACKOFF_MAX_S = 5.0
#: How often a shard that cannot reach its leader says so.
UNREACHABLE_REPORT_PERIOD_S = 10.0
#: How long the leader waits between restarts of a local shard child that keeps dying.
LOCAL_SHARD_RESTART_DELAY_S = 1.0
#: How many ended jobs `gradsync status` still shows, and for how long.
ENDED_JOBS_KEPT = 32
ENDED_JOBS_KEPT_S = 600.0
