"""`gradsync_proto.net.stream_client.StreamClient` against a real grpc.aio server.

The class every dialed stream is built on (the worker's Sync and shard data
streams, later a shard's link to its leader), tested for its own contract:
messages both ways in order, items encoded when written, every way a
stream ends turned into one `StreamEnded` handed over exactly once, and
every bound (connect, silence, close) kept.
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import grpc
import pytest
from gradsync_proto.codes import Code
from gradsync_proto.net.stream_client import EndKind, StreamClient, StreamEnded
from gradsync_proto.v1 import gradsync_pb2 as pb
from support.rawclient import run

pytestmark = pytest.mark.protocol

METHOD = "/test.Echo/Stream"
Handler = Callable[[AsyncIterator[bytes], grpc.aio.ServicerContext], Awaitable[None]]


@asynccontextmanager
async def serve(handler: Handler) -> AsyncIterator[str]:
    """A grpc.aio server with one raw-bytes stream method; yields its target."""
    server = grpc.aio.server()
    server.add_generic_rpc_handlers(
        (
            grpc.method_handlers_generic_handler(
                "test.Echo", {"Stream": grpc.stream_stream_rpc_method_handler(handler)}
            ),
        )
    )
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        await server.stop(None)


@dataclass
class Seen:
    """What a client's callbacks were handed."""

    messages: list[bytes] = field(default_factory=list)
    ends: list[StreamEnded] = field(default_factory=list)

    def client(self, target: str, **kwargs: object) -> StreamClient:
        return StreamClient(target, METHOD, self.messages.append, self.ends.append, **kwargs)  # type: ignore[arg-type]


async def echo(requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> None:
    """Answers every message with itself reversed; b"end" ends OK, b"abort" aborts."""
    async for raw in requests:
        if raw == b"end":
            return
        if raw == b"abort":
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "asked to abort")
        await context.write(raw[::-1])


async def until(condition: Callable[[], bool], timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)


def test_messages_go_both_ways_in_order_and_items_are_encoded_when_written() -> None:
    async def scenario() -> None:
        async with serve(echo) as target:
            seen = Seen()
            counter = iter(range(100))

            def encode(item: object) -> Iterator[bytes]:
                # Read at write time, not when queued: the number goes up as written.
                assert isinstance(item, bytes)
                return iter([item + str(next(counter)).encode(), item + b"!"])

            client = seen.client(target, encode=encode)
            client.send(b"a")  # before start: written first
            client.start()
            client.send(b"b")
            await until(lambda: len(seen.messages) == 4)
            assert seen.messages == [b"0a", b"!a", b"1b", b"!b"]
            assert client.connected
            await client.close(2.0)
            assert [end.kind for end in seen.ends] == [EndKind.CLOSED]
            assert client.ended is seen.ends[0] and client.ended.closing

    run(scenario)


def test_protobuf_messages_with_a_serializer() -> None:
    async def scenario() -> None:
        async def answer(requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> None:
            async for raw in requests:
                step = pb.WorkerMessage.FromString(raw).heartbeat.step
                await context.write(
                    pb.CoordinatorMessage(step_report=pb.StepReport(step=step)).SerializeToString()
                )

        async with serve(answer) as target:
            seen = Seen()
            client = seen.client(
                target,
                serializer=pb.WorkerMessage.SerializeToString,
                deserializer=pb.CoordinatorMessage.FromString,
            )
            client.start()
            client.send(pb.WorkerMessage(heartbeat=pb.Heartbeat(step=7)))
            await until(lambda: bool(seen.messages))
            assert seen.messages[0].step_report.step == 7  # type: ignore[attr-defined]
            await client.close(1.0)

    run(scenario)


@pytest.mark.parametrize(
    ("last", "kind", "code", "details"),
    [
        (b"end", EndKind.STATUS, Code.OK, ""),
        (b"abort", EndKind.STATUS, Code.FAILED_PRECONDITION, "asked to abort"),
    ],
)
def test_the_peers_status_ends_the_stream_once(
    last: bytes, kind: EndKind, code: Code, details: str
) -> None:
    async def scenario() -> None:
        async with serve(echo) as target:
            seen = Seen()
            client = seen.client(target)
            client.start()
            client.send(b"xy")
            client.send(last)
            ended = await client.wait(5.0)
            assert ended is not None and (ended.kind, ended.code, ended.details) == (
                kind,
                code,
                details,
            )
            assert ended.clean is (code is Code.OK) and not ended.closing
            assert seen.messages == [b"yx"]
            await client.close(1.0)  # after the end: nothing new to report
            assert seen.ends == [ended]

    run(scenario)


def test_a_silent_peer_ends_the_stream_after_the_idle_timeout() -> None:
    async def silent(requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> None:
        async for _ in requests:
            pass

    async def scenario() -> None:
        async with serve(silent) as target:
            seen = Seen()
            client = seen.client(target, idle_timeout_s=0.3)
            started = time.monotonic()
            client.start()
            ended = await client.wait(5.0)
            assert ended is not None and ended.kind is EndKind.TIMEOUT
            assert (
                ended.code == Code.DEADLINE_EXCEEDED
                and "silent for more than 0.3s" in ended.details
            )
            assert time.monotonic() - started < 3.0
            await client.close(1.0)
            assert len(seen.ends) == 1

    run(scenario)


def test_a_server_that_is_not_there_ends_the_stream_after_the_connect_timeout() -> None:
    with socket.socket() as probe:  # a port nobody listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]

    async def scenario() -> None:
        seen = Seen()
        client = seen.client(f"127.0.0.1:{port}", connect_timeout_s=0.5)
        client.start()
        client.send(b"lost")
        ended = await client.wait(10.0)
        assert ended is not None and ended.kind is EndKind.TIMEOUT
        assert ended.code == Code.UNAVAILABLE and "could not connect within 0.5s" in ended.details
        assert not client.connected
        await client.close(1.0)
        assert len(seen.ends) == 1

    run(scenario)


def test_close_says_goodbye_and_waits_for_the_peer_to_end() -> None:
    async def until_goodbye(
        requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext
    ) -> None:
        async for raw in requests:
            if raw == b"bye":
                await context.write(b"farewell seen")
        # the client half-closed after its goodbye: end OK

    async def scenario() -> None:
        async with serve(until_goodbye) as target:
            seen = Seen()
            client = seen.client(target)
            client.start()
            client.send(b"hello")
            await until(lambda: client.connected)
            await client.close(5.0, farewell=b"bye")
            assert seen.messages == [b"farewell seen"]
            (ended,) = seen.ends
            assert ended.clean and ended.closing  # the peer ended it, as asked

    run(scenario)


def test_close_is_bounded_when_the_peer_never_answers_the_goodbye() -> None:
    async def deaf(requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> None:
        await asyncio.sleep(30)

    async def scenario() -> None:
        async with serve(deaf) as target:
            seen = Seen()
            client = seen.client(target)
            client.start()
            client.send(b"hello")
            await until(lambda: client.connected)
            started = time.monotonic()
            await client.close(0.3, farewell=b"bye")
            assert time.monotonic() - started < 3.0
            (ended,) = seen.ends
            assert ended.kind is EndKind.CLOSED and ended.code == Code.CANCELLED
            pending = [t for t in asyncio.all_tasks() if t.get_name().startswith("gradsync-")]
            assert not [t for t in pending if not t.done()]

    run(scenario)


def test_a_handler_that_raises_ends_the_stream_as_a_fault() -> None:
    async def scenario() -> None:
        async with serve(echo) as target:
            ends: list[StreamEnded] = []

            def broken(message: bytes) -> None:
                raise RuntimeError(f"cannot take {message!r}")

            client = StreamClient(target, METHOD, broken, ends.append)
            client.start()
            client.send(b"ab")
            ended = await client.wait(5.0)
            assert ended is not None and ended.kind is EndKind.FAULT
            assert isinstance(ended.cause, RuntimeError) and "cannot take b'ba'" in ended.details
            await client.close(1.0)
            assert ends == [ended]

    run(scenario)


def test_a_status_that_overtakes_a_write_is_never_reported_as_internal() -> None:
    """grpc-python turns a write that fails in core into INTERNAL "Internal error from
    Core", hiding the peer's status: that end means the transport broke (UNAVAILABLE,
    which a worker recovers from by reconnecting), not a coordinator bug."""

    async def scenario() -> None:
        async def refuse(requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> None:
            async for _ in requests:
                await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "go away")

        codes = []
        async with serve(refuse) as target:
            for _ in range(10):
                seen = Seen()
                options = [("grpc.max_send_message_length", 8 << 20)]
                client = seen.client(target, options=options)
                client.start()
                for _ in range(30):  # writes still queued when the status arrives
                    client.send(b"x" * (1 << 20))
                ended = await client.wait(10.0)
                await client.close(1.0)
                assert ended is not None
                codes.append(ended.code)
                if ended.code == Code.UNAVAILABLE:
                    assert "broke under a write" in ended.details, ended
        assert set(codes) <= {Code.FAILED_PRECONDITION, Code.UNAVAILABLE}, codes

    run(scenario)
