"""The standby coordinator's pure parts: the address list, its rotation, the lease record
and the holder's deadline (no Redis, no sockets: the resolver and the clock are injected)."""

from __future__ import annotations

import re
import socket
from typing import Any

import pytest
from gradsync.config import ClientConfig
from gradsync_proto.net.addresses import AddressRotation, parse_addresses
from gradsync_server.store.lease import (
    LeaseError,
    LeaseRecord,
    LeaseTimer,
    SuspectWatch,
    must_demote,
    poll_interval_s,
    renew_interval_s,
    suspicion,
)


def _resolver(table: dict[str, list[tuple[int, str]]]) -> Any:
    """A getaddrinfo stand-in: host -> [(family, ip)]; unknown hosts fail as DNS does."""

    def resolve(host: str, port: int, *_: object) -> list[tuple[Any, ...]]:
        if host not in table:
            raise socket.gaierror(f"unknown host {host}")
        return [(family, socket.SOCK_STREAM, 6, "", (ip, port)) for family, ip in table[host]]

    return resolve


def test_parse_addresses_keeps_order_and_checks_each_entry() -> None:
    parsed = parse_addresses("a:50051,[::1]:6000,10.0.0.2:7")
    assert [str(address) for address in parsed] == ["a:50051", "[::1]:6000", "10.0.0.2:7"]
    assert [str(address) for address in parse_addresses("solo:1")] == ["solo:1"]
    with pytest.raises(ValueError, match="entry 2: address 'b' has no port"):
        parse_addresses("a:1,b")
    with pytest.raises(ValueError, match="empty entry at position 2"):
        parse_addresses("a:1,,b:2")
    with pytest.raises(ValueError, match="names a:1 twice"):
        parse_addresses("a:1,a:1")


def test_client_config_accepts_a_list_and_names_a_bad_entry() -> None:
    config = ClientConfig.resolve("a:1,b:2", rank=0, world_size=1, environ={})
    assert config.coordinator == "a:1,b:2"
    with pytest.raises(ValueError, match=r"GRADSYNC_COORDINATOR.*entry 2"):
        ClientConfig.resolve(None, rank=0, world_size=1, environ={"GRADSYNC_COORDINATOR": "a:1,x"})


def test_a_single_address_is_used_verbatim() -> None:
    # localhost is one host on two families: gRPC keeps resolving it itself, as before.
    table = {"localhost": [(socket.AF_INET6, "::1"), (socket.AF_INET, "127.0.0.1")]}
    rotation = AddressRotation("localhost:50051", resolver=_resolver(table))
    assert (rotation.current(), rotation.several) == ("localhost:50051", False)
    assert rotation.advance() == "localhost:50051"
    unresolved = AddressRotation("nowhere:9", resolver=_resolver({}))
    assert unresolved.current() == "nowhere:9"


def test_a_name_with_several_addresses_rotates_and_is_resolved_again() -> None:
    table = {"coord": [(socket.AF_INET, "10.0.0.1"), (socket.AF_INET, "10.0.0.2")]}
    rotation = AddressRotation("coord:50051", resolver=_resolver(table))
    assert rotation.several and rotation.count == 2
    assert rotation.current() == "10.0.0.1:50051"
    assert rotation.advance() == "10.0.0.2:50051"
    table["coord"] = [(socket.AF_INET, "10.0.0.3"), (socket.AF_INET, "10.0.0.2")]
    # After the last one the name is resolved again: the new host is tried first.
    assert rotation.advance() == "10.0.0.3:50051"


def test_a_list_rotates_in_order_and_wraps() -> None:
    rotation = AddressRotation("127.0.0.1:1,127.0.0.1:2", resolver=_resolver({}))
    seen = [rotation.current()] + [rotation.advance() for _ in range(3)]
    assert seen == ["127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:1", "127.0.0.1:2"]


def test_lease_record_round_trips_and_refuses_malformed_values() -> None:
    record = LeaseRecord(fence=7, holder="host-12-ab", address="10.0.0.1:50051")
    assert record.encode() == "7|host-12-ab|10.0.0.1:50051"
    assert LeaseRecord.decode(record.encode().encode()) == record
    for bad in ("7|a", "x|a|b", "0|a|b", "-1|a|b", "7|a|b|c", "7||b"):
        with pytest.raises(LeaseError):
            LeaseRecord.decode(bad)
    with pytest.raises(LeaseError, match=re.escape("free of '|'")):
        LeaseRecord(1, "a|b", "h:1")


def test_lease_timer_deadline_counts_from_the_send_time() -> None:
    now = [100.0]
    timer = LeaseTimer(3.0, clock=lambda: now[0])
    assert timer.expired()  # never held
    sent_at = timer.attempt()
    now[0] = 100.5  # Redis answered half a second later
    timer.renewed(sent_at)
    now[0] = 102.9
    assert not timer.expired()
    now[0] = 103.0
    assert timer.expired()
    assert timer.since_renewal_s() == pytest.approx(3.0)
    timer.lost()
    assert timer.expired() and timer.since_renewal_s() is None
    with pytest.raises(ValueError, match="positive"):
        LeaseTimer(float("nan"))


def test_must_demote_on_another_fence_holder_or_an_absent_key() -> None:
    ours = LeaseRecord(3, "a", "h:1")
    assert not must_demote(ours, LeaseRecord(3, "a", "h:1"))
    assert must_demote(ours, None)
    assert must_demote(ours, LeaseRecord(4, "b", "h:2"))
    assert must_demote(ours, LeaseRecord(3, "b", "h:2"))
    assert (renew_interval_s(3.0), poll_interval_s(3.0), poll_interval_s(1.2)) == (
        1.0,
        0.5,
        pytest.approx(0.2),
    )


def test_a_standby_wakes_just_after_the_deadline_and_polls_at_most_every_interval() -> None:
    from gradsync_server.store.lease import EXPIRY_MARGIN_S, poll_interval_s, standby_pause_s

    assert poll_interval_s(1.5) == 0.25
    assert standby_pause_s(1.5, 0.1) == pytest.approx(0.1 + EXPIRY_MARGIN_S)
    assert standby_pause_s(1.5, 1.2) == 0.25  # a renewal may come: look again meanwhile
    assert standby_pause_s(1.5, 0.0) == pytest.approx(EXPIRY_MARGIN_S)


def test_only_a_standby_that_came_up_under_another_holder_defers_the_takeover() -> None:
    from gradsync_server.store.lease import takeover_delay_s

    assert takeover_delay_s(1.5, watched_s=0.4, seen_held=True) == 0.25  # just restarted
    assert takeover_delay_s(1.5, watched_s=1.5, seen_held=True) == 0.0  # there all along
    assert takeover_delay_s(1.5, watched_s=0.0, seen_held=False) == 0.0  # first of a cluster


def test_a_lease_value_our_scripts_could_not_have_written_is_suspect() -> None:
    record, why = suspicion("3|coord-a|10.0.0.1:1", 1500, "3")
    assert record == LeaseRecord(3, "coord-a", "10.0.0.1:1") and why is None
    assert "no deadline" in str(suspicion("3|coord-a|10.0.0.1:1", -1, "3")[1])
    assert "fence 3 is not the last one issued (4)" in str(
        suspicion("3|coord-a|10.0.0.1:1", 1500, "4")[1]
    )
    assert "(none)" in str(suspicion("3|coord-a|10.0.0.1:1", 1500, "")[1])
    assert suspicion("garbage", 1500, "3") == (None, "it is not 'fence|holder|address'")


def test_a_suspect_value_expires_after_a_ttl_of_being_seen_unchanged() -> None:
    watch = SuspectWatch(ttl_s=3.0)
    assert watch.held_s("x", 10.0) is None
    assert watch.held_s("x", 12.9) is None
    assert watch.held_s("y", 13.5) is None  # another value: counted from now
    assert watch.held_s("y", 16.5) == 3.0
    watch.clear()
    assert watch.held_s("y", 17.0) is None
