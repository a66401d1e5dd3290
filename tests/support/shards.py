"""A `gradsync shard` process for tests, a hand-driven fake shard's control stream, and how
to ask a leader about its shards."""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import grpc
from gradsync import __version__
from gradsync.status import query_status
from gradsync_proto import chunking
from gradsync_proto.net.channels import ChannelSecurity
from gradsync_proto.v1 import gradsync_pb2 as pb

from support.rawclient import CHUNK

LINK = "/gradsync.v1.Coordinator/ShardLink"
#: The address a FakeShard advertises by default (nothing listens there).
ADDRESS = "127.0.0.1:59999"


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


def shard_statuses(leader: str, security: ChannelSecurity | None = None) -> list[pb.ShardStatus]:
    """The leader's view of its shards ([] when it cannot be reached)."""
    try:
        return list(query_status(leader, "", timeout_s=2, security=security).shards)
    except ConnectionError:
        return []


def wait_for_shards(
    leader: str, count: int, timeout_s: float, security: ChannelSecurity | None = None
) -> list[pb.ShardStatus]:
    """Wait until the leader reports `count` shards alive (itself included); return them."""
    deadline = time.monotonic() + timeout_s
    shards: list[pb.ShardStatus] = []
    while time.monotonic() < deadline:
        shards = shard_statuses(leader, security)
        if sum(s.alive for s in shards) >= count:
            return shards
        time.sleep(0.1)
    raise AssertionError(f"the leader at {leader} reports {shards} instead of {count} live shards")


def wait_for_shard_bytes(
    leader: str, timeout_s: float = 10.0, security: ChannelSecurity | None = None
) -> list[pb.ShardStatus]:
    """Wait until every shard the leader lists has reported bytes received and sent.

    A shard reports its counters to the leader once per heartbeat interval, so a job that
    ends within a second of its start can be over before the first report arrives: a test
    that asks "did every shard carry data?" waits for that report (bounded).
    """
    deadline = time.monotonic() + timeout_s
    while True:
        shards = shard_statuses(leader, security)
        if shards and all(s.bytes_received > 0 and s.bytes_sent > 0 for s in shards):
            return shards
        if time.monotonic() >= deadline:
            raise AssertionError(
                f"a shard of {leader} reported no bytes in {timeout_s:g}s: {shards}"
            )
        time.sleep(0.1)


class FakeShard:
    """One control stream driven by hand; sends its stats every 0.2 s unless `silent`.

    `metadata` is what the call presents (a token: `gradsync_proto.auth.metadata`).
    """

    def __init__(
        self, channel: grpc.aio.Channel, metadata: tuple[tuple[str, str], ...] = ()
    ) -> None:
        self.call = channel.stream_stream(
            LINK,
            request_serializer=pb.ShardMessage.SerializeToString,
            response_deserializer=pb.LeaderMessage.FromString,
        )(metadata=metadata or None)
        self._stats: asyncio.Task[None] | None = None

    async def register(
        self,
        address: str = ADDRESS,
        version: str = __version__,
        chunk_bytes: int = CHUNK,
        silent: bool = False,
    ) -> None:
        register = pb.ShardRegister(
            version=version,
            advertise=address,
            chunk_bytes=chunk_bytes,
            max_message_bytes=chunk_bytes + chunking.HEADER_SLACK_BYTES,
        )
        await self.send(pb.ShardMessage(register=register))
        if not silent:
            self._stats = asyncio.create_task(self._send_stats())

    async def _send_stats(self) -> None:
        while True:
            stats = pb.ShardStats(bytes_received=1000, bytes_sent=500, connections=2)
            await self.send(pb.ShardMessage(stats=stats))
            await asyncio.sleep(0.2)

    async def send(self, message: pb.ShardMessage) -> None:
        await asyncio.wait_for(self.call.write(message), timeout=5)

    async def recv(self, timeout: float = 5.0) -> pb.LeaderMessage:
        """The next message that is not a heartbeat."""
        while True:
            message = await asyncio.wait_for(self.call.read(), timeout=timeout)
            assert message is not grpc.aio.EOF, "control stream ended without a status"
            if message.WhichOneof("kind") != "heartbeat":
                return message  # type: ignore[no-any-return]

    async def expect(self, kind: str, timeout: float = 5.0) -> pb.LeaderMessage:
        message = await self.recv(timeout)
        assert message.WhichOneof("kind") == kind, message
        return message

    async def expect_status(self, code: grpc.StatusCode) -> str:
        with contextlib.suppress(grpc.aio.AioRpcError):
            while await asyncio.wait_for(self.call.read(), timeout=5) is not grpc.aio.EOF:
                pass
        status = await asyncio.wait_for(self.call.code(), timeout=5)
        assert status == code, (status, await self.call.details())
        return await self.call.details()  # type: ignore[no-any-return]

    def close(self) -> None:
        if self._stats is not None:
            self._stats.cancel()
        self.call.cancel()
