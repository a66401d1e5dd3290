"""Memory of a real `gradsync serve` under hostile uploads, measured from /proc (issue 11).

- A checkpoint chunk declaring a huge blob must not make the coordinator
  allocate it: memory follows the bytes that arrive, and a declared size
  beyond --max-checkpoint-mb is refused at once.
- A worker that never reads its results is dropped once its outbox reaches
  --max-outbox-mb, and the RESOURCE_EXHAUSTED StreamEnd is the next thing it
  reads (its queued results are discarded, not delivered first).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest
from gradsync_proto.defaults import MIB
from gradsync_proto.net.frame_stream import FRAME_PORT_METHOD
from gradsync_proto.v1 import gradsync_pb2 as pb
from support.frameclient import FrameWorker
from support.processes import CoordinatorProcess
from support.rawclient import RawWorker, gradient, signature

CODE = grpc.StatusCode
CHUNK = 64 << 10
WEIGHT = (256, 1024)  # a 1 MiB bucket (plus the bias): 17 chunks of 64 KiB
BUCKET_BYTES = (WEIGHT[0] * WEIGHT[1] + 32) * 4


def rss_bytes(pid: int) -> int:
    """Resident set size of `pid`, from /proc."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS line")


def _channel(coordinator: CoordinatorProcess) -> grpc.aio.Channel:
    return grpc.aio.insecure_channel(
        coordinator.address, options=[("grpc.max_send_message_length", 64 << 20)]
    )


async def _frame_worker(channel: grpc.aio.Channel) -> FrameWorker:
    """A worker on the coordinator's frame port (asked for through `channel`)."""
    ask = channel.unary_unary(FRAME_PORT_METHOD, response_deserializer=pb.FramePortReply.FromString)
    reply = await ask(pb.FramePortRequest().SerializeToString())
    assert reply.port != 0, "the coordinator serves no frame port"
    return await FrameWorker.open(reply.port)


def test_a_checkpoint_chunk_declaring_a_huge_blob_allocates_nothing_for_it() -> None:
    coordinator = CoordinatorProcess(1, "--chunk-mb", "0.0625", "--max-checkpoint-mb", "1024")

    async def scenario() -> None:
        async with _channel(coordinator) as channel:
            worker = RawWorker(channel)
            await worker.join(0, world_size=1)
            await worker.expect_kind("welcome")
            before = rss_bytes(coordinator.process.pid)
            # One real chunk of a checkpoint that claims 1000 MiB: the upload stays open.
            first = pb.CheckpointChunk(
                step=0, offset=0, total_bytes=1000 * MIB, payload=bytes(CHUNK)
            )
            await worker.send(pb.WorkerMessage(checkpoint=first))
            await worker.send(pb.WorkerMessage(heartbeat=pb.Heartbeat(step=0)))
            await asyncio.sleep(0.5)
            grown = rss_bytes(coordinator.process.pid) - before
            assert grown < 64 * MIB, f"coordinator RSS grew by {grown / MIB:.0f} MiB"
            # 14 bytes on the wire declaring 2 GiB (another job): refused, nothing held.
            other = RawWorker(channel)
            await other.join(0, world_size=1, job_id="other")
            await other.expect_kind("welcome")
            huge = pb.WorkerMessage(checkpoint=pb.CheckpointChunk(step=0, total_bytes=2 << 30))
            await other.send(huge)
            details = await other.expect_status(CODE.RESOURCE_EXHAUSTED)
            assert "--max-checkpoint-mb" in details and str(2 << 30) in details
            grown = rss_bytes(coordinator.process.pid) - before
            assert grown < 64 * MIB, f"coordinator RSS grew by {grown / MIB:.0f} MiB"

    try:
        asyncio.run(asyncio.wait_for(scenario(), timeout=30))
    finally:
        coordinator.stop()


@pytest.mark.parametrize("pipe", ["grpc", "frames"])
def test_a_worker_that_never_reads_is_dropped_and_told_first(pipe: str) -> None:
    coordinator = CoordinatorProcess(
        2, "--chunk-mb", "0.0625", "--max-outbox-mb", "8", "--shutdown-grace-s", "5"
    )
    sig = signature(WEIGHT)
    payload = bytes(BUCKET_BYTES)

    async def upload(worker: RawWorker, step: int) -> None:
        for offset in range(0, BUCKET_BYTES, CHUNK):
            await worker.send(gradient(step, offset, payload[offset : offset + CHUNK]))

    async def scenario() -> None:
        async with _channel(coordinator) as channel:
            reader = RawWorker(channel)
            idle = RawWorker(channel) if pipe == "grpc" else await _frame_worker(channel)
            await reader.join(0, sig=sig)
            await idle.join(1, sig=sig)
            await reader.expect_kind("welcome")
            for offset in range(0, BUCKET_BYTES + 8, CHUNK):  # rank 0's state broadcast
                piece = bytes(min(CHUNK, BUCKET_BYTES + 8 - offset))
                await reader.send(
                    pb.WorkerMessage(state=pb.StateChunk(offset=offset, payload=piece))
                )
            before = rss_bytes(coordinator.process.pid)
            dropped_at = None
            idle_sends = True
            for step in range(64):  # 1 MiB of results per step for the idle rank
                await upload(reader, step)
                if idle_sends:
                    try:
                        await upload(idle, step)
                    except (TimeoutError, grpc.aio.UsageError, grpc.aio.AioRpcError, OSError):
                        idle_sends = False  # the coordinator stopped reading it: dropped
                received = 0
                while received < BUCKET_BYTES:
                    message = await reader.recv(timeout=10)
                    if message.WhichOneof("kind") == "step_aborted":
                        assert message.step_aborted.reason == pb.ABORT_REASON_PEER_LOST
                        dropped_at = step
                        break
                    received += len(message.gradient.payload)
                if dropped_at is not None:
                    break
            assert dropped_at is not None, "the rank that never reads was never dropped"
            grown = rss_bytes(coordinator.process.pid) - before
            assert grown < 64 * MIB, f"coordinator RSS grew by {grown / MIB:.0f} MiB"
            # The idle rank reads now: at most what was already in flight, then the StreamEnd.
            data_before_end = 0
            while True:
                message = await idle.recv(timeout=10)
                kind = message.WhichOneof("kind")
                if kind == "stream_end":
                    break
                assert kind in ("gradient", "state", "welcome"), message
                data_before_end += len(message.gradient.payload)
            assert message.stream_end.reason == pb.END_REASON_RESOURCE_EXHAUSTED
            assert "not reading its results" in message.stream_end.message
            assert data_before_end < 8 * MIB, f"{data_before_end} bytes came before the end"
            await idle.expect_status(CODE.RESOURCE_EXHAUSTED)
            if isinstance(idle, FrameWorker):
                await idle.close()
            return None

    try:
        asyncio.run(asyncio.wait_for(scenario(), timeout=60))
    finally:
        coordinator.stop()
