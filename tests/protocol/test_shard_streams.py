"""The real `Transport` against a sharded coordinator, over real gRPC on loopback.

The coordinator is a small fake written here (the real leader and shard are
tested on their own): a `Coordinator.Sync` server that welcomes one worker
(W = 1) with two shards, and a `Shard.Data` server for shard 1 at ":port",
each answering every gradient chunk at once with an "average" (the payload
inverted, so that a result that was not written back shows). The transport
must open shard 1's stream with the right hello, send each shard exactly its
byte range on that range's chunk grid, write every result back whole, say
goodbye to both on close, and turn a lost shard into `ShardUnavailableError`:
at once when the leader's stream ends with SHARD_LOST, after the grace when
the leader says nothing.
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import grpc
import numpy as np
import pytest
from gradsync.control.transport import Transport
from gradsync.errors import ShardUnavailableError
from gradsync.path.buffers import BucketBuffer
from gradsync.path.pacing import ENV_UPLOAD_WINDOW_MB
from gradsync_proto import chunking
from gradsync_proto.codec import ChunkHeader, decode_gradient, encode_gradient
from gradsync_proto.codes import Code
from gradsync_proto.v1 import gradsync_pb2 as pb
from support.rawclient import run

pytestmark = pytest.mark.protocol

CHUNK = 256
HEARTBEAT_S = 0.1
#: The transport's grace after a shard stream fails: 3 heartbeats + this margin.
MARGIN_S = 0.5
GRACE_S = 3 * HEARTBEAT_S + MARGIN_S
#: (step, bucket, offset, length, dtype) of every gradient chunk a server received.
Received = tuple[int, int, int, int, int]


def averaged(header: ChunkHeader, payload: memoryview) -> bytes:
    """The fake's "average" for W = 1: the payload, inverted (a visible change)."""
    inverted = (np.frombuffer(payload, dtype=np.uint8) ^ 0xFF).tobytes()
    reply = ChunkHeader(
        step=header.step,
        membership_epoch=header.membership_epoch,
        bucket_index=header.bucket_index,
        offset=header.offset,
        dtype=header.dtype,
        contributors=1,
    )
    return encode_gradient(reply, [memoryview(inverted)])


@dataclass
class FakeShard:
    """Shard 1's Data service: checks nothing but records everything."""

    hellos: list[pb.ShardHello] = field(default_factory=list)
    received: list[Received] = field(default_factory=list)
    left: bool = False

    async def data(self, requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> None:
        async for raw in requests:
            fast = decode_gradient(raw)
            if fast is not None:
                header, payload = fast
                self.received.append(
                    (header.step, header.bucket_index, header.offset, len(payload), header.dtype)
                )
                await context.write(averaged(header, payload))
                continue
            message = pb.WorkerMessage.FromString(raw)
            kind = message.WhichOneof("kind")
            if kind == "shard_hello":
                self.hellos.append(message.shard_hello)
            elif kind == "leave":
                self.left = True
                return
            else:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"unexpected {kind}")


@dataclass
class FakeLeader:
    """The leader's Sync service for one worker; ends it with SHARD_LOST on request."""

    shard_port: int
    #: Where the leader listens (the port is set once its server is up).
    host: str
    port: int = 0
    received: list[Received] = field(default_factory=list)
    left: bool = False
    #: When set: on the first chunk of this step, end the stream with SHARD_LOST.
    shard_lost_at_step: int | None = None
    lost_message: str = ""

    async def sync(self, requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> None:
        async for raw in requests:
            fast = decode_gradient(raw)
            if fast is not None:
                header, payload = fast
                if header.step == self.shard_lost_at_step:
                    end = pb.StreamEnd(
                        code=Code.UNAVAILABLE,
                        reason=pb.END_REASON_SHARD_LOST,
                        message=self.lost_message,
                    )
                    await context.write(pb.CoordinatorMessage(stream_end=end).SerializeToString())
                    await context.abort(grpc.StatusCode.UNAVAILABLE, self.lost_message)
                self.received.append(
                    (header.step, header.bucket_index, header.offset, len(payload), header.dtype)
                )
                await context.write(averaged(header, payload))
                continue
            message = pb.WorkerMessage.FromString(raw)
            kind = message.WhichOneof("kind")
            if kind == "join":
                welcome = pb.Welcome(
                    job_id=message.join.job_id,
                    world_size=1,
                    chunk_bytes=CHUNK,
                    max_message_bytes=CHUNK + chunking.HEADER_SLACK_BYTES,
                    heartbeat_interval_s=HEARTBEAT_S,
                    shards=[
                        pb.ShardAddress(index=0, address=""),
                        pb.ShardAddress(index=1, address=f":{self.shard_port}"),
                    ],
                )
                await context.write(pb.CoordinatorMessage(welcome=welcome).SerializeToString())
            elif kind == "leave":
                self.left = True
                return


@asynccontextmanager
async def serve(
    method: str, handler: object, host: str
) -> AsyncIterator[tuple[grpc.aio.Server, int]]:
    """A grpc.aio server for one raw-bytes stream method, on a free port of `host`."""
    service, name = method.rsplit("/", 1)
    server = grpc.aio.server()
    server.add_generic_rpc_handlers(
        (
            grpc.method_handlers_generic_handler(
                service.strip("/"),
                {name: grpc.stream_stream_rpc_method_handler(handler)},
            ),
        )
    )
    port = server.add_insecure_port(f"{host}:0")
    await server.start()
    try:
        yield server, port
    finally:
        await server.stop(None)


@asynccontextmanager
async def sharded_coordinator(
    host: str = "127.0.0.1",
) -> AsyncIterator[tuple[FakeLeader, FakeShard, grpc.aio.Server]]:
    """The fake leader and shard 1 (announced as ":port", on the leader's host)."""
    shard = FakeShard()
    async with serve("/gradsync.v1.Shard/Data", shard.data, host) as (shard_server, shard_port):
        leader = FakeLeader(shard_port, host)
        async with serve("/gradsync.v1.Coordinator/Sync", leader.sync, host) as (_, port):
            leader.port = port
            yield leader, shard, shard_server


JOIN = pb.Join(job_id="sharded", rank=0, world_size=1, incarnation="incarnation-7")
#: Bucket 0: 1000 float32 (4000 bytes); bucket 1: 999 bfloat16 (1998 bytes, the
#: 16-bit wire: ranges are cut at 500 elements = 1000 bytes, not 999).
BUCKETS = [(4000, pb.DTYPE_FLOAT32), (1998, pb.DTYPE_BFLOAT16)]


def joined(leader: FakeLeader, margin_s: float = MARGIN_S) -> Transport:
    transport = Transport(f"{leader.host}:{leader.port}", rank=0, shard_grace_margin_s=margin_s)
    transport.open(JOIN)
    welcome = transport.wait_welcome(timeout_s=10)
    assert len(welcome.shards) == 2
    transport.configure_buckets([size for size, _ in BUCKETS])
    return transport


def run_step(transport: Transport, step: int, timeout_s: float = 10) -> None:
    """Upload both buckets (random bytes), wait, check every result was written back."""
    uploads = []
    for index, (size, dtype) in enumerate(BUCKETS):
        data = np.random.default_rng(step * 10 + index).integers(0, 256, size, dtype=np.uint8)
        buffer = BucketBuffer(np.split(data.copy(), [size // 3, size // 2]))
        transport.submit_bucket(step, index, buffer, dtype)
        uploads.append((data, buffer))
    assert transport.wait_step(step, timeout_s) == 1
    for data, buffer in uploads:
        written = b"".join(bytes(segment) for segment in buffer.segments)
        assert written == (data ^ 0xFF).tobytes()  # every byte's result, written back whole


def grid(step: int, shard_index: int) -> list[Received]:
    """The chunks shard `shard_index` must receive for `step`: its range, on its grid."""
    out = []
    for index, (size, dtype) in enumerate(BUCKETS):
        itemsize = 4 if dtype == pb.DTYPE_FLOAT32 else 2
        lo, hi = chunking.shard_byte_range(size // itemsize, itemsize, 2, shard_index)
        out += [
            (step, index, offset, length, dtype)
            for offset, length in chunking.range_chunk_spans(lo, hi, CHUNK)
        ]
    return sorted(out)


def ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
    except OSError:
        return False
    return True


@pytest.mark.parametrize("host", ["127.0.0.1", "[::1]"])
@pytest.mark.parametrize("window_mb", ["", "0.0005"])
def test_each_shard_receives_exactly_its_ranges_and_every_result_is_written_back(
    host: str, window_mb: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Also paced (`gradsync.path.pacing`, a window of about two chunks per stream, set
    explicitly since loopback is otherwise unpaced): the same chunks, every result back."""
    if host == "[::1]" and not ipv6_loopback():
        pytest.skip("no IPv6 loopback on this host")
    monkeypatch.setenv(ENV_UPLOAD_WINDOW_MB, window_mb)

    async def scenario() -> None:
        async with sharded_coordinator(host) as (leader, shard, _):
            transport = await asyncio.to_thread(joined, leader)
            assert transport._pacer.window_bytes == (524 if window_mb else 0)
            try:
                for step in (0, 1, 2):
                    await asyncio.to_thread(run_step, transport, step)
            finally:
                await asyncio.to_thread(transport.close, 5.0)
            # Every window was opened by an answer (both streams' answers reach the
            # pacer), never by the stall bound.
            assert transport._pacer.stalls == 0
            assert [(h.job_id, h.rank, h.incarnation, h.shard_index) for h in shard.hellos] == [
                ("sharded", 0, "incarnation-7", 1)
            ]
            assert sorted(leader.received) == grid(0, 0) + grid(1, 0) + grid(2, 0)
            assert sorted(shard.received) == grid(0, 1) + grid(1, 1) + grid(2, 1)
            # The 16-bit bucket is cut by elements: shard 1 starts at byte 1000.
            assert min(o for s, b, o, _, _ in shard.received if b == 1) == 1000
            assert leader.left and shard.left  # a goodbye on every stream
            assert not transport._thread.is_alive()

    run(scenario)


def test_a_lost_shard_is_raised_after_the_grace_when_the_leader_says_nothing() -> None:
    async def scenario() -> None:
        async with sharded_coordinator() as (leader, _, shard_server):
            transport = await asyncio.to_thread(joined, leader)
            try:
                await asyncio.to_thread(run_step, transport, 0)
                await shard_server.stop(None)  # the shard dies; the leader stays silent
                killed = time.monotonic()
                with pytest.raises(ShardUnavailableError) as raised:
                    await asyncio.to_thread(run_step, transport, 1, 30.0)
                waited = time.monotonic() - killed
            finally:
                await asyncio.to_thread(transport.close, 5.0)
            error = raised.value
            shard_address = f"127.0.0.1:{leader.shard_port}"
            assert f"shard 1 at {shard_address}" in str(error)
            assert (error.shard_index, error.shard_address) == (1, shard_address)
            assert GRACE_S - 0.1 <= waited < GRACE_S + 5

    run(scenario)


def test_the_leaders_shard_lost_is_raised_at_once_naming_the_shard() -> None:
    async def scenario() -> None:
        async with sharded_coordinator() as (leader, _, shard_server):
            shard_address = f"127.0.0.1:{leader.shard_port}"
            leader.shard_lost_at_step = 1
            leader.lost_message = (
                f"shard 1 at {shard_address} was lost (its control stream ended); job "
                "'sharded' stops at step 1 and resumes from its last checkpoint"
            )
            # A long grace: only the leader's verdict can end the wait quickly.
            transport = await asyncio.to_thread(joined, leader, 60.0)
            try:
                await asyncio.to_thread(run_step, transport, 0)
                await shard_server.stop(None)
                started = time.monotonic()
                with pytest.raises(ShardUnavailableError) as raised:
                    await asyncio.to_thread(run_step, transport, 1, 30.0)
                assert time.monotonic() - started < 10
            finally:
                await asyncio.to_thread(transport.close, 5.0)
            assert raised.value.code is Code.UNAVAILABLE
            assert f"shard 1 at {shard_address} was lost" in str(raised.value)

    run(scenario)
