"""The defaults both ends must agree on, in one place.

The wire (chunk sizes, message slack), the heartbeat interval a worker falls
back to before its Welcome says otherwise, the drain grace, the collective cap
a worker checks before sending, the Redis password variable. The coordinator's
own defaults are in `gradsync_server.defaults`, the worker's in
`gradsync.defaults`; each re-exports these, so a module reads one `defaults`
and every value is still written once. Units are in the names.
"""

from __future__ import annotations

MIB = 1 << 20
#: Chunk size: 1-4 MiB messages move fastest through Python gRPC.
CHUNK_BYTES = 1 * MIB
#: Chunk size of a sharded coordinator. A worker's bytes fan out to S shards and
#: the averages fan back in, so a shard can answer chunk k only once every rank's
#: chunk k has crossed links shared S ways: filling and draining that pipeline
#: costs about 2 * S * chunk / B per sync. 256 KiB keeps it small at S = 4..8
#: (measured on 200 Mbit/s links: 1.10 s -> 0.97 s per 16 MB sync at W = S = 4).
SHARDED_CHUNK_BYTES = MIB // 4
#: Room for a message's non-payload fields, added to the chunk size for gRPC's limits.
HEADER_SLACK_BYTES = 64 << 10
#: How long SIGTERM lets running streams finish.
SHUTDOWN_GRACE_S = 10.0
#: How often workers send a sign of life (advertised to them in Welcome).
HEARTBEAT_INTERVAL_S = 0.5
#: Environment variable holding the password of a redis:// checkpoint store.
ENV_REDIS_PASSWORD = "GRADSYNC_REDIS_PASSWORD"
#: Cap on one rank's input to a collective (all_reduce, broadcast, ...), and on an
#: all_gather's whole result; a claim checked before any byte is buffered.
MAX_COLLECTIVE_BYTES = 256 * MIB
