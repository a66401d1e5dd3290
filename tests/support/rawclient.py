"""A hand-driven worker for protocol tests: sends exactly the bytes a test wants.

It speaks to a real coordinator over real gRPC, but bypasses the client
library, so tests can send malformed, stale, duplicate or garbage messages.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable

import grpc
import numpy as np
from gradsync_proto.v1 import gradsync_pb2 as pb
from gradsync_server.app import Running, start
from gradsync_server.config import CoordinatorConfig

from support.waiting import eventually

METHOD = "/gradsync.v1.Coordinator/Sync"
CHUNK = 4096
WEIGHT_SHAPE = (64, 32)
BIAS_SHAPE = (32,)
BUCKET_BYTES = (64 * 32 + 32) * 4  # 8320 bytes: chunks of 4096, 4096, 128


def signature(weight_shape: tuple[int, ...] = WEIGHT_SHAPE) -> pb.ModelSignature:
    """Two float32 parameters in one bucket, plus an int64 buffer."""
    weight_elements = int(np.prod(weight_shape))
    return pb.ModelSignature(
        parameters=[
            pb.TensorSpec(name="fc.weight", shape=list(weight_shape), dtype=pb.DTYPE_FLOAT32),
            pb.TensorSpec(name="fc.bias", shape=list(BIAS_SHAPE), dtype=pb.DTYPE_FLOAT32),
        ],
        buffers=[pb.TensorSpec(name="steps", shape=[], dtype=pb.DTYPE_INT64)],
        buckets=[
            pb.BucketSpec(
                parameter_indices=[1, 0],
                dtype=pb.DTYPE_FLOAT32,
                num_elements=weight_elements + BIAS_SHAPE[0],
            )
        ],
    )


def gradient(
    step: int,
    offset: int,
    payload: bytes,
    *,
    bucket: int = 0,
    epoch: int = 0,
    dtype: int = pb.DTYPE_FLOAT32,
) -> pb.WorkerMessage:
    return pb.WorkerMessage(
        gradient=pb.GradientChunk(
            step=step,
            membership_epoch=epoch,
            bucket_index=bucket,
            offset=offset,
            dtype=dtype,
            payload=payload,
        )
    )  # type: ignore[arg-type]


def bucket_values(rank: int, step: int) -> np.ndarray:
    return (
        np.random.default_rng(100 * rank + step)
        .standard_normal(BUCKET_BYTES // 4)
        .astype(np.float32)
    )


class RawWorker:
    """One Sync stream driven message by message."""

    def __init__(
        self, channel: grpc.aio.Channel, metadata: tuple[tuple[str, str], ...] = ()
    ) -> None:
        self.call = channel.stream_stream(
            METHOD,
            request_serializer=lambda raw: raw,
            response_deserializer=pb.CoordinatorMessage.FromString,
        )(metadata=metadata or None)
        #: AssemblyProgress messages received while waiting for something else.
        self.assembly: list[pb.AssemblyProgress] = []
        #: StepReports (sent to the lowest rank after each step), likewise set aside.
        self.step_reports: list[pb.StepReport] = []

    async def send(self, message: pb.WorkerMessage | bytes) -> None:
        raw = message if isinstance(message, bytes) else message.SerializeToString()
        await asyncio.wait_for(self.call.write(raw), timeout=5)

    async def recv(
        self, timeout: float = 5.0, assembly: bool = False, step_report: bool = False
    ) -> pb.CoordinatorMessage:
        """The next message; AssemblyProgress and StepReport are set aside unless asked for."""
        while True:
            message = await asyncio.wait_for(self.call.read(), timeout=timeout)
            assert message is not grpc.aio.EOF, "stream ended without a status"
            kind = message.WhichOneof("kind")
            if kind == "assembly" and not assembly:
                self.assembly.append(message.assembly)
            elif kind == "step_report" and not step_report:
                self.step_reports.append(message.step_report)
            else:
                return message  # type: ignore[no-any-return]

    async def join(
        self,
        rank: int,
        *,
        world_size: int = 2,
        job_id: str = "job",
        sig: pb.ModelSignature | None = None,
    ) -> None:
        await self.send(
            pb.WorkerMessage(
                join=pb.Join(
                    job_id=job_id,
                    rank=rank,
                    world_size=world_size,
                    signature=sig or signature(),
                    incarnation=f"test-{rank}",
                )
            )
        )

    async def expect_kind(self, kind: str) -> pb.CoordinatorMessage:
        message = await self.recv(assembly=kind == "assembly", step_report=kind == "step_report")
        assert message.WhichOneof("kind") == kind, message
        return message

    async def expect_status(self, code: grpc.StatusCode) -> str:
        """Read until the stream ends; assert its status; return the details."""
        with contextlib.suppress(grpc.aio.AioRpcError):
            while True:
                message = await asyncio.wait_for(self.call.read(), timeout=5)
                if message is grpc.aio.EOF:
                    break
        status = await asyncio.wait_for(self.call.code(), timeout=5)
        assert status == code, (status, await self.call.details())
        return await self.call.details()  # type: ignore[no-any-return]

    async def upload_bucket(self, step: int, values: np.ndarray, **fields: int) -> None:
        raw = values.tobytes()
        for offset in range(0, len(raw), CHUNK):
            await self.send(gradient(step, offset, raw[offset : offset + CHUNK], **fields))

    async def receive_bucket(self, step: int) -> np.ndarray:
        """Collect the averaged chunks of bucket 0 of `step`."""
        result = bytearray(BUCKET_BYTES)
        received = 0
        while received < BUCKET_BYTES:
            message = await self.expect_kind("gradient")
            chunk = message.gradient
            assert chunk.step == step
            result[chunk.offset : chunk.offset + len(chunk.payload)] = chunk.payload
            received += len(chunk.payload)
        return np.frombuffer(bytes(result), dtype=np.float32)

    async def settle(self, running: Running, rank: int = 0, job_id: str = "job") -> None:
        """Wait until the coordinator has processed the message this worker (`rank`) sent last.

        For scenarios on a frozen fake clock that advance it before sending: the
        message is in once the rank's last sign of life is the clock's present.
        Streams are read in order, so everything sent before it is in too.
        """

        def heard_now() -> bool:
            job = running.servicer.jobs.get(job_id)
            assert job is not None, "the job vanished"
            return rank in job.members and job.liveness.seconds_since_seen(rank) == 0.0

        await eventually(heard_now, f"the coordinator to hear rank {rank}'s latest message")

    async def leave(self) -> None:
        await self.send(pb.WorkerMessage(leave=pb.Leave(reason="test done")))
        await self.call.done_writing()
        await self.expect_status(grpc.StatusCode.OK)


@contextlib.asynccontextmanager
async def coordinator(**overrides: object) -> AsyncIterator[tuple[Running, grpc.aio.Channel]]:
    """An in-process coordinator on a free loopback port, and a channel to it."""
    settings: dict[str, object] = {
        "world_size": 2,
        "host": "127.0.0.1",
        "port": 0,
        "chunk_bytes": CHUNK,
        "shutdown_grace_s": 0.5,
    }
    settings.update(overrides)
    running = await start(CoordinatorConfig(**settings))  # type: ignore[arg-type]
    channel = grpc.aio.insecure_channel(
        f"127.0.0.1:{running.port}",
        options=[("grpc.max_send_message_length", 64 << 20)],
    )
    try:
        yield running, channel
    finally:
        await channel.close()
        await running.stop(0)


async def assembled_job(
    channel: grpc.aio.Channel,
    job_id: str = "job",
    world_size: int = 2,
    metadata: tuple[tuple[str, str], ...] = (),
    sig: pb.ModelSignature | None = None,
) -> list[RawWorker]:
    """Workers of a job that has received Welcome (and rank 0's state); `sig`: the
    signature every rank joins with (default `signature()`)."""
    workers = [RawWorker(channel, metadata) for _ in range(world_size)]
    for rank, worker in enumerate(workers):
        await worker.join(rank, world_size=world_size, job_id=job_id, sig=sig)
    for worker in workers:
        await worker.expect_kind("welcome")
    state = bytes(BUCKET_BYTES + 8)
    await workers[0].send(pb.WorkerMessage(state=pb.StateChunk(offset=0, payload=state[:CHUNK])))
    await workers[0].send(
        pb.WorkerMessage(state=pb.StateChunk(offset=CHUNK, payload=state[CHUNK : 2 * CHUNK]))
    )
    await workers[0].send(
        pb.WorkerMessage(state=pb.StateChunk(offset=2 * CHUNK, payload=state[2 * CHUNK :]))
    )
    for worker in workers[1:]:
        for _ in range(3):
            await worker.expect_kind("state")
    return workers


async def healthy_step(channel: grpc.aio.Channel, job_id: str = "healthy", step: int = 0) -> None:
    """A fresh two-rank job completes a step correctly: the coordinator still serves."""
    workers = await assembled_job(channel, job_id)
    await run_step(workers, step)
    for worker in workers:
        await worker.leave()


async def run_step(workers: list[RawWorker], step: int) -> None:
    values = [bucket_values(rank, step) for rank in range(len(workers))]
    for rank, worker in enumerate(workers):
        await worker.upload_bucket(step, values[rank])
    expected = (np.sum(values, axis=0, dtype=np.float32)) / np.float32(len(workers))
    for worker in workers:
        np.testing.assert_array_equal(await worker.receive_bucket(step), expected)


async def wait_until_joined(running: Running, rank: int, job_id: str = "job") -> None:
    """Wait (bounded) until the coordinator has processed `rank`'s Join.

    Joins on separate streams race each other; tests that depend on which one
    the coordinator saw first wait here instead of assuming an order.
    """
    for _ in range(500):
        job = running.servicer.jobs.get(job_id)
        if job is not None and rank in job.members:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"rank {rank} never joined job {job_id!r}")


def run(scenario: Callable[[], Awaitable[None]], timeout_s: float = 30.0) -> None:
    """Run an async test scenario with an overall deadline."""
    asyncio.run(asyncio.wait_for(scenario(), timeout=timeout_s))
