"""The leader's shard registry: checks, index assignment, liveness, counters (pure, no sockets)."""

from __future__ import annotations

import pytest
from gradsync_proto import chunking
from gradsync_proto.codes import Code
from gradsync_proto.v1 import gradsync_pb2 as pb
from gradsync_server.control.shard_registry import RegistrationRefused, ShardRegistry

CHUNK = 1 << 20
VERSION = "0.4.0"


class FakeClock:
    def __init__(self) -> None:
        self.now = 50.0

    def __call__(self) -> float:
        return self.now


def register(
    address: str,
    version: str = VERSION,
    chunk_bytes: int = CHUNK,
    max_message_bytes: int = CHUNK + chunking.HEADER_SLACK_BYTES,
) -> pb.ShardRegister:
    return pb.ShardRegister(
        version=version,
        advertise=address,
        chunk_bytes=chunk_bytes,
        max_message_bytes=max_message_bytes,
    )


def registry(shard_count: int = 3) -> tuple[ShardRegistry, FakeClock]:
    clock = FakeClock()
    return ShardRegistry(shard_count, VERSION, CHUNK, clock, f"--shards {shard_count}"), clock


def refusal(reg: ShardRegistry, message: pb.ShardRegister) -> RegistrationRefused:
    with pytest.raises(RegistrationRefused) as refused:
        reg.register(message)
    return refused.value


def test_an_unsharded_registry_is_complete_and_refuses_shards() -> None:
    reg, _ = registry(1)
    assert reg.complete() and reg.shard_map() == [] and not reg.sharded
    refused = refusal(reg, register("b:1"))
    assert refused.code is Code.FAILED_PRECONDITION
    assert "not sharded" in refused.message and "--shards" in refused.message


def test_shards_get_the_lowest_free_index_and_complete_the_map() -> None:
    reg, _ = registry(3)
    assert reg.shard_map() is None and reg.missing() == [1, 2]
    first, replaced = reg.register(register("b:50051"))
    assert (first.index, replaced) == (1, None)
    assert not reg.complete() and reg.shard_map() is None
    second, _ = reg.register(register(":50053"))
    assert second.index == 2 and reg.complete()
    assert reg.shard_map() == [
        pb.ShardAddress(index=0, address=""),
        pb.ShardAddress(index=1, address="b:50051"),
        pb.ShardAddress(index=2, address=":50053"),
    ]


def test_a_version_mismatch_names_both_versions() -> None:
    reg, _ = registry()
    refused = refusal(reg, register("b:50051", version="0.3.0"))
    assert refused.code is Code.FAILED_PRECONDITION
    assert "shard at 'b:50051' has version '0.3.0', the leader 0.4.0" in refused.message
    assert reg.registered() == []


def test_a_chunk_size_mismatch_names_the_flag_and_both_values() -> None:
    reg, _ = registry()
    refused = refusal(reg, register("b:50051", chunk_bytes=2 * CHUNK))
    assert refused.code is Code.FAILED_PRECONDITION
    assert "--chunk-mb 2 (2097152 bytes)" in refused.message
    assert "the leader --chunk-mb 1 (1048576 bytes)" in refused.message


def test_a_message_limit_below_the_leaders_chunks_is_refused() -> None:
    reg, _ = registry()
    refused = refusal(reg, register("b:50051", max_message_bytes=CHUNK))
    assert refused.code is Code.FAILED_PRECONDITION
    assert f"at most {CHUNK} bytes" in refused.message
    assert str(CHUNK + chunking.HEADER_SLACK_BYTES) in refused.message


def test_a_shard_without_an_address_is_refused() -> None:
    reg, _ = registry()
    assert refusal(reg, register("")).code is Code.INVALID_ARGUMENT


def test_one_shard_too_many_is_resource_exhausted() -> None:
    reg, _ = registry(2)
    reg.register(register("b:1"))
    refused = refusal(reg, register("c:1"))
    assert refused.code is Code.RESOURCE_EXHAUSTED
    assert "shard at 'c:1' is one shard too many" in refused.message
    assert "--shards 2" in refused.message and "1 at b:1" in refused.message


def test_a_registration_at_a_live_shards_address_is_refused_and_displaces_nothing() -> None:
    reg, clock = registry(3)
    reg.register(register("b:1"))
    live, _ = reg.register(register("c:1"))
    clock.now += reg.live_s - 0.5  # heard from just within the heartbeat timeout
    refused = refusal(reg, register("c:1"))
    assert refused.code is Code.ALREADY_EXISTS
    assert "shard 2" in refused.message and f"{reg.live_s:g}s of silence" in refused.message
    assert reg.get(2) is live and reg.heard(live) and reg.complete()


def test_a_registration_at_a_silent_shards_address_replaces_it_and_keeps_its_index() -> None:
    reg, clock = registry(3)
    reg.register(register("b:1"))
    old, _ = reg.register(register("c:1"))
    clock.now += reg.live_s + 0.1  # silent beyond the heartbeat timeout
    new, replaced = reg.register(register("c:1"))
    assert replaced is old and new.index == old.index == 2 and new.token != old.token
    assert reg.get(2) is new
    # The replaced registration's stream ending later must not remove its successor.
    assert not reg.remove(old) and not reg.heard(old)
    assert reg.complete()


def test_a_lost_shard_gets_its_index_back_even_if_a_newcomer_came_first() -> None:
    reg, _ = registry(3)
    first, _ = reg.register(register("b:1"))
    assert reg.remove(first)
    assert reg.missing() == [1, 2] and reg.last_address(1) == "b:1"
    newcomer, _ = reg.register(register("d:1"))
    assert newcomer.index == 2  # index 1 is kept for b:1, which workers may still know
    back, _ = reg.register(register("b:1"))
    assert back.index == 1 and reg.complete()


def test_a_newcomer_takes_a_remembered_index_when_no_other_is_free() -> None:
    reg, _ = registry(2)
    first, _ = reg.register(register("b:1"))
    reg.remove(first)
    other, _ = reg.register(register("c:1"))
    assert other.index == 1


def test_liveness_follows_the_last_message() -> None:
    reg, clock = registry(3)
    first, _ = reg.register(register("b:1"))
    second, _ = reg.register(register("c:1"))
    clock.now += 4
    assert reg.heard(second, pb.ShardStats(bytes_received=10))
    clock.now += 2
    assert [r.index for r in reg.silent(5.0)] == [1]
    assert reg.seconds_since_heard(first) == pytest.approx(6.0)
    assert reg.seconds_since_heard(second) == pytest.approx(2.0)
    assert second.stats.bytes_received == 10


def test_byte_totals_keep_growing_across_registrations() -> None:
    reg, _ = registry(2)
    first, _ = reg.register(register("b:1"))
    reg.heard(first, pb.ShardStats(bytes_received=100, bytes_sent=40))
    reg.heard(first, pb.ShardStats(bytes_received=150, bytes_sent=60))
    assert reg.totals(1) == (150, 60)
    reg.remove(first)
    again, _ = reg.register(register("b:1"))
    reg.heard(again, pb.ShardStats(bytes_received=30, bytes_sent=5))
    assert reg.totals(1) == (180, 65)


def test_the_missing_shards_are_described_with_count_flag_and_last_address() -> None:
    reg, clock = registry(3)
    assert "waiting for 2 of 2 shards (--shards 3)" in reg.describe_missing()
    first, _ = reg.register(register("b:1"))
    reg.register(register("c:1"))
    assert reg.describe_missing() == "all 2 shards are registered"
    clock.now += 12
    reg.remove(first)
    clock.now += 20
    line = reg.describe_missing()
    assert "waiting for 1 of 2 shards (--shards 3) for 20 s" in line
    assert "missing shard(s) 1 (was b:1)" in line and "registered: 2 at c:1" in line


def test_the_shard_count_must_be_positive() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        ShardRegistry(0, VERSION, CHUNK, FakeClock())


def test_a_port_only_address_is_shown_with_the_host_it_registered_from() -> None:
    reg, _ = registry(3)
    local, _ = reg.register(register(":50052"), peer_host="10.0.0.5")
    remote, _ = reg.register(register("c:50051"), peer_host="10.0.0.9")
    assert (local.shown_address, remote.shown_address) == ("10.0.0.5:50052", "c:50051")
    # Workers get the address as advertised: they complete ":port" themselves.
    assert [s.address for s in reg.shard_map() or []] == ["", ":50052", "c:50051"]
    reg.remove(local)
    assert reg.last_address(1) == "10.0.0.5:50052"
    assert "missing shard(s) 1 (was 10.0.0.5:50052)" in reg.describe_missing()


def test_a_loopback_address_from_another_host_is_refused_with_the_fix() -> None:
    reg, _ = registry()
    with pytest.raises(RegistrationRefused) as refused:
        reg.register(register("127.0.0.1:50051"), peer_host="10.0.0.5")
    assert refused.value.code is Code.FAILED_PRECONDITION
    assert "10.0.0.5" in refused.value.message and "--host" in refused.value.message
    # The same address from this host is fine (a shard next to its leader).
    record, _ = reg.register(register("127.0.0.1:50051"), peer_host="127.0.0.1")
    assert record.index == 1


def test_a_shard_without_its_own_chunk_size_follows_the_leaders() -> None:
    reg, _ = registry()
    record, _ = reg.register(register("b:50051", chunk_bytes=0))
    assert record.index == 1  # 0 = "whatever the leader uses": nothing to disagree with


@pytest.mark.parametrize("address", ["\nforged line", "b 1:2", "b:0", "b:x", "http://b:1", "b"])
def test_an_address_workers_could_not_dial_is_refused_quoted(address: str) -> None:
    reg, _ = registry(3)
    refused = refusal(reg, register(address))
    assert refused.code is Code.INVALID_ARGUMENT and "unusable address" in refused.message
    assert "\n" not in refused.message and reg.registered() == []
