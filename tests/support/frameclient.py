"""A Sync stream on a coordinator's frame port, driven frame by frame (tests only).

`FrameWorker` speaks `gradsync_proto.net.frames` over a real socket, with the
same methods as `support.rawclient.RawWorker` (the gRPC one), so a protocol
scenario can run on either pipe.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Protocol

import grpc
from gradsync_proto.net.frames import HEADER, MESSAGE, STATUS, decode_status, hello_frame
from gradsync_proto.v1 import gradsync_pb2 as pb

from support.rawclient import RawWorker

_STATUS_BY_CODE = {status.value[0]: status for status in grpc.StatusCode}


class FrameWorker(RawWorker):
    """One frame connection: HELLO sent by `open`, then messages, then the STATUS frame."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.assembly: list[pb.AssemblyProgress] = []
        self.step_reports: list[pb.StepReport] = []
        #: (status, details) once the STATUS frame came.
        self.status: tuple[grpc.StatusCode, str] | None = None

    @classmethod
    async def open(
        cls, port: int, token: str | None = None, hello: bool = True, source: str = "127.0.0.1"
    ) -> FrameWorker:
        """Connect from `source` (and say HELLO); close it with `close`, or open it in
        `frame_workers`."""
        connecting = asyncio.open_connection("127.0.0.1", port, local_addr=(source, 0))
        reader, writer = await asyncio.wait_for(connecting, 5)
        if hello:
            writer.write(hello_frame(token))
        return cls(reader, writer)

    async def send(self, message: pb.WorkerMessage | bytes) -> None:
        raw = message if isinstance(message, bytes) else message.SerializeToString()
        self.writer.write(HEADER.pack(MESSAGE, len(raw)) + raw)
        await asyncio.wait_for(self.writer.drain(), 5)

    async def frame(self, timeout: float = 5.0) -> tuple[int, bytes] | None:
        """The next frame, or None at the end of the connection."""
        try:
            header = await asyncio.wait_for(self.reader.readexactly(HEADER.size), timeout)
        except asyncio.IncompleteReadError as exc:
            assert not exc.partial, "the connection closed inside a frame header"
            return None
        kind, length = HEADER.unpack(header)
        body = await asyncio.wait_for(self.reader.readexactly(length), timeout)
        return kind, body

    async def recv(
        self, timeout: float = 5.0, assembly: bool = False, step_report: bool = False
    ) -> pb.CoordinatorMessage:
        while True:
            frame = await self.frame(timeout)
            assert frame is not None, "the connection closed without a status"
            kind, body = frame
            assert kind == MESSAGE, f"the stream ended: {decode_status(body)}"
            message = pb.CoordinatorMessage.FromString(body)
            which = message.WhichOneof("kind")
            if which == "assembly" and not assembly:
                self.assembly.append(message.assembly)
            elif which == "step_report" and not step_report:
                self.step_reports.append(message.step_report)
            else:
                return message

    async def expect_status(self, code: grpc.StatusCode) -> str:
        """Read until the STATUS frame; assert its code; the connection then closes."""
        while True:
            frame = await self.frame()
            assert frame is not None, "the connection closed without a status"
            kind, body = frame
            if kind == STATUS:
                number, details = decode_status(body)
                self.status = (_STATUS_BY_CODE[number], details)
                assert self.status[0] == code, self.status
                assert await self.frame() is None, "a frame after the STATUS frame"
                return details

    async def leave(self) -> None:
        await self.send(pb.WorkerMessage(leave=pb.Leave(reason="test done")))
        await self.expect_status(grpc.StatusCode.OK)

    async def close(self) -> None:
        self.writer.close()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.writer.wait_closed(), 5)


@contextlib.asynccontextmanager
async def frame_workers(port: int) -> AsyncIterator[Opener]:
    """`open(token=..., hello=...)` connects a FrameWorker to `port`; all are closed at exit."""
    opened: list[FrameWorker] = []

    async def open_one(
        token: str | None = None, hello: bool = True, source: str = "127.0.0.1"
    ) -> FrameWorker:
        worker = await FrameWorker.open(port, token, hello, source)
        opened.append(worker)
        return worker

    try:
        yield open_one
    finally:
        for worker in opened:
            await worker.close()


class Opener(Protocol):
    async def __call__(
        self, token: str | None = None, hello: bool = True, source: str = "127.0.0.1"
    ) -> FrameWorker: ...
