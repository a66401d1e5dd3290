"""The coordinator's frame port (`gradsync_server.rpc.frame_server`) on real sockets.

Workers' Sync streams run on the frame port by default (issue 27), so the
behaviour of a gRPC Sync stream must hold there too. A real in-process
coordinator and workers speaking frames on real sockets (`FrameWorker`),
beside gRPC workers (`RawWorker`) in the same job:

- a step averages exactly, also with one rank on each pipe, and a goodbye
  ends with an OK STATUS frame; the FramePort RPC names the port;
- the token is checked before anything else is read (the job a refused
  HELLO names never exists), a silent connection is ended at the
  first-message deadline, a frame over the size limit or bytes that are not
  frames are refused with a status that says why, and the coordinator goes on
  serving others;
- the connection cap counts frame connections too; over mTLS with a token a worker
  still gets frames, and a peer without a client certificate is cut off in the handshake;
- `Transport` (the worker's real stream) uses frames when offered, gRPC with
  `GRADSYNC_FRAMES=0`, and falls back to gRPC (and says so) when the frame
  port cannot be reached.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
from pathlib import Path

import grpc
import numpy as np
import pytest
import trustme
from gradsync.control.transport import Transport
from gradsync_proto import auth
from gradsync_proto.net.channels import ChannelSecurity
from gradsync_proto.net.frame_stream import ENV_FRAMES, FRAME_PORT_METHOD
from gradsync_proto.net.frames import HEADER, MESSAGE, STATUS, decode_status, hello_frame
from gradsync_proto.v1 import gradsync_pb2 as pb
from gradsync_server.app import Running
from gradsync_server.rpc.frame_server import MAX_UNGREETED, MAX_UNGREETED_PER_SOURCE
from support.frameclient import frame_workers
from support.rawclient import (
    BUCKET_BYTES,
    CHUNK,
    RawWorker,
    bucket_values,
    coordinator,
    healthy_step,
    run,
    run_step,
    signature,
)

TOKEN = "frame-port-token-0123456789"


def frame_port(running: Running) -> int:
    assert running.frames is not None, "the coordinator serves no frame port"
    return running.frames.port


async def assembled(workers: list[RawWorker], job_id: str = "job") -> None:
    """Join every worker as rank i, wait for the Welcome, send and receive rank 0's state."""
    for rank, worker in enumerate(workers):
        await worker.join(rank, world_size=len(workers), job_id=job_id)
    for worker in workers:
        await worker.expect_kind("welcome")
    state = bytes(BUCKET_BYTES + 8)
    for offset in range(0, len(state), CHUNK):
        chunk = pb.StateChunk(offset=offset, payload=state[offset : offset + CHUNK])
        await workers[0].send(pb.WorkerMessage(state=chunk))
    for worker in workers[1:]:
        for _ in range(3):
            await worker.expect_kind("state")


def test_a_step_over_frames_averages_exactly_and_a_goodbye_ends_ok() -> None:
    async def scenario() -> None:
        async with coordinator() as (running, channel):
            ask = channel.unary_unary(
                FRAME_PORT_METHOD, response_deserializer=pb.FramePortReply.FromString
            )
            reply = await ask(pb.FramePortRequest().SerializeToString())
            assert reply.port == frame_port(running) != running.port
            async with frame_workers(reply.port) as connect:
                workers: list[RawWorker] = [await connect() for _ in range(2)]
                await assembled(workers)
                assert running.frames is not None and len(running.frames.connections) == 2
                for step in range(3):
                    await run_step(workers, step)
                for worker in workers:
                    await worker.leave()

    run(scenario)


def test_one_rank_on_frames_and_one_on_grpc_make_one_job() -> None:
    async def scenario() -> None:
        async with (
            coordinator() as (running, channel),
            frame_workers(frame_port(running)) as connect,
        ):
            workers = [await connect(), RawWorker(channel)]
            await assembled(workers)
            await run_step(workers, 0)
            # Uneven contributions: the average is the same whichever pipe brought them.
            values = [bucket_values(7, 1), bucket_values(3, 1) * 5]
            for worker, value in zip(workers, values, strict=True):
                await worker.upload_bucket(1, value)
            expected = (values[0] + values[1]) / np.float32(2)
            for worker in workers:
                np.testing.assert_array_equal(await worker.receive_bucket(1), expected)

    run(scenario)


@pytest.mark.parametrize("presented", [None, "not-the-token-0123456789"])
def test_a_hello_without_the_token_is_refused_before_any_state_change(
    presented: str | None,
) -> None:
    async def scenario() -> None:
        async with (
            coordinator(token=TOKEN) as (running, _),
            frame_workers(frame_port(running)) as connect,
        ):
            worker = await connect(token=presented)
            await worker.join(0, job_id="intruder")
            details = await worker.expect_status(grpc.StatusCode.UNAUTHENTICATED)
            assert auth.ENV_TOKEN in details
            assert ("carried none" in details) == (presented is None)
            assert "intruder" not in running.servicer.jobs
            assert running.frames is not None and running.frames.refused == 1
            good: list[RawWorker] = [await connect(token=TOKEN) for _ in range(2)]
            await assembled(good)
            await run_step(good, 0)

    run(scenario)


def test_a_connection_that_says_nothing_is_ended_at_the_first_message_deadline() -> None:
    async def scenario() -> None:
        async with (
            coordinator(first_message_timeout_s=0.3) as (running, _),
            frame_workers(frame_port(running)) as connect,
        ):
            worker = await connect(hello=False)
            details = await worker.expect_status(grpc.StatusCode.DEADLINE_EXCEEDED)
            assert "no HELLO" in details
            # Said hello, then nothing: the Sync handler's own first-message deadline.
            quiet = await connect()
            details = await quiet.expect_status(grpc.StatusCode.DEADLINE_EXCEEDED)
            assert "sent no first message" in details

    run(scenario)


@pytest.mark.parametrize(
    ("raw", "code", "words"),
    [
        (
            HEADER.pack(MESSAGE, 2**32 - 1),
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            "more than the limit",
        ),
        (HEADER.pack(7, 0), grpc.StatusCode.INVALID_ARGUMENT, "unknown kind 7"),
        (HEADER.pack(STATUS, 4) + bytes(4), grpc.StatusCode.INVALID_ARGUMENT, "after the HELLO"),
    ],
)
def test_bytes_that_are_not_frames_are_refused_with_a_status_and_others_go_on(
    raw: bytes, code: grpc.StatusCode, words: str
) -> None:
    async def scenario() -> None:
        async with (
            coordinator() as (running, channel),
            frame_workers(frame_port(running)) as connect,
        ):
            worker = await connect()
            worker.writer.write(raw)
            assert words in await worker.expect_status(code)
            await healthy_step(channel)

    run(scenario)


def test_another_protocol_on_the_frame_port_is_told_so() -> None:
    async def scenario() -> None:
        async with coordinator() as (running, _), frame_workers(frame_port(running)) as connect:
            worker = await connect(hello=False)
            body = b"GET / HTTP/1.1\r\nHost: x\r\n\r\n"
            worker.writer.write(HEADER.pack(1, len(body)) + body)
            assert "not a gradsync worker" in await worker.expect_status(
                grpc.StatusCode.INVALID_ARGUMENT
            )

    run(scenario)


def test_frame_connections_count_against_the_connection_cap() -> None:
    async def scenario() -> None:
        async with (
            coordinator(max_connections=1) as (running, _),
            frame_workers(frame_port(running)) as connect,
        ):
            first = await connect()
            await first.join(0)
            await first.expect_kind("assembly")
            second = await connect()
            details = await second.expect_status(grpc.StatusCode.RESOURCE_EXHAUSTED)
            assert "--max-connections" in details

    run(scenario)


def _join(rank: int = 0) -> pb.Join:
    return pb.Join(
        job_id="transport", rank=rank, world_size=1, signature=signature(), incarnation="t-0"
    )


async def _pipe_of_a_joined_transport(
    running: Running, security: ChannelSecurity | None = None
) -> str:
    def join() -> str:
        transport = Transport(f"127.0.0.1:{running.port}", rank=0, security=security)
        try:
            transport.open(_join())
            transport.wait_welcome(timeout_s=10)
            return str(transport._sync.pipe)
        finally:
            transport.close(timeout_s=5)

    return await asyncio.to_thread(join)


def test_the_worker_transport_uses_frames_when_offered_and_grpc_when_told() -> None:
    async def scenario() -> None:
        async with coordinator(world_size=1) as (running, _):
            assert await _pipe_of_a_joined_transport(running) == "frames"
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv(ENV_FRAMES, "0")
            async with coordinator(world_size=1) as (running, _):
                assert await _pipe_of_a_joined_transport(running) == "grpc"
        async with coordinator(world_size=1, frame_port=None) as (running, _):
            assert running.frames is None
            assert await _pipe_of_a_joined_transport(running) == "grpc"

    run(scenario)


def test_an_unreachable_frame_port_falls_back_to_grpc_and_says_so(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def scenario() -> None:
        async with coordinator(world_size=1) as (running, _):
            assert running.frames is not None
            await running.frames.stop()  # still announced, nothing listens (a firewall)
            with caplog.at_level(logging.WARNING, logger="gradsync.net"):
                assert await _pipe_of_a_joined_transport(running) == "grpc"
            assert any(
                "cannot be reached" in record.getMessage()
                and "gRPC port instead" in record.getMessage()
                for record in caplog.records
            )

    run(scenario)


def test_a_refusal_is_a_stream_end_message_then_the_status_frame_then_nothing() -> None:
    async def scenario() -> None:
        async with coordinator() as (running, _), frame_workers(frame_port(running)) as connect:
            worker = await connect()
            await worker.send(pb.WorkerMessage(heartbeat=pb.Heartbeat(step=0)))
            frame = await worker.frame()
            assert frame is not None and frame[0] == MESSAGE
            end = pb.CoordinatorMessage.FromString(frame[1]).stream_end
            assert "must be a Join, got heartbeat" in end.message
            frame = await worker.frame()
            assert frame is not None and frame[0] == STATUS
            code, details = decode_status(frame[1])
            assert code == end.code and details == end.message
            assert await worker.frame() is None

    run(scenario)


def test_a_right_token_behind_a_refused_hello_in_the_same_packet_is_not_looked_at(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def scenario() -> None:
        async with (
            coordinator(token=TOKEN) as (running, _),
            frame_workers(frame_port(running)) as connect,
        ):
            worker = await connect(hello=False)
            join = pb.WorkerMessage(
                join=pb.Join(
                    job_id="sneaky", rank=0, world_size=2, signature=signature(), incarnation="s"
                )
            )
            raw = join.SerializeToString()
            # One write: a wrong HELLO, the right one, a Join: only the first is read.
            worker.writer.write(
                hello_frame("wrong-token-0123456789")
                + hello_frame(TOKEN)
                + HEADER.pack(MESSAGE, len(raw))
                + raw
            )
            with caplog.at_level(logging.INFO, logger="gradsync.server"):
                await worker.expect_status(grpc.StatusCode.UNAUTHENTICATED)
                await asyncio.sleep(0.2)
            # Not even joined for a moment (a job that is then abandoned when it drops).
            assert not [r for r in caplog.records if "sneaky" in r.getMessage()]
            assert "sneaky" not in running.servicer.jobs

    run(scenario)


def test_silent_connections_are_bounded_per_address_and_in_all_the_oldest_is_dropped() -> None:
    """One address holds at most half the ungreeted slots (one more drops its own oldest);
    all addresses together the whole cap (one more drops the oldest of all)."""

    async def scenario() -> None:
        async with (
            coordinator(first_message_timeout_s=30) as (running, _),
            frame_workers(frame_port(running)) as connect,
        ):
            frames = running.frames
            assert frames is not None
            first = [await connect(hello=False) for _ in range(MAX_UNGREETED_PER_SOURCE + 1)]
            details = await first[0].expect_status(grpc.StatusCode.RESOURCE_EXHAUSTED)
            assert "from 127.0.0.1" in details and "waiting to say HELLO" in details
            assert len(frames._ungreeted) == MAX_UNGREETED_PER_SOURCE
            second = [
                await connect(hello=False, source="127.0.0.2")
                for _ in range(MAX_UNGREETED_PER_SOURCE)
            ]
            assert len(frames._ungreeted) == MAX_UNGREETED  # nobody was dropped for them
            await connect(hello=False, source="127.0.0.3")
            details = await first[1].expect_status(grpc.StatusCode.RESOURCE_EXHAUSTED)
            assert "127.0.0.1" not in details and "waiting to say HELLO" in details
            assert len(frames._ungreeted) == MAX_UNGREETED
            held = dict(frames._ungreeted_by_source)
            assert held == {"127.0.0.1": MAX_UNGREETED_PER_SOURCE - 1,
                            "127.0.0.2": len(second), "127.0.0.3": 1}, held  # fmt: skip
            # Workers that say HELLO are not held up by them.
            workers: list[RawWorker] = [await connect() for _ in range(2)]
            await assembled(workers)
            await run_step(workers, 0)

    run(scenario)


def test_frames_over_mtls_with_a_token_and_a_peer_without_a_certificate_refused(
    tmp_path: Path,
) -> None:
    ca = trustme.CA()
    ca_path, server_path, client_path = (tmp_path / name for name in ("ca", "srv", "cli"))
    ca.cert_pem.write_to_path(str(ca_path))
    ca.issue_cert("127.0.0.1").private_key_and_cert_chain_pem.write_to_path(str(server_path))
    ca.issue_cert("worker.test").private_key_and_cert_chain_pem.write_to_path(str(client_path))
    tls = {"tls_cert": str(server_path), "tls_key": str(server_path), "tls_client_ca": str(ca_path)}
    good = ChannelSecurity.resolve(
        str(ca_path), str(client_path), str(client_path), token=TOKEN, environ={}
    )

    async def scenario() -> None:
        async with coordinator(world_size=1, token=TOKEN, **tls) as (running, _):
            assert await _pipe_of_a_joined_transport(running, good) == "frames"
            assert running.frames is not None and running.frames.refused == 0
            # No client certificate: the frame port's handshake refuses it (as gRPC's does).
            assert await _refused_without_a_certificate(frame_port(running), str(ca_path))

    run(scenario)


async def _refused_without_a_certificate(port: int, ca_path: str) -> bool:
    """Whether a TLS client without a certificate is cut off (in or right after the handshake)."""
    context = ssl.create_default_context(cafile=ca_path)
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port, ssl=context)
    except (ssl.SSLError, ConnectionError):
        return True
    try:
        writer.write(hello_frame(TOKEN))
        await writer.drain()
        return await asyncio.wait_for(reader.read(1), 5) == b""  # TLS 1.3: told after it
    except (ssl.SSLError, ConnectionError):
        return True
    finally:
        writer.close()
