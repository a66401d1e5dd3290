"""`gradsync serve` exits cleanly on SIGTERM and SIGINT, whatever its streams are doing.

A coordinator stopped with a step in flight, a job still assembling and a
stream its worker cancelled must exit 0 without asyncio's leak reports
("Task was destroyed but it is pending", "Future exception was never
retrieved") or tracebacks on stderr: those read as crashes to an operator.
"""

from __future__ import annotations

import asyncio
import signal

import grpc
import numpy as np
import pytest
from gradsync_proto.v1 import gradsync_pb2 as pb
from support.processes import CoordinatorProcess
from support.rawclient import BUCKET_BYTES, RawWorker, gradient

NOISE = (
    "Task was destroyed but it is pending",
    "Future exception was never retrieved",
    "Traceback",
    "Exception ignored",
    "was never awaited",
)


async def busy_streams_then_signal(coordinator: CoordinatorProcess, signum: int) -> None:
    """Open streams in every state, signal the coordinator, and read them to their end."""
    async with grpc.aio.insecure_channel(coordinator.address) as channel:
        running = [RawWorker(channel) for _ in range(2)]
        for rank, worker in enumerate(running):
            await worker.join(rank, job_id="running")
        for worker in running:
            await worker.expect_kind("welcome")
        state = bytes(BUCKET_BYTES + 8)  # one chunk at the default 1 MiB chunk size
        await running[0].send(pb.WorkerMessage(state=pb.StateChunk(offset=0, payload=state)))
        await running[1].expect_kind("state")
        values = np.ones(BUCKET_BYTES // 4, dtype=np.float32).tobytes()
        await running[0].send(gradient(0, 0, values))  # step 0 stays open: rank 1 never sends
        waiting = RawWorker(channel)
        await waiting.join(0, job_id="assembling")
        await waiting.expect_kind("assembly")
        cancelled = RawWorker(channel)
        await cancelled.join(0, job_id="cancelled")
        await cancelled.expect_kind("assembly")
        cancelled.call.cancel()
        await asyncio.sleep(0.2)
        coordinator.process.send_signal(signum)
        for worker in [*running, waiting]:
            details = await worker.expect_status(grpc.StatusCode.UNAVAILABLE)
            assert "shutting down" in details


@pytest.mark.timeout(60)
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_serve_exits_quietly_with_streams_in_every_state(signum: int) -> None:
    coordinator = CoordinatorProcess(2, "--shutdown-grace-s", "0.5")
    try:
        asyncio.run(asyncio.wait_for(busy_streams_then_signal(coordinator, signum), 30))
    finally:
        code, stderr = coordinator.stop(signal_first=False)
    assert code == 0, stderr
    for noise in NOISE:
        assert noise not in stderr, stderr
    assert "coordinator stopped" in stderr
