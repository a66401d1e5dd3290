"""Every default value of gradsync, in one place.

Flags, config dataclasses and constructor signatures on both ends read their
defaults from here, so a default is changed once and the CLI help, the
library and the coordinator can never disagree (the heartbeat interval was
once written in four places). Units are in the names.
"""

from __future__ import annotations

MIB = 1 << 20

# --- the wire ---------------------------------------------------------------------------------
#: Chunk size: 1-4 MiB messages move fastest through Python gRPC.
CHUNK_BYTES = 1 * MIB
#: Chunk size of a sharded coordinator. A worker's bytes fan out to S shards and
#: the averages fan back in, so a shard can answer chunk k only once every rank's
#: chunk k has crossed links shared S ways: filling and draining that pipeline
#: costs about 2 * S * chunk / B per sync. 256 KiB keeps it small at S = 4..8
#: (measured on 200 Mbit/s links: 1.10 s -> 0.97 s per 16 MB sync at W = S = 4).
SHARDED_CHUNK_BYTES = MIB // 4
#: The largest chunk a coordinator may be configured with.
MAX_CHUNK_BYTES = 64 * MIB
#: Room for a message's non-payload fields, added to the chunk size for gRPC's limits.
HEADER_SLACK_BYTES = 64 << 10

# --- the coordinator --------------------------------------------------------------------------
#: The coordinator's gRPC port.
PORT = 50051
#: The interface `gradsync serve` and `gradsync shard` bind: loopback, so that nothing
#: is exposed by accident (beyond it a token or client certificates are required).
HOST = "127.0.0.1"
#: The interface a worker's /metrics binds (a scraper elsewhere needs --metrics-host).
WORKER_METRICS_HOST = "127.0.0.1"
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
#: How long SIGTERM lets running streams finish.
SHUTDOWN_GRACE_S = 10.0
#: How often workers send a sign of life (advertised to them in Welcome).
HEARTBEAT_INTERVAL_S = 0.5
#: Silence after which a worker is declared dead.
HEARTBEAT_TIMEOUT_S = 5.0
#: A step older than this logs which ranks and buckets it waits for.
STALL_WARNING_S = 10.0
#: Rank 0 uploads a checkpoint every this many steps; 0: only when the training loop asks.
CHECKPOINT_EVERY_STEPS = 0
#: Deadline of one checkpoint store call (a load at Join, a save). A hung store fails the
#: call (and refuses or warns, per policy) after this, while other jobs train on.
STORE_TIMEOUT_S = 30.0
#: Environment variable holding the password of a redis:// checkpoint store.
ENV_REDIS_PASSWORD = "GRADSYNC_REDIS_PASSWORD"
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
#: What losing a worker does: "abort" the job, or go on ("elastic").
ON_FAILURE = "abort"
#: Under the elastic policy, the fewest live workers a job goes on with.
MIN_WORKERS = 1
#: Cap on one rank's input to a collective (all_reduce, broadcast, ...), and on an
#: all_gather's whole result; a claim checked before any byte is buffered.
MAX_COLLECTIVE_BYTES = 256 * MIB
#: How often a job that assembles logs (and tells its waiting ranks) who is missing.
ASSEMBLY_REPORT_PERIOD_S = 10.0
#: Coordinator shards, the leader included (1 = not sharded).
SHARDS = 1
#: How long a sharded leader waits at start-up for every shard to register before it exits 1.
SHARD_WAIT_TIMEOUT_S = 300.0
#: How often a leader that waits for shards logs which are missing.
SHARD_WAIT_REPORT_PERIOD_S = 10.0
#: How long the leader waits between restarts of a local shard child that keeps dying.
LOCAL_SHARD_RESTART_DELAY_S = 1.0
#: How many ended jobs `gradsync status` still shows, and for how long.
ENDED_JOBS_KEPT = 32
ENDED_JOBS_KEPT_S = 600.0

# --- the workers ------------------------------------------------------------------------------
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

# --- the command line -------------------------------------------------------------------------
#: Bound on a `gradsync status` query.
STATUS_TIMEOUT_S = 5.0
#: Bound on every wait of the example training job (`gradsync worker`, `gradsync demo`):
#: shorter than TIMEOUT_S, so a demo that cannot finish says so within minutes.
EXAMPLE_TIMEOUT_S = 120.0
