"""A userspace delay line: one-way propagation delay on an emulated host's link, through a TUN.

The kernel the bench runs on has no ``sch_netem``, so latency cannot be a qdisc. Instead every
host namespace of a delayed :class:`~gradsync_bench.netns.Cluster` routes what it sends to the
cluster through a TUN device (``dly0``), and one process per host, this module's
:func:`serve`, reads each packet from the TUN, holds it for the path's one-way delay and writes
it back; the kernel then forwards it out ``eth0``, through the link's ``tbf``. The kernel's TCP
therefore sees the real round-trip time (its window, its retransmission timer, its slow start
all pay it), which a relay in userspace would hide.

Routing inside a host namespace (:func:`setup_commands`):

* the host's address sits on ``eth0`` without its prefix route (``noprefixroute``);
* the main table sends the cluster's subnet to ``dly0``, so everything the host sends to a
  peer enters the delay line;
* a policy rule sends packets arriving *from* ``dly0`` (the delay line's output) to a table
  of their own whose only route is the subnet on ``eth0``; the namespace forwards them
  (``ip_forward``), and accepts that their source is one of its own addresses
  (``accept_local``, no ``rp_filter``).

What arrives on ``eth0`` is delivered directly: the whole path delay is applied once, on the
sender's side, as the sender's uplink delay plus the receiver's downlink delay, looked up by
the packet's destination address. For fixed delays that is indistinguishable from delaying at
both ends, and it keeps one TUN and one process per host. Packets to one destination all wait
the same time, so they leave in the order they came (one FIFO per distinct delay).

The delay line holds at most ``limit_bytes`` (default: twice what the link carries during the
delay, see :func:`default_limit_bytes`); beyond that it drops the arriving packet, like a
router's buffer, so a sender that outruns the link sees loss, not an unbounded queue. The
link's rate stays with ``tbf`` on ``eth0`` and on the bridge port, whose byte-limited queue
is the bottleneck buffer TCP fills. The TUN releases each packet's socket memory as it takes
it, so the sender's TCP gets no backpressure from that ``tbf`` (TCP Small Queues): it acts as
a router on the path, not as the host's own NIC, and a sender that outruns it sees loss. With
BBR (this kernel's default) and the 20 ms queue, a 100 ms round trip at 100 Mbit/s has
retransmitted over a third of a stream's segments, against none without delay.

Cost: one 100 Mbit/s TCP stream (8 kpps of 1500-byte packets one way, 4 kpps of
acknowledgements back) took 10-13 % of a core in the sender's line and 26-32 % in the
receiver's (writing an acknowledgement back also runs the sender's TCP inside that write), on
a 2-vCPU machine under load; each line runs at a real-time priority where allowed, so its
timing does not depend on that load (round trips within 1 ms of the configured delays).

This file uses only the standard library and runs as a script
(``python netns_delay.py --tun dly0 --delay 10.213.0.3=50 ...``), so a host namespace needs
nothing importable to start one. It prints ``ready`` once it holds the TUN, a JSON line of
counters (packets, drops, peak bytes held, CPU time) on SIGUSR1, and again when it ends
(SIGTERM or SIGINT).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import fcntl
import ipaddress
import json
import math
import os
import select
import signal
import socket
import struct
import sys
import time
from collections.abc import Sequence
from types import FrameType

__all__ = [
    "TUN_IFNAME",
    "default_limit_bytes",
    "delay_script",
    "path_delays",
    "serve",
    "setup_commands",
]

#: Name of the delay line's TUN device inside every delayed host namespace.
TUN_IFNAME = "dly0"
#: The routing table (and rule preference) for packets leaving the delay line.
ROUTE_TABLE = "213"
RULE_PREF = "100"

_TUNSETIFF = 0x400454CA
_IFF_TUN = 0x0001
_IFF_NO_PI = 0x1000
# A packet cannot be larger than the TUN's MTU; 64 KiB covers any MTU.
_READ_SIZE = 65536
# Packets read per wakeup before releasing due ones again, so a flood cannot delay releases.
_READ_BATCH = 64
# With no rate limit the delay line assumes a link of this speed when sizing its buffer, and
# never holds more than _MAX_LIMIT_BYTES.
_UNLIMITED_BITS_PER_S = 10e9
# SCHED_FIFO priority of the delay line (1-99): above ordinary work, below the kernel's own.
_REALTIME_PRIORITY = 10
_MIN_LIMIT_BYTES = 1024 * 1024
_MAX_LIMIT_BYTES = 256 * 1024 * 1024


def default_limit_bytes(rate_mbit: float | None, delay_ms: float) -> int:
    """Bytes the delay line may hold: four times the bandwidth-delay product, at least 1 MiB.

    In steady state a link holds rate x delay bytes "on the wire". The delay line sits before
    the sender's ``tbf``, so it also receives the bursts a real sender would queue at its own
    NIC: a slow start sends at up to twice the ACK rate, and a sender's first window leaves at
    veth speed. Four times the product absorbs those, so the drops TCP sees come from the
    bottleneck's ``tbf`` queue, as on a real path; the limit only bounds a sender that
    outruns the link for longer.
    """
    bits_per_s = _UNLIMITED_BITS_PER_S if rate_mbit is None else rate_mbit * 1e6
    bdp = bits_per_s / 8 * delay_ms / 1000
    return int(min(_MAX_LIMIT_BYTES, max(_MIN_LIMIT_BYTES, math.ceil(4 * bdp))))


def path_delays(
    source: str, link_delays_ms: dict[str, float], addresses: dict[str, str]
) -> dict[str, float]:
    """One-way delay from ``source`` to every other host: its link's plus the peer's, by address.

    Args:
        source: The sending host.
        link_delays_ms: One-way delay of every host's link, in ms.
        addresses: Every host's IPv4 address.

    Returns:
        {peer address: milliseconds} for every host but ``source``.
    """
    return {
        addresses[peer]: link_delays_ms[source] + link_delays_ms[peer]
        for peer in addresses
        if peer != source
    }


def setup_commands(ns: str, address: str, subnet: str) -> list[list[str]]:
    """The commands that put a TUN delay line between host namespace ``ns`` and ``eth0``.

    Expects ``eth0`` up with ``address`` added ``noprefixroute`` (so no route of the kernel's
    competes with these); creates :data:`TUN_IFNAME`, routes the subnet through it, and
    forwards what comes out of it to ``eth0`` (see the module docstring).
    """
    ip = ["ip", "-n", ns]
    sysctl = ["ip", "netns", "exec", ns, "sysctl", "-q", "-w"]
    return [
        [*ip, "tuntap", "add", "dev", TUN_IFNAME, "mode", "tun"],
        [*ip, "link", "set", "dev", TUN_IFNAME, "addrgenmode", "none"],
        [*sysctl, "net.ipv4.ip_forward=1"],
        [*sysctl, "net.ipv4.conf.all.rp_filter=0"],
        [*sysctl, f"net.ipv4.conf.{TUN_IFNAME}.rp_filter=0"],
        [*sysctl, f"net.ipv4.conf.{TUN_IFNAME}.accept_local=1"],
        [*sysctl, f"net.ipv6.conf.{TUN_IFNAME}.disable_ipv6=1"],
        [*ip, "link", "set", "dev", TUN_IFNAME, "up"],
        [*ip, "route", "add", subnet, "dev", TUN_IFNAME, "src", address],
        [*ip, "route", "add", subnet, "dev", "eth0", "src", address, "table", ROUTE_TABLE],
        [*ip, "rule", "add", "pref", RULE_PREF, "iif", TUN_IFNAME, "lookup", ROUTE_TABLE],
    ]


def delay_script() -> str:
    """Path of this file, which runs as a script inside a host namespace (see ``main``)."""
    return os.path.abspath(__file__)


def open_tun(name: str) -> int:
    """Attach to the TUN device ``name`` of this namespace; a non-blocking fd of raw IP packets."""
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        fcntl.ioctl(fd, _TUNSETIFF, struct.pack("16sH", name.encode(), _IFF_TUN | _IFF_NO_PI))
    except OSError:
        os.close(fd)
        raise
    return fd


class _Stop(Exception):
    pass


def _raise_stop(signum: int, frame: FrameType | None) -> None:
    raise _Stop


def serve(
    fd: int,
    delays_s: dict[bytes, float],
    default_delay_s: float,
    limit_bytes: int,
    counters: dict[str, int],
    stop_fd: int | None = None,
) -> None:
    """Forward every packet read from ``fd`` back into it after its delay.

    Runs until ``stop_fd`` becomes readable (packets still held are dropped) or a signal
    handler raises.

    Args:
        fd: The TUN (or any non-blocking fd that reads and writes whole packets), non-blocking.
        delays_s: Delay by destination address (4 raw bytes).
        default_delay_s: Delay of packets to any other destination (and non-IPv4 ones).
        limit_bytes: Most bytes held at once; a packet that does not fit is dropped.
        counters: Updated in place: packets/bytes forwarded, packets dropped, write errors,
            peak bytes held.
        stop_fd: Optional; serve returns once it is readable.
    """
    watched = [fd] if stop_fd is None else [fd, stop_fd]
    queues: dict[float, collections.deque[tuple[float, bytes]]] = {}
    held = 0
    clock = time.monotonic
    while True:
        now = clock()
        wait: float | None = None
        for queue in queues.values():
            while queue and queue[0][0] <= now:
                _, packet = queue.popleft()
                held -= len(packet)
                try:
                    os.write(fd, packet)
                    counters["forwarded"] += 1
                    counters["forwarded_bytes"] += len(packet)
                except OSError:
                    counters["write_errors"] += 1
            if queue:
                due = queue[0][0] - now
                wait = due if wait is None or due < wait else wait
        readable, _, _ = select.select(watched, [], [], wait)
        if stop_fd is not None and stop_fd in readable:
            return
        if fd not in readable:
            continue
        now = clock()
        for _ in range(_READ_BATCH):
            try:
                packet = os.read(fd, _READ_SIZE)
            except BlockingIOError:
                break
            size = len(packet)
            if held + size > limit_bytes:
                counters["dropped"] += 1
                continue
            if size >= 20 and packet[0] >> 4 == 4:
                delay = delays_s.get(packet[16:20], default_delay_s)
            else:
                delay = default_delay_s
            fifo = queues.get(delay)
            if fifo is None:
                fifo = queues[delay] = collections.deque()
            fifo.append((now + delay, packet))
            held += size
            if held > counters["peak_held_bytes"]:
                counters["peak_held_bytes"] = held


def _delay_arg(text: str) -> tuple[bytes, float]:
    address, _, millis = text.partition("=")
    try:
        packed = socket.inet_aton(str(ipaddress.IPv4Address(address)))
        value = float(millis)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected ADDRESS=MS, got {text!r}: {exc}") from None
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"delay must be >= 0 ms, got {text!r}")
    return packed, value / 1000


def main(argv: Sequence[str] | None = None) -> int:
    """Run the delay line of this namespace's TUN until SIGTERM; print counters at the end."""
    parser = argparse.ArgumentParser(description="Userspace one-way delay line on a TUN device.")
    parser.add_argument("--tun", default=TUN_IFNAME, help="TUN device of this namespace")
    parser.add_argument(
        "--delay", type=_delay_arg, action="append", default=[], help="ADDRESS=MS (repeatable)"
    )
    parser.add_argument("--default-ms", type=float, default=0.0, help="delay to other addresses")
    parser.add_argument("--limit-bytes", type=int, required=True, help="most bytes held")
    args = parser.parse_args(argv)
    if args.limit_bytes <= 0:
        parser.error("--limit-bytes must be positive")
    signal.signal(signal.SIGTERM, _raise_stop)
    signal.signal(signal.SIGINT, _raise_stop)
    counters = dict.fromkeys(
        ("forwarded", "forwarded_bytes", "dropped", "write_errors", "peak_held_bytes"), 0
    )
    signal.signal(signal.SIGUSR1, lambda signum, frame: _report(counters))
    _realtime()
    try:
        fd = open_tun(args.tun)
        print("ready", flush=True)
        serve(fd, dict(args.delay), args.default_ms / 1000, args.limit_bytes, counters)
    except _Stop:
        pass
    _report(counters)
    return 0


def _realtime() -> None:
    """Run at a real-time priority when allowed: a link's delay must not wait for a busy CPU.

    A real path's propagation delay does not depend on the sender's CPU load; on a machine
    whose cores are shared with the training processes, an ordinary priority would add their
    scheduling delays to every packet. The kernel's real-time throttling still leaves the other
    processes a share of every second if a flood kept the delay line busy.
    """
    # Where it is not permitted, ordinary scheduling (and its jitter) remains.
    with contextlib.suppress(OSError, AttributeError):
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(_REALTIME_PRIORITY))


def _report(counters: dict[str, int]) -> None:
    cpu = os.times()
    print(json.dumps({**counters, "cpu_ms": round((cpu.user + cpu.system) * 1000)}), flush=True)


if __name__ == "__main__":
    sys.exit(main())
