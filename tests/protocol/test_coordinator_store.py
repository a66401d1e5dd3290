"""The coordinator's rendezvous store (`Coordinator.Store`) through `CoordinatorStore`.

A real coordinator on a loopback port serves the calls; the store's blocking
client runs in a thread, as torch.distributed calls it. Every c10d operation
against the semantics of torch's own stores; a blocking get woken by another
client's set, or refused at its timeout naming the key; limits refused with
their words; a caller that goes away frees its wait; namespaces kept apart;
no token, no store.
"""

from __future__ import annotations

import asyncio
import time
from datetime import timedelta

import grpc
import pytest
import torch.distributed as dist
from gradsync.distributed.store import STORE_METHOD, CoordinatorStore
from gradsync_proto.net.channels import ChannelSecurity
from gradsync_proto.v1 import gradsync_pb2 as pb
from gradsync_server.rpc.kv_store import StoreLimits
from support.rawclient import coordinator, run
from support.waiting import eventually

TOKEN = "store-test-token-0123456789abcdef"


def store_at(
    port: int, namespace: str = "job", timeout_s: float = 5.0, token: str | None = None
) -> CoordinatorStore:
    return CoordinatorStore(
        f"127.0.0.1:{port}",
        namespace=namespace,
        security=ChannelSecurity(token=token),
        timeout=timedelta(seconds=timeout_s),
    )


def test_every_store_operation_behaves_as_torch_stores_do() -> None:
    async def scenario() -> None:
        async with coordinator() as (running, _):

            def operations() -> None:
                store = store_at(running.port)
                store.set("a", "1")
                store.set("b", b"\x00\xff")
                assert store.get("a") == b"1" and store.get("b") == b"\x00\xff"
                assert store.add("n", 3) == 3 and store.add("n", -1) == 2
                assert store.get("n") == b"2"
                assert store.compare_set("c", "", "x") == b"x"  # absent, expected empty: set
                assert store.compare_set("c", "y", "z") == b"x"  # mismatch: current value
                assert store.compare_set("c", "x", "z") == b"z"  # match: set
                assert store.compare_set("d", "q", "r") == b"q"  # absent: expected back
                assert store.check(["a", "n", "c"]) and not store.check(["a", "d"])
                store.wait(["a", "b"])
                assert store.num_keys() == 4
                assert store.delete_key("a") and not store.delete_key("a")
                assert store.num_keys() == 3
                # torch's own wrapper works over it (what init_process_group uses).
                prefixed = dist.PrefixStore("default_pg", store)
                prefixed.set("k", "v")
                assert prefixed.get("k") == b"v" and store.get("default_pg/k") == b"v"
                # Another namespace sees none of it.
                assert store_at(running.port, "other").num_keys() == 0
                store.close()

            await asyncio.to_thread(operations)
            assert running.servicer.kv_store.namespace_count() == 1

    run(scenario)


def test_a_blocking_get_wakes_on_a_set_and_times_out_naming_the_key() -> None:
    async def scenario() -> None:
        async with coordinator() as (running, _):
            kv = running.servicer.kv_store
            waiter = store_at(running.port, timeout_s=10.0)
            setter = store_at(running.port)
            got = asyncio.create_task(asyncio.to_thread(waiter.get, "late"))
            await eventually(lambda: kv.waiting() == 1, "the get to wait on the coordinator")
            started = time.monotonic()
            await asyncio.to_thread(setter.set, "late", "here")
            assert await got == b"here"
            assert time.monotonic() - started < 2.0
            assert kv.waiting() == 0
            short = store_at(running.port, timeout_s=0.5)
            started = time.monotonic()
            with pytest.raises(dist.DistStoreError) as caught:
                await asyncio.to_thread(short.wait, ["never", "late"])
            took = time.monotonic() - started
            assert 0.4 < took < 3.0, took
            message = str(caught.value)
            for needle in ("DEADLINE_EXCEEDED", "['never']", "'job'", "not set within 0.500 s"):
                assert needle in message, message
            assert kv.waiting() == 0 and kv.namespace_count() == 1

    run(scenario)


def test_a_caller_that_goes_away_frees_its_wait() -> None:
    async def scenario() -> None:
        async with coordinator() as (running, channel):
            kv = running.servicer.kv_store
            call = channel.unary_unary(
                STORE_METHOD,
                request_serializer=pb.StoreRequest.SerializeToString,
                response_deserializer=pb.StoreReply.FromString,
            )
            request = pb.StoreRequest(
                op=pb.STORE_OP_GET, namespace="job", keys=["k"], timeout_ms=60_000
            )
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await call(request, timeout=0.5)  # the caller gives up long before
            assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            await eventually(lambda: kv.waiting() == 0, "the abandoned wait to be freed")
            assert kv.namespace_count() == 0

    run(scenario)


@pytest.mark.parametrize(
    ("limits", "action", "code", "needles"),
    [
        (
            StoreLimits(max_value_bytes=16),
            lambda s: s.set("k", b"x" * 17),
            "RESOURCE_EXHAUSTED",
            ["17 bytes", "limit of 16 bytes"],
        ),
        (
            StoreLimits(max_key_bytes=8),
            lambda s: s.set("k" * 9, b"x"),
            "INVALID_ARGUMENT",
            ["is 9 bytes", "1 to 8 bytes"],
        ),
        (
            StoreLimits(max_keys_per_namespace=2),
            lambda s: [s.set(f"k{i}", b"x") for i in range(3)],
            "RESOURCE_EXHAUSTED",
            ["holds 2 keys (the limit)", "'k2' refused"],
        ),
        (
            StoreLimits(max_namespace_bytes=10),
            lambda s: [s.set("a", b"x" * 5), s.set("b", b"y" * 5)],
            "RESOURCE_EXHAUSTED",
            ["would hold 12 bytes with key 'b'", "limit of 10 bytes"],
        ),
        (
            StoreLimits(max_waiters=0),
            lambda s: s.get("nothing"),
            "RESOURCE_EXHAUSTED",
            ["0 callers already wait", "'nothing'"],
        ),
        (
            StoreLimits(),
            lambda s: [s.set("n", b"abc"), s.add("n", 1)],
            "FAILED_PRECONDITION",
            ["holds b'abc', not an integer"],
        ),
    ],
    ids=["value", "key", "keys", "bytes", "waiters", "add"],
)
def test_limits_are_refused_naming_the_key_and_the_limit(
    limits: StoreLimits, action: object, code: str, needles: list[str]
) -> None:
    async def scenario() -> None:
        async with coordinator() as (running, _):
            running.servicer.kv_store.limits = limits
            store = store_at(running.port)
            with pytest.raises(dist.DistStoreError) as caught:
                await asyncio.to_thread(action, store)  # type: ignore[arg-type]
            message = str(caught.value)
            assert f"failed ({code})" in message, message
            for needle in needles:
                assert needle in message, message

    run(scenario)


def test_namespaces_are_bounded_and_idle_ones_make_room() -> None:
    async def scenario() -> None:
        async with coordinator() as (running, _):
            kv = running.servicer.kv_store
            kv.limits = StoreLimits(max_namespaces=2, idle_eviction_s=0.3)
            await asyncio.to_thread(store_at(running.port, "one").set, "k", "v")
            await asyncio.to_thread(store_at(running.port, "two").set, "k", "v")
            with pytest.raises(dist.DistStoreError) as caught:
                await asyncio.to_thread(store_at(running.port, "three").set, "k", "v")
            assert "holds 2 namespaces (the limit)" in str(caught.value)
            await asyncio.sleep(0.4)
            await asyncio.to_thread(store_at(running.port, "three").set, "k", "v")
            assert kv.namespace_count() == 2
            assert await asyncio.to_thread(store_at(running.port, "one").num_keys) == 0

    run(scenario)


def test_without_the_token_the_store_is_refused_and_untouched() -> None:
    async def scenario() -> None:
        async with coordinator(token=TOKEN) as (running, _):
            for token in (None, "wrong-token-0123456789abcdefghij"):
                with pytest.raises(dist.DistStoreError) as caught:
                    await asyncio.to_thread(store_at(running.port, token=token).set, "k", "v")
                assert "failed (UNAUTHENTICATED)" in str(caught.value), caught.value
            assert running.servicer.kv_store.namespace_count() == 0
            good = store_at(running.port, token=TOKEN)
            await asyncio.to_thread(good.set, "k", "v")
            assert await asyncio.to_thread(good.get, "k") == b"v"

    run(scenario)
