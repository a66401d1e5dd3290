"""A worker's step on a plain frame connection crosses no event loop (issue 27).

The worker `Transport`'s asyncio loop is blocked on purpose; a bucket must
still go out (written by the submitting thread when small, by the frame
socket's writer thread when large) and its average come back (read by the
socket's reader thread), against a real coordinator over real sockets.
"""

from __future__ import annotations

import asyncio
import threading
import time

import numpy as np
import pytest
from gradsync.control.transport import Transport
from gradsync.control.worker_messages import INLINE_BYTES
from gradsync.path.buffers import BucketBuffer
from gradsync_proto.v1 import gradsync_pb2 as pb
from support.rawclient import BIAS_SHAPE, coordinator, run, signature

#: How long the transport's loop is kept busy: far longer than a step may take here.
BLOCKED_S = 4.0


@pytest.mark.parametrize("columns", [32, 1024], ids=["small-bucket", "large-bucket"])
def test_a_step_goes_out_and_its_average_comes_back_while_the_transport_loop_is_blocked(
    columns: int,
) -> None:
    weight_shape = (512, columns)
    bucket_bytes = (int(np.prod(weight_shape)) + int(np.prod(BIAS_SHAPE))) * 4
    assert (bucket_bytes <= INLINE_BYTES) == (columns == 32)  # one of each kind of write

    def step_with_the_loop_blocked(port: int) -> tuple[float, float, str]:
        join = pb.Join(
            job_id="threads",
            rank=0,
            world_size=1,
            signature=signature(weight_shape),
            incarnation="t-0",
        )
        transport = Transport(f"127.0.0.1:{port}", rank=0)
        try:
            transport.open(join)
            transport.wait_welcome(timeout_s=10)
            transport.configure_buckets([bucket_bytes])
            values = np.random.default_rng(7).standard_normal(bucket_bytes // 4, np.float32)
            buffer = BucketBuffer([values.copy().view(np.uint8)])
            loop_free = threading.Event()

            def block_the_loop() -> None:
                loop_free.set()
                time.sleep(BLOCKED_S)

            transport._loop.call_soon_threadsafe(block_the_loop)
            assert loop_free.wait(5)
            started = time.monotonic()
            transport.submit_bucket(0, 0, buffer, pb.DTYPE_FLOAT32)
            contributors = transport.wait_step(0, timeout_s=BLOCKED_S - 1)
            took = time.monotonic() - started
            averaged = buffer.segments[0].view(np.float32)
            error = float(np.max(np.abs(averaged - values)))
            assert contributors == 1
            return took, error, str(transport._sync.pipe)
        finally:
            transport.close(timeout_s=10)

    async def scenario() -> None:
        async with coordinator(world_size=1) as (running, _):
            took, error, pipe = await asyncio.to_thread(step_with_the_loop_blocked, running.port)
        assert pipe == "frames"
        assert error == 0.0  # one rank: its average is its own gradient, exactly
        assert took < BLOCKED_S - 1

    run(scenario)
