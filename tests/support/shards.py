"""A `gradsync shard` process for tests, and how to ask a leader about its shards."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from gradsync.status import query_status
from gradsync_proto.v1 import gradsync_pb2 as pb


class ShardProcess:
    """`gradsync shard --leader LEADER --host 127.0.0.1 --port PORT`, logging to a file.

    The log goes to a file, not a pipe: a pipe nobody reads fills up and
    blocks the shard's logging, which would look like a hung shard.
    """

    def __init__(self, leader: str, port: int, log_path: Path, *extra: str) -> None:
        self.leader = leader
        self.port = port
        self.address = f"127.0.0.1:{port}"
        self.log_path = log_path
        self._extra = extra
        self.process = self._start()

    def _start(self) -> subprocess.Popen[Any]:
        with self.log_path.open("a") as log:
            return subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "gradsync.cli",
                    "shard",
                    "--leader",
                    self.leader,
                    "--host",
                    "127.0.0.1",
                    "--port",
                    str(self.port),
                    *self._extra,
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
            )

    def restart(self) -> None:
        """Start the shard again at the same address (after it was killed)."""
        if self.process.poll() is None:
            raise RuntimeError("the shard is still running")
        self.process = self._start()

    def log(self) -> str:
        return self.log_path.read_text()

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def shard_statuses(leader: str) -> list[pb.ShardStatus]:
    """The leader's view of its shards ([] when it cannot be reached)."""
    try:
        return list(query_status(leader, "", timeout_s=2).shards)
    except ConnectionError:
        return []


def wait_for_shards(leader: str, count: int, timeout_s: float) -> list[pb.ShardStatus]:
    """Wait until the leader reports `count` shards alive (itself included); return them."""
    deadline = time.monotonic() + timeout_s
    shards: list[pb.ShardStatus] = []
    while time.monotonic() < deadline:
        shards = shard_statuses(leader)
        if sum(s.alive for s in shards) >= count:
            return shards
        time.sleep(0.1)
    raise AssertionError(f"the leader at {leader} reports {shards} instead of {count} live shards")
