"""An ended frame connection: the reason why always arrives, and the connection still ends.

After its STATUS frame the coordinator half-closes and reads (to drop) until the
worker closes (`gradsync_server.rpc.frame_server.FrameConnection._finish`), cut
only once its last bytes stop moving (`gradsync_server.rpc.linger`). Closing at
once with the worker's bytes unread made the kernel reset the connection, and a
reset drops what is not yet delivered: on a slow link the StreamEnd and STATUS
themselves (stop 42's CI: a worker took a refusal for a lost coordinator).
"""

from __future__ import annotations

import asyncio
import socket

import grpc
import pytest
from gradsync_proto.net.frames import HEADER, MESSAGE, STATUS, decode_status, hello_frame
from gradsync_proto.v1 import gradsync_pb2 as pb
from gradsync_server.app import Running
from gradsync_server.rpc import frame_server, linger
from gradsync_server.rpc.linger import LINGER_S
from support.frameclient import FrameWorker, frame_workers
from support.rawclient import CHUNK, coordinator, run, signature
from support.waiting import eventually


def frame_port(running: Running) -> int:
    assert running.frames is not None, "the coordinator serves no frame port"
    return running.frames.port


async def connections_end(running: Running, within_s: float) -> bool:
    frames = running.frames
    assert frames is not None
    deadline = asyncio.get_running_loop().time() + within_s
    while frames.connections and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.05)
    return not frames.connections


def test_an_ended_connection_reads_what_the_worker_still_sends_and_ends_without_a_reset() -> None:
    """After its STATUS frame the coordinator half-closes and drops what still comes.

    Closing at once with the worker's bytes unread makes the kernel reset the
    connection, and a reset drops what was not yet delivered: on a slow link, the
    StreamEnd and STATUS themselves (stop 42's CI: a worker took a refusal for a lost
    coordinator). The worker here keeps sending after the refusal, then reads.
    """

    async def scenario() -> None:
        async with coordinator() as (running, _), frame_workers(frame_port(running)) as connect:
            worker = await connect()
            await worker.send(pb.WorkerMessage(heartbeat=pb.Heartbeat(step=0)))  # not a Join
            await asyncio.sleep(0.3)  # the coordinator has ended its side by now
            for _ in range(20):  # a bucket's worth the coordinator never reads
                await worker.send(pb.WorkerMessage(heartbeat=pb.Heartbeat(step=1)))
                worker.writer.write(HEADER.pack(MESSAGE, 10_000) + bytes(10_000))
            await asyncio.sleep(0.3)
            assert (await worker.recv()).WhichOneof("kind") == "stream_end"
            frame = await worker.frame()
            assert frame is not None and frame[0] == STATUS
            assert await worker.frame() is None  # a clean end (FIN): a reset raises here
            worker.writer.close()
            frames = running.frames
            assert frames is not None
            deadline = asyncio.get_running_loop().time() + 5
            while frames.connections and asyncio.get_running_loop().time() < deadline:
                await asyncio.sleep(0.05)
            assert not frames.connections  # closed once the worker closed its end

    run(scenario)


def test_a_rank_refused_for_a_bad_frame_is_lost_at_once_though_its_socket_stays_open() -> None:
    """The ended connection lingers (reading to drop) while the peer keeps its socket
    open, but its stream ends now: the other rank hears of it at once, not `LINGER_S`
    later when the linger runs out."""

    async def scenario() -> None:
        async with (
            coordinator(world_size=2) as (running, _),
            frame_workers(frame_port(running)) as connect,
        ):
            workers = [await connect(), await connect()]
            for rank, worker in enumerate(workers):
                await worker.join(rank)
            for worker in workers:
                await worker.expect_kind("welcome")
            started = asyncio.get_running_loop().time()
            workers[0].writer.write(HEADER.pack(7, 0))  # not a frame; its socket stays open
            assert "unknown kind 7" in await workers[0].expect_status(
                grpc.StatusCode.INVALID_ARGUMENT
            )
            end = (await workers[1].expect_kind("stream_end")).stream_end
            assert end.reason == pb.END_REASON_PEER_LOST, end
            await workers[1].expect_status(grpc.StatusCode.ABORTED)
            assert asyncio.get_running_loop().time() - started < LINGER_S / 2

    run(scenario)


#: A state of 1 MiB (and its bias and buffer): far more than a small receive window holds.
BIG_WEIGHT = (32, 8192)
BIG_STATE_BYTES = (32 * 8192 + 32) * 4 + 8


async def slow_reader(port: int) -> FrameWorker:
    """A frame worker with a 16 KiB receive buffer: what it does not read stays with us."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 16384)  # before connect: the window
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", port))
    reader, writer = await asyncio.open_connection(sock=sock, limit=16384)
    writer.write(hello_frame(None))
    return FrameWorker(reader, writer)


async def refused_behind_a_megabyte(running: Running) -> tuple[FrameWorker, FrameWorker]:
    """Rank 0 sends a 1 MiB state, relayed to rank 1 (not reading), which then sends a
    bad frame: its STATUS queues behind the megabyte. Returns (rank 0, rank 1)."""
    port = frame_port(running)
    first = await FrameWorker.open(port)
    second = await slow_reader(port)
    big = signature(BIG_WEIGHT)
    for rank, worker in enumerate((first, second)):
        await worker.join(rank, sig=big)
    for worker in (first, second):
        await worker.expect_kind("welcome")
    state = bytes(BIG_STATE_BYTES)
    for offset in range(0, len(state), CHUNK):
        chunk = pb.StateChunk(offset=offset, payload=state[offset : offset + CHUNK])
        await first.send(pb.WorkerMessage(state=chunk))
    await asyncio.sleep(0.3)  # relayed as far as the windows let it
    second.writer.write(HEADER.pack(7, 0))  # not a frame: rank 1 is refused
    await second.writer.drain()
    return first, second


def test_a_refused_rank_reading_slowly_gets_every_byte_then_the_reason(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A refused rank that reads slowly (here for 6x the linger) still gets every byte
    queued before its STATUS, then the STATUS: nothing is cut or reset while it reads.
    (On loopback the kernel holds the whole megabyte; the transport's own buffer, as on a
    slow link, is `tests/unit/test_linger.py`'s.)"""
    monkeypatch.setattr(linger, "LINGER_S", 0.5)

    async def scenario() -> None:
        async with coordinator(world_size=2, heartbeat_timeout_s=30.0) as (running, _):
            first, second = await refused_behind_a_megabyte(running)
            started = asyncio.get_running_loop().time()
            messages: list[pb.CoordinatorMessage] = []
            while True:
                frame = await second.frame(timeout=10)
                assert frame is not None, "cut off before the STATUS frame"
                if frame[0] == STATUS:
                    code, details = decode_status(frame[1])
                    break
                messages.append(pb.CoordinatorMessage.FromString(frame[1]))
                await asyncio.sleep(0.012)  # about 300 KiB/s
            assert asyncio.get_running_loop().time() - started > 6 * linger.LINGER_S
            assert sum(len(m.state.payload) for m in messages) == BIG_STATE_BYTES
            assert code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
            assert "unknown kind 7" in details
            for worker in (first, second):
                worker.writer.close()
            assert await connections_end(running, 5)

    run(scenario)


def test_a_peer_that_neither_reads_nor_closes_is_cut_once_nothing_moves(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(linger, "LINGER_S", 0.5)

    async def scenario() -> None:
        async with coordinator(world_size=2, heartbeat_timeout_s=30.0) as (running, _):
            first, second = await refused_behind_a_megabyte(running)
            first.writer.close()
            # rank 1 (frozen) keeps its socket open and reads nothing
            assert await connections_end(running, 5 * linger.LINGER_S + 2)
            second.writer.close()

    run(scenario)


def test_lingering_connections_have_a_cap_of_their_own_the_oldest_is_cut(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Ended connections whose peers keep them open (here: refused, never closed, never
    read) are outside `--max-connections`: beyond their own cap the oldest is cut."""
    monkeypatch.setattr(frame_server, "MAX_LINGERING", 3)

    async def scenario() -> None:
        async with coordinator() as (running, _), frame_workers(frame_port(running)) as connect:
            frames = running.frames
            assert frames is not None
            workers = []
            for index in range(4):
                expected = min(index + 1, 3)
                worker = await connect()
                await worker.send(pb.WorkerMessage(heartbeat=pb.Heartbeat(step=0)))  # no Join
                workers.append(worker)
                await eventually(
                    lambda expected=expected: len(frames._lingering) == expected,
                    f"connection {index} to linger after its refusal",
                    timeout_s=5,
                )
            assert await connections_end_but(running, 3, within_s=5)
            # The oldest was cut (no longer lingering); the three newest still are.
            lingering = list(frames._lingering)
            assert len(lingering) == 3 and all(c in frames.connections for c in lingering)

    run(scenario)


async def connections_end_but(running: Running, left: int, within_s: float) -> bool:
    frames = running.frames
    assert frames is not None
    deadline = asyncio.get_running_loop().time() + within_s
    while len(frames.connections) > left and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.05)
    return len(frames.connections) == left
