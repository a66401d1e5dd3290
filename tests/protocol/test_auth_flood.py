"""A flood of unauthenticated streams cannot hold the coordinator's handlers.

A refused stream waits briefly for the caller's first message (so the caller
learns UNAUTHENTICATED rather than gRPC's INTERNAL race); those waits are
bounded in number, so silent unauthenticated streams beyond the bound are
refused at once. Real gRPC against an in-process coordinator with a token.
"""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest
from gradsync_server import app
from gradsync_server.rpc.auth_check import (
    FIRST_MESSAGE_WAIT_S,
    MAX_WAITING_REFUSALS,
    RefusalLog,
    TokenCheck,
    interceptors,
)
from support.rawclient import RawWorker, coordinator, run
from support.waiting import eventually

TOKEN = "flood-test-token-0123456789abcdef"


def test_silent_unauthenticated_streams_beyond_the_bound_are_refused_at_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    checks: list[TokenCheck] = []

    def recorded_interceptors(
        token: str | None, shard_token: str | None = None, refusals: RefusalLog | None = None
    ) -> list[grpc.aio.ServerInterceptor]:
        made = interceptors(token, shard_token, refusals)
        checks.extend(check for check in made if isinstance(check, TokenCheck))
        return made

    # The server's token check, to see how many refused streams wait on it.
    monkeypatch.setattr(app, "interceptors", recorded_interceptors)

    async def refused_at(worker: RawWorker) -> float:
        code = await asyncio.wait_for(worker.call.code(), FIRST_MESSAGE_WAIT_S * 5)
        assert code == grpc.StatusCode.UNAUTHENTICATED
        return time.monotonic()

    async def scenario() -> None:
        async with coordinator(token=TOKEN) as (_, channel):
            silent = [RawWorker(channel) for _ in range(MAX_WAITING_REFUSALS)]
            waits = [asyncio.create_task(refused_at(worker)) for worker in silent]
            await eventually(
                lambda: checks[0].waiting == MAX_WAITING_REFUSALS,
                "every silent stream to wait for a first message that never comes",
                timeout_s=FIRST_MESSAGE_WAIT_S,
            )
            extra = await refused_at(RawWorker(channel))
            # Ordering, not absolute time: without the bound the extra stream would wait
            # its FIRST_MESSAGE_WAIT_S too, and be refused after the ones opened before it.
            assert extra < min(await asyncio.gather(*waits)), "the extra stream waited its turn"

    run(scenario)
