"""The userspace delay line holds each packet for its path's delay, in order, within its bound.

`serve` runs on a real datagram socket pair (an fd that, like a TUN, reads and writes whole
packets), so its timing, ordering and tail drop are checked without root; the system test
(tests/system/test_netns_delay.py) runs it on a real TUN between namespaces.
"""

from __future__ import annotations

import os
import socket
import struct
import threading
import time
from collections.abc import Iterator

import pytest
from gradsync_bench.netns_delay import (
    TUN_IFNAME,
    default_limit_bytes,
    path_delays,
    serve,
    setup_commands,
)

NEAR, FAR = "10.213.0.3", "10.213.0.4"
COUNTERS = ("forwarded", "forwarded_bytes", "dropped", "write_errors", "peak_held_bytes")


def ipv4_packet(destination: str, sequence: int, size: int = 100) -> bytes:
    """A minimal IPv4 header to `destination`, the sequence number, padding up to `size`."""
    header = bytes([0x45]) + bytes(15) + socket.inet_aton(destination)
    return header + struct.pack("!I", sequence) + bytes(size - 24)


class Line:
    """`serve` in a thread on one end of a datagram socket pair; the test holds the other."""

    def __init__(self, delays: dict[str, float], limit_bytes: int) -> None:
        self.outside, inside = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.inside = inside
        inside.setblocking(False)
        self.outside.settimeout(5.0)
        self.stop_read, self.stop_write = os.pipe()
        self.counters = dict.fromkeys(COUNTERS, 0)
        packed = {socket.inet_aton(address): seconds for address, seconds in delays.items()}
        self.thread = threading.Thread(
            target=serve,
            args=(inside.fileno(), packed, 0.0, limit_bytes, self.counters, self.stop_read),
        )
        self.thread.start()

    def send(self, packet: bytes) -> float:
        """Send `packet` into the line; return the time just before (the line's thread may
        read it and start its delay before `send` returns)."""
        at = time.monotonic()
        self.outside.send(packet)
        return at

    def receive(self) -> tuple[bytes, float]:
        return self.outside.recv(65536), time.monotonic()

    def stop(self) -> dict[str, int]:
        """Stops the line and returns its counters.

        The line counts a packet just after writing it, so a test that has received every
        packet must still wait for the thread before it reads the counters.
        """
        if self.thread.is_alive():
            os.write(self.stop_write, b"x")
            self.thread.join(timeout=5.0)
        if self.thread.is_alive():
            raise RuntimeError("the delay line did not stop within 5 s of its stop fd")
        return self.counters

    def close(self) -> None:
        try:
            self.stop()
        finally:
            for sock in (self.outside, self.inside):
                sock.close()
            os.close(self.stop_read)
            os.close(self.stop_write)


@pytest.fixture
def line() -> Iterator[Line]:
    made = Line({NEAR: 0.02, FAR: 0.08}, limit_bytes=1 << 20)
    yield made
    made.close()


@pytest.mark.timeout(30)
def test_each_packet_waits_its_destinations_delay(line: Line) -> None:
    sent = {NEAR: line.send(ipv4_packet(NEAR, 0)), FAR: line.send(ipv4_packet(FAR, 1))}
    arrivals = {}
    for _ in range(2):
        packet, at = line.receive()
        arrivals[socket.inet_ntoa(packet[16:20])] = at
    # The near packet, sent first, also leaves first; each waited at least its delay and not
    # much more (a loaded machine's scheduling may add some).
    assert 0.02 <= arrivals[NEAR] - sent[NEAR] < 0.06
    assert 0.08 <= arrivals[FAR] - sent[FAR] < 0.14
    assert line.stop()["forwarded"] == 2


@pytest.mark.timeout(30)
def test_packets_to_one_destination_keep_their_order(line: Line) -> None:
    for sequence in range(200):
        line.send(ipv4_packet(FAR if sequence % 3 else NEAR, sequence))
    received = [line.receive()[0] for _ in range(200)]
    for destination in (NEAR, FAR):
        order = [
            struct.unpack("!I", p[20:24])[0]
            for p in received
            if socket.inet_ntoa(p[16:20]) == destination
        ]
        assert order == sorted(order), f"packets to {destination} were reordered"
    counters = line.stop()
    assert counters["forwarded"] == 200
    assert counters["dropped"] == 0


@pytest.mark.timeout(30)
def test_a_full_line_drops_arriving_packets() -> None:
    line = Line({FAR: 0.3}, limit_bytes=3000)
    try:
        for sequence in range(3):  # 3 x 1400 bytes do not fit in 3000
            line.send(ipv4_packet(FAR, sequence, size=1400))
        kept = [struct.unpack("!I", line.receive()[0][20:24])[0] for _ in range(2)]
        line.outside.settimeout(0.5)
        with pytest.raises(TimeoutError):
            line.receive()
    finally:
        line.close()
    assert kept == [0, 1], "the tail (the last arrival) is what a full line drops"
    assert line.counters["dropped"] == 1
    assert line.counters["peak_held_bytes"] == 2800


def test_path_delay_is_the_senders_link_plus_the_receivers() -> None:
    addresses = {"coord": "10.0.0.2", "w0": "10.0.0.3", "w1": "10.0.0.4"}
    links = {"coord": 5.0, "w0": 25.0, "w1": 50.0}
    assert path_delays("w0", links, addresses) == {"10.0.0.2": 30.0, "10.0.0.4": 75.0}


def test_limit_is_four_bandwidth_delay_products_at_least_a_mebibyte() -> None:
    assert default_limit_bytes(100.0, 50.0) == 4 * 625_000  # 100 Mbit/s x 50 ms = 625 kB
    assert default_limit_bytes(1.0, 1.0) == 1 << 20
    assert default_limit_bytes(None, 10_000.0) == 256 << 20  # unlimited rate: capped


def test_setup_routes_the_subnet_through_the_tun_and_its_output_to_eth0() -> None:
    commands = [" ".join(argv) for argv in setup_commands("ns1", "10.0.0.3", "10.0.0.0/24")]
    assert f"ip -n ns1 route add 10.0.0.0/24 dev {TUN_IFNAME} src 10.0.0.3" in commands
    assert "ip -n ns1 route add 10.0.0.0/24 dev eth0 src 10.0.0.3 table 213" in commands
    assert f"ip -n ns1 rule add pref 100 iif {TUN_IFNAME} lookup 213" in commands
    assert f"ip netns exec ns1 sysctl -q -w net.ipv4.conf.{TUN_IFNAME}.accept_local=1" in commands
