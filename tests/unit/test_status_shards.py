"""`gradsync status` prints a sharded coordinator's shards as a table (pure formatting)."""

from __future__ import annotations

from gradsync.status import format_shards, format_status
from gradsync_proto.v1 import gradsync_pb2 as pb


def test_the_shard_table_names_every_shard_and_its_state() -> None:
    shards = [
        pb.ShardStatus(index=0, alive=True, bytes_received=3 << 20, version="0.1.0"),
        pb.ShardStatus(index=1, address=":50052", alive=True, last_seen_s=0.4, version="0.1.0"),
        pb.ShardStatus(index=2, address="c:50051", alive=False, last_seen_s=7.0, version="0.1.0"),
        pb.ShardStatus(index=3, address="d:50051"),
        pb.ShardStatus(index=4),
    ]
    lines = format_shards(shards).splitlines()
    assert lines[0] == "shards: 2/5 up"
    rows = [line.split() for line in lines[2:]]
    assert [row[:4] for row in rows] == [
        ["0", "(leader)", "up", "-"],
        ["1", ":50052", "up", "0.4s"],
        ["2", "c:50051", "silent", "7.0s"],
        ["3", "d:50051", "lost", "-"],
        ["4", "?", "missing", "-"],
    ]
    assert "3.0 MiB" in lines[2]


def test_an_unsharded_reply_has_no_shard_table() -> None:
    assert format_shards([]) == ""
    assert format_status(pb.StatusReply()) == "no jobs"
