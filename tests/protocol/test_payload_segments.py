"""The same-host payload path at a real coordinator: a real abstract socket, a real memfd.

Ranks 0 and 1 join with the coordinator's own host id (rank 0 leads their
group) and rank 2 with none. Only rank 0's Welcome names the payload socket;
it registers a segment (its session checked, a wrong one refused), uploads
its partial sum header-only from the segment and finds the average written
back in place; a segment truncated after registration aborts the step with
INVALID_ARGUMENT naming the numbers, and the coordinator keeps serving; the
coordinator's copy of the descriptor is closed when the rank leaves.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import uuid
from pathlib import Path

import grpc
import numpy as np
from gradsync.local.hierarchy import register_segment
from gradsync_proto import chunking
from gradsync_proto.codec import ChunkHeader, encode_gradient
from gradsync_proto.payload_socket import Registration
from gradsync_proto.v1 import gradsync_pb2 as pb
from support.rawclient import (
    BUCKET_BYTES,
    CHUNK,
    RawWorker,
    bucket_values,
    coordinator,
    run,
)
from support.rawgroups import hier_job
from support.waiting import eventually

HOST = "test-host-a"
#: Where the bucket lies in the test's segment (as a result region would, not at 0).
BASE = 4096


async def assembled(channel: grpc.aio.Channel) -> tuple[list[RawWorker], list[pb.Welcome]]:
    """Ranks 0, 1 on the coordinator's host, rank 2 flat; rank 0's state broadcast done."""
    return await hier_job(channel, {0: HOST, 1: HOST, 2: ""})


def segment(name: str) -> int:
    fd = os.memfd_create(name, os.MFD_CLOEXEC)
    os.ftruncate(fd, BASE + BUCKET_BYTES)
    return fd


def open_copies(name: str) -> int:
    """How many descriptors of this process point at the memfd called `name`."""
    count = 0
    for entry in Path("/proc/self/fd").iterdir():
        with contextlib.suppress(OSError):  # a descriptor closed meanwhile
            count += os.readlink(entry).startswith(f"/memfd:{name} ")
    return count


async def register(welcome: pb.Welcome, rank: int, fd: int, session: bytes | None = None) -> bool:
    registration = Registration(
        welcome.job_id, rank, welcome.session if session is None else session
    )
    # Off the loop: the coordinator decides on this very loop.
    return await asyncio.to_thread(register_segment, welcome.payload_socket, registration, fd)


async def upload_from_segment(worker: RawWorker, step: int, covered: tuple[int, ...]) -> None:
    for offset, _ in chunking.range_chunk_spans(0, BUCKET_BYTES, CHUNK):
        header = ChunkHeader(
            step=step,
            bucket_index=0,
            offset=offset,
            dtype=pb.DTYPE_FLOAT32,
            covered_ranks=covered,
            in_segment=True,
            segment_offset=BASE + offset,
        )
        await worker.send(encode_gradient(header, b""))


async def upload(
    worker: RawWorker, step: int, values: np.ndarray, covered: tuple[int, ...] = ()
) -> None:
    raw = values.astype("<f4").tobytes()
    for offset, length in chunking.range_chunk_spans(0, BUCKET_BYTES, CHUNK):
        chunk = pb.GradientChunk(
            step=step,
            offset=offset,
            dtype=pb.DTYPE_FLOAT32,
            payload=raw[offset : offset + length],
            covered_ranks=covered,
        )
        await worker.send(pb.WorkerMessage(gradient=chunk))


def test_a_leaders_partial_sum_moves_through_its_segment_both_ways() -> None:
    name = f"gradsync-test-{uuid.uuid4().hex[:8]}"

    async def scenario() -> None:
        async with coordinator(world_size=3, host_id=HOST) as (running, channel):
            workers, welcomes = await assembled(channel)
            assert welcomes[0].payload_socket
            assert welcomes[1].payload_socket == "" and welcomes[2].payload_socket == ""
            fd = segment(name)
            try:
                # A wrong session, and a follower's own session, are refused.
                assert not await register(welcomes[0], 0, fd, session=b"x" * 32)
                assert not await register(welcomes[0], 1, fd, session=welcomes[1].session)
                assert open_copies(name) == 1
                assert await register(welcomes[0], 0, fd)
                assert open_copies(name) == 2
                partial = (bucket_values(0, 0) + bucket_values(1, 0)).astype("<f4")
                os.pwrite(fd, partial.tobytes(), BASE)
                await upload(workers[2], 0, bucket_values(2, 0))
                await upload_from_segment(workers[0], 0, (0, 1))
                expected = ((partial + bucket_values(2, 0)) / np.float32(3)).astype("<f4")
                for _ in chunking.range_chunk_spans(0, BUCKET_BYTES, CHUNK):
                    chunk = (await workers[0].expect_kind("gradient")).gradient
                    assert chunk.in_segment and chunk.payload == b"" and chunk.contributors == 3
                    assert chunk.segment_offset == BASE + chunk.offset
                average = np.frombuffer(os.pread(fd, BUCKET_BYTES, BASE), dtype="<f4")
                np.testing.assert_array_equal(average, expected)
                flat = bytearray()
                while len(flat) < BUCKET_BYTES:
                    flat += (await workers[2].expect_kind("gradient")).gradient.payload
                assert bytes(flat) == expected.tobytes()
                written = running.servicer.metrics.registry.get_sample_value(
                    "gradsync_segment_bytes_total", {"direction": "read"}
                )
                assert written == BUCKET_BYTES
                # The leader leaves: the coordinator's copy is closed at once.
                await workers[0].leave()
                await eventually(
                    lambda: open_copies(name) == 1 and len(running.servicer.segments) == 0,
                    "the coordinator to close its copy of the leader's segment",
                )
            finally:
                os.close(fd)

    run(scenario)


def test_a_segment_truncated_after_registration_aborts_the_step_and_the_coordinator_serves_on() -> (
    None
):
    name = f"gradsync-test-{uuid.uuid4().hex[:8]}"

    async def scenario() -> None:
        async with coordinator(world_size=3, host_id=HOST) as (running, channel):
            workers, welcomes = await assembled(channel)
            fd = segment(name)
            try:
                assert await register(welcomes[0], 0, fd)
                os.ftruncate(fd, BASE + 100)  # the worker shrinks it under the coordinator
                await upload_from_segment(workers[0], 0, (0, 1))
                aborted = (await workers[0].expect_kind("step_aborted")).step_aborted
                assert aborted.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
                assert aborted.culprit_rank == 0 and aborted.step == 0
                assert (
                    f"rank 0 sent step 0 bucket 0 offset 0: its segment at {BASE} held 100 "
                    f"bytes, expected {CHUNK}"
                ) in aborted.message
                assert (await workers[2].expect_kind("step_aborted")).step_aborted.step == 0
                # The rest of step 0's chunks are dropped; step 1 runs over TCP.
                partial = bucket_values(0, 1) + bucket_values(1, 1)
                await upload(workers[0], 1, partial, covered=(0, 1))
                await upload(workers[2], 1, bucket_values(2, 1))
                expected = ((partial + bucket_values(2, 1)) / np.float32(3)).astype("<f4")
                for leader in (workers[0], workers[2]):
                    chunk = (await leader.expect_kind("gradient")).gradient
                    assert chunk.step == 1 and not chunk.in_segment
                    assert chunk.payload == expected.tobytes()[:CHUNK]
                for worker in workers:
                    await worker.leave()
                await eventually(
                    lambda: open_copies(name) == 1 and not running.servicer.jobs,
                    "the job to end and its segment copy to close",
                )
            finally:
                os.close(fd)

    run(scenario)


def test_no_payload_socket_without_the_flag_or_on_another_host() -> None:
    async def scenario() -> None:
        async with coordinator(world_size=3, host_id="another-host") as (_, channel):
            _, welcomes = await assembled(channel)
            assert [w.payload_socket for w in welcomes] == ["", "", ""]
        async with coordinator(world_size=3, host_id=HOST, payload_socket=False) as (
            running,
            channel,
        ):
            _, welcomes = await assembled(channel)
            assert [w.payload_socket for w in welcomes] == ["", "", ""]
            assert running.payload_socket is None

    run(scenario)
