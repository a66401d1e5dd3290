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
#: Room for a message's non-payload fields, added to the chunk size for gRPC's limits.
HEADER_SLACK_BYTES = 64 << 10

# --- the coordinator --------------------------------------------------------------------------
#: The coordinator's gRPC port.
PORT = 50051
#: Cap on gradient bytes held in partial reductions, across all jobs.
MAX_BUFFERED_BYTES = 2048 * MIB
#: Cap on averaged bytes queued for one worker that is not reading them.
MAX_OUTBOX_BYTES = 1024 * MIB
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
