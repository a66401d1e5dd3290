"""The leader's local shards run under the leader's limits (argv built for `gradsync shard`).

The argv is parsed back with the real CLI parser, so a flag the shard does
not know, or a value that does not round-trip, fails here rather than in a
child process that dies at start.
"""

from __future__ import annotations

import os

from gradsync.arguments import build_parser
from gradsync_proto.defaults import MIB
from gradsync_server.config import CoordinatorConfig
from gradsync_server.local_shards import shard_command


def test_local_shards_inherit_the_leaders_limits_on_peers() -> None:
    config = CoordinatorConfig(
        world_size=2,
        shard_count=2,
        local_shards=True,
        max_outbox_bytes=3 * MIB + 1,
        max_connections=17,
        first_message_timeout_s=0.25,
    )
    argv = shard_command(config, leader_port=5000, port=5001, index=1, log_level="INFO")
    args = build_parser().parse_args(argv[argv.index("shard") :])
    assert int(args.max_outbox_mb * MIB) == 3 * MIB + 1
    assert args.max_connections == 17
    assert args.first_message_timeout_s == 0.25
    assert args.leader == "127.0.0.1:5000" and args.port == 5001
    assert args.parent_pid == os.getpid()  # the child dies with its leader (watch_parent)
