"""Emulate a cluster of hosts on one Linux machine with network namespaces.

Benchmarks and multi-host tests of gradsync need several "machines" whose traffic really crosses
a network with a finite bandwidth (and optionally latency), and which can be partitioned from each
other. Loopback is useless for that: it is effectively infinitely fast and cannot be cut for one
host only. This module builds such a cluster out of kernel primitives, without Docker or VMs:

* every host is a network namespace (its own interfaces, routes, ports and ``lo``);
* it is plugged into a private Linux bridge in the root namespace through a veth pair
  (``eth0`` inside the host, ``<prefix>v<i>`` on the bridge); the bridge has no address, so
  the hosts reach each other and nothing else, and the root namespace stays untouched;
* ``tc`` shapes both ends of every veth, so each host has an uplink and a downlink of
  ``rate_mbit`` each, like a full-duplex NIC, plus an optional one-way ``delay_ms`` per link,
  which a userspace delay line adds (a TUN device and one process per host: this kernel has
  no ``sch_netem``).

Typical use::

    with Cluster(["coord", "w0", "w1"], LinkShape(rate_mbit=1000)) as cluster:
        server = cluster.popen("coord", [sys.executable, "-m", "gradsync.cli", "serve", ...])
        address = cluster.address("coord")  # e.g. "10.213.0.2"
        ...

Everything needs root (CAP_NET_ADMIN and the right to mount ``/run/netns``); call
:func:`gradsync_bench.netns_probe.available` first and skip when it says no.
``python -m gradsync_bench.netns --check`` is a self-test that measures TCP throughput between
two emulated hosts.

This module holds the topology and its lifecycle (namespaces, bridge, veths, the processes run
on the hosts, teardown) and the command line. Its parts with a concern of their own live beside
it: :mod:`~gradsync_bench.netns_commands` (running ``ip``/``tc``, :class:`NetnsError`),
:mod:`~gradsync_bench.netns_shaping` (:class:`LinkShape` and the qdisc parameters),
:mod:`~gradsync_bench.netns_delay` (the delay line and its routing),
:mod:`~gradsync_bench.netns_probe` (whether clusters can be built here) and
:mod:`~gradsync_bench.netns_throughput` (measuring a link: throughput, round trip).
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import ipaddress
import json
import os
import re
import secrets
import select
import shlex
import signal
import statistics
import subprocess
import sys
import time
from types import FrameType, TracebackType
from typing import Any

from gradsync_bench.netns_commands import (
    COMMAND_TIMEOUT_S,
    HOST_IFNAME,
    MAX_IFNAME,
    NetnsError,
    link_exists,
    netns_exists,
    run_command,
    run_ip,
    run_tc,
)
from gradsync_bench.netns_delay import (
    default_limit_bytes,
    delay_script,
    path_delays,
    setup_commands,
)
from gradsync_bench.netns_probe import available
from gradsync_bench.netns_shaping import UNSHAPED, LinkShape, shape_commands
from gradsync_bench.netns_throughput import measure_rtt, measure_stream

__all__ = ["Cluster"]

#: How long :meth:`Cluster.close` waits after SIGTERM before it sends SIGKILL.
TERMINATE_GRACE_S = 3.0
#: How long a host's delay line may take to start (a Python interpreter, no imports).
DELAY_LINE_START_S = 20.0

_HOST_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,31}$")
_PREFIX = re.compile(r"^[a-z][a-z0-9]{0,7}$")


class Cluster:
    """A set of emulated hosts on a private, shaped switch; a context manager.

    Entering builds the namespaces, the bridge and the veths; leaving (also through an
    exception, and at interpreter exit if ``close`` was never reached) kills the processes
    started with :meth:`popen` (the delay lines among them) and deletes everything that was
    created, and nothing else.

    All names start with a per-cluster prefix (random by default, 24 bits), so two clusters, or
    the leftovers of a crashed run, do not collide: a leftover only occupies its own names, and
    a new cluster draws a different prefix. Teardown cannot run if the process is SIGKILLed;
    such leftovers are the namespaces ``gn??????-<host>`` and links ``gn??????br``/``v<i>``
    (``ip netns del NAME``, ``ip link del NAME`` remove them).

    Args:
        host_names: Distinct names for the hosts (letters, digits, ``_.-``); the order decides
            the addresses: the first host gets the subnet's second address, and so on (the
            first is left free, as if for a gateway, which there deliberately is not).
        shape: Bandwidth/latency of every host link; see :class:`LinkShape`.
        prefix: Prefix of the namespace, bridge and veth names (1-8 lowercase letters and
            digits, starting with a letter); default ``"gn"`` plus 6 random hex digits.
        subnet: Private IPv4 subnet the hosts' addresses come from. Only the hosts use it,
            inside their namespaces, so it may even overlap a real network of the machine.
    """

    def __init__(
        self,
        host_names: list[str],
        shape: LinkShape = UNSHAPED,
        prefix: str | None = None,
        subnet: str = "10.213.0.0/24",
    ) -> None:
        if not host_names:
            raise ValueError("a cluster needs at least one host")
        for host in host_names:
            if not _HOST_NAME.match(host):
                raise ValueError(f"bad host name {host!r}: use 1-32 letters, digits, '_', '.', '-'")
        if len(set(host_names)) != len(host_names):
            raise ValueError(f"host names must be distinct: {host_names}")
        if prefix is None:
            prefix = "gn" + secrets.token_hex(3)
        if not _PREFIX.match(prefix):
            raise ValueError(
                f"bad prefix {prefix!r}: use 1-8 lowercase letters/digits, starting with a letter"
            )
        network = ipaddress.IPv4Network(subnet, strict=True)
        if not network.is_private:
            raise ValueError(f"subnet {subnet} is not a private range")
        usable = list(network.hosts())[1:]  # skip the first, conventional gateway address
        if len(usable) < len(host_names):
            raise ValueError(f"subnet {subnet} has room for only {len(usable)} hosts")

        self.hosts: tuple[str, ...] = tuple(host_names)
        self.shape = shape
        self.prefix = prefix
        self.subnet = network
        self.bridge = f"{prefix}br"
        self._index = {host: i for i, host in enumerate(host_names)}
        self._addresses = {host: str(usable[i]) for i, host in enumerate(host_names)}
        for name in (self.bridge, *(self.bridge_port(host) for host in host_names)):
            if len(name) > MAX_IFNAME:
                raise ValueError(f"interface name {name!r} is longer than {MAX_IFNAME} chars")

        # What this object created, so teardown removes exactly that and never someone else's.
        self._created_netns: list[str] = []
        self._created_links: list[str] = []
        self._processes: list[tuple[subprocess.Popen[Any], bool]] = []
        #: The delay line process of every host, when the shape has a delay.
        self.delay_lines: dict[str, subprocess.Popen[str]] = {}
        self._atexit_registered = False

    # -- names and addresses -------------------------------------------------------------

    def netns(self, host: str) -> str:
        """Name of the host's network namespace (usable with ``ip -n`` / ``ip netns exec``)."""
        return f"{self.prefix}-{self.hosts[self._host_index(host)]}"

    def bridge_port(self, host: str) -> str:
        """Name of the root-namespace end of the host's veth (the switch port)."""
        return f"{self.prefix}v{self._host_index(host)}"

    def address(self, host: str) -> str:
        """The host's private IPv4 address, e.g. ``"10.213.0.2"``."""
        self._host_index(host)
        return self._addresses[host]

    @property
    def names(self) -> tuple[str, ...]:
        """Every namespace and root-namespace interface name this cluster uses."""
        return (
            *(self.netns(h) for h in self.hosts),
            self.bridge,
            *(self.bridge_port(h) for h in self.hosts),
        )

    def _host_index(self, host: str) -> int:
        try:
            return self._index[host]
        except KeyError:
            raise KeyError(f"unknown host {host!r}; hosts are {list(self.hosts)}") from None

    # -- lifecycle -----------------------------------------------------------------------

    def __enter__(self) -> Cluster:
        """Build the cluster; on any failure, undo what was built before re-raising."""
        if not self._atexit_registered:
            # Exceptions (KeyboardInterrupt included) unwind through __exit__; this also covers
            # a Cluster entered by hand whose close() is never reached before the interpreter
            # exits. Kernel objects outlive the process, so leaking them is never harmless.
            atexit.register(self.close)
            self._atexit_registered = True
        try:
            self._build()
        except BaseException as exc:
            try:
                self.close()
            except NetnsError as cleanup_error:
                exc.add_note(f"cleanup after the failed setup also failed: {cleanup_error}")
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        """Tear down; a teardown error never hides the body's exception (it becomes a note)."""
        try:
            self.close()
        except NetnsError as cleanup_error:
            if exc is None:
                raise
            exc.add_note(f"cluster teardown also failed: {cleanup_error}")

    def _build(self) -> None:
        br = self.bridge
        # nf_call_*=0: bridged frames must not go through the machine's iptables (a Docker-style
        # FORWARD DROP policy would silently cut the hosts off); addrgenmode none: the bridge and
        # the switch ports get no IPv6 link-local address either, so the root namespace has no
        # presence at all on the cluster network.
        nf_off = ["nf_call_iptables", "0", "nf_call_ip6tables", "0", "nf_call_arptables", "0"]
        run_ip("link", "add", br, "type", "bridge", *nf_off)
        self._created_links.append(br)
        run_ip("link", "set", "dev", br, "addrgenmode", "none")
        run_ip("link", "set", "dev", br, "up")
        prefix_len = str(self.subnet.prefixlen)
        for host in self.hosts:
            ns, port = self.netns(host), self.bridge_port(host)
            run_ip("netns", "add", ns)
            self._created_netns.append(ns)
            # Creating the peer directly inside the namespace avoids a second, temporary name
            # in the root namespace that could collide.
            run_ip("link", "add", port, "type", "veth", "peer", "name", HOST_IFNAME, "netns", ns)
            self._created_links.append(port)
            run_ip("link", "set", "dev", port, "addrgenmode", "none")
            run_ip("link", "set", "dev", port, "master", br)
            run_ip("link", "set", "dev", port, "up")
            run_ip("-n", ns, "link", "set", "dev", "lo", "up")
            run_ip("-n", ns, "link", "set", "dev", HOST_IFNAME, "addrgenmode", "none")
            # With a delay line, the subnet's routes are its own (see netns_delay).
            no_route = ["noprefixroute"] if self.shape.delay_ms else []
            address = f"{self.address(host)}/{prefix_len}"
            run_ip("-n", ns, "addr", "add", address, "dev", HOST_IFNAME, *no_route)
            run_ip("-n", ns, "link", "set", "dev", HOST_IFNAME, "up")
            # No default route is added: the only route in the namespace is the connected
            # subnet, so nothing a host sends can leave the cluster.
            for command in shape_commands(["tc", "-n", ns], HOST_IFNAME, self.shape):
                run_tc(command)
            for command in shape_commands(["tc"], port, self.shape):
                run_tc(command)
        if self.shape.delay_ms:
            for host in self.hosts:
                self._start_delay_line(host)

    def _start_delay_line(self, host: str) -> None:
        """Route ``host``'s traffic through a TUN delay line and start its process."""
        ns = self.netns(host)
        for argv in setup_commands(ns, self.address(host), str(self.subnet)):
            run_command(argv)
        link_ms = dict.fromkeys(self.hosts, float(self.shape.delay_ms or 0.0))
        delays = path_delays(host, link_ms, self._addresses)
        limit = default_limit_bytes(self.shape.rate_mbit, max(delays.values(), default=0.0))
        argv = [
            *(sys.executable, "-I", delay_script(), "--limit-bytes", str(limit)),
            *(f"--delay={address}={ms:g}" for address, ms in delays.items()),
        ]
        process = self.popen(host, argv, stdout=subprocess.PIPE, text=True)
        self.delay_lines[host] = process
        line = ""
        if process.stdout is not None:
            ready, _, _ = select.select([process.stdout], [], [], DELAY_LINE_START_S)
            line = process.stdout.readline().strip() if ready else ""
        if line != "ready":
            raise NetnsError(
                self.command(host, argv),
                process.poll(),
                line,
                f"did not report ready within {DELAY_LINE_START_S:g} s",
            )

    def delay_line_counters(self, host: str) -> dict[str, int]:
        """The counters of ``host``'s delay line: packets forwarded and dropped, CPU time, ...

        Raises:
            NetnsError: The cluster has no delay, or the delay line did not answer in time.
        """
        process = self.delay_lines.get(host)
        if process is None or process.stdout is None:
            raise NetnsError(["delay line", host], None, "", "does not exist (no delay_ms)")
        process.send_signal(signal.SIGUSR1)
        ready, _, _ = select.select([process.stdout], [], [], DELAY_LINE_START_S)
        line = process.stdout.readline() if ready else ""
        try:
            counters: dict[str, int] = json.loads(line)
        except json.JSONDecodeError:
            raise NetnsError(
                ["delay line", host], process.poll(), line, "gave no counters"
            ) from None
        return counters

    def close(self) -> None:
        """Kill leftover processes and delete what this cluster created; idempotent.

        Every step is attempted even if an earlier one fails; the failures are reported
        together at the end as one NetnsError.
        """
        errors: list[str] = []
        self._stop_processes()
        # Deleting the switch-side veth deletes its peer inside the namespace synchronously
        # (deleting the namespace alone would do it later, from a kernel work queue).
        for link in reversed(self._created_links):
            try:
                run_ip("link", "del", "dev", link)
            except NetnsError as exc:
                if link_exists(link):
                    errors.append(str(exc))
        self._created_links.clear()
        for ns in reversed(self._created_netns):
            try:
                run_ip("netns", "del", ns)
            except NetnsError as exc:
                if netns_exists(ns):
                    errors.append(str(exc))
        self._created_netns.clear()
        if self._atexit_registered:
            atexit.unregister(self.close)
            self._atexit_registered = False
        if errors:
            raise NetnsError(["teardown"], None, "\n".join(errors), "had failures")

    # -- running things on hosts -----------------------------------------------------------

    def command(self, host: str, argv: list[str]) -> list[str]:
        """``argv`` wrapped to run inside the host's namespace (for any process launcher)."""
        return ["ip", "netns", "exec", self.netns(host), *argv]

    def popen(self, host: str, argv: list[str], **kwargs: Any) -> subprocess.Popen[Any]:
        """Start ``argv`` inside the host's namespace; keyword arguments go to ``Popen``.

        ``ip netns exec`` execs the command, so the returned process *is* the command (its
        signals and exit code are the command's). Unless the caller decides otherwise, it
        gets its own session (``start_new_session=True``), so that teardown can signal its
        whole process group, children included, and a Ctrl-C in the terminal reaches only
        the controlling script, which then tears down in order.
        """
        kwargs.setdefault("start_new_session", True)
        process: subprocess.Popen[Any] = subprocess.Popen(self.command(host, argv), **kwargs)
        self._processes.append((process, bool(kwargs["start_new_session"])))
        return process

    def _stop_processes(self) -> None:
        """SIGTERM whatever :meth:`popen` started and still runs, then SIGKILL stragglers.

        Signals go to the process group when the process got its own session, so its children
        die with it; a group whose leader already exited is not chased (its id may be reused).
        """
        running = [(p, group) for p, group in self._processes if p.poll() is None]
        for process, group in running:
            _signal(process, signal.SIGTERM, group)
        deadline = time.monotonic() + TERMINATE_GRACE_S
        for process, group in running:
            try:
                process.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _signal(process, signal.SIGKILL, group)
                # If even SIGKILL does not end it (D state), there is nothing more to do.
                with contextlib.suppress(subprocess.TimeoutExpired):
                    process.wait(timeout=COMMAND_TIMEOUT_S)
        for process, _ in self._processes:
            for stream in (process.stdin, process.stdout, process.stderr):
                if stream is not None:
                    stream.close()
        self._processes.clear()
        self.delay_lines.clear()

    def set_link(self, host: str, up: bool) -> None:
        """Cut (``up=False``) or restore one host's link, e.g. for partition tests.

        The switch-side end is set down, which is what pulling the cable does: the host keeps
        its address, routes and sockets (``eth0`` just loses carrier), packets to and from it
        vanish, so peers see timeouts rather than immediate errors; after ``up=True``
        established TCP connections recover by retransmission.
        """
        run_ip("link", "set", "dev", self.bridge_port(host), "up" if up else "down")


def _signal(process: subprocess.Popen[Any], signum: int, group: bool) -> None:
    try:
        if group:
            os.killpg(process.pid, signum)
        else:
            process.send_signal(signum)
    except ProcessLookupError:
        pass


def _raise_system_exit(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    """`python -m gradsync_bench.netns`: build a cluster, then measure (--check) or hold it."""
    parser = argparse.ArgumentParser(
        prog="python -m gradsync_bench.netns",
        description="Emulate a cluster of hosts with network namespaces (needs root).",
    )
    parser.add_argument("--hosts", type=int, default=2, help="number of hosts (default 2)")
    parser.add_argument("--rate-mbit", type=float, default=None, help="link rate per direction")
    parser.add_argument("--delay-ms", type=float, default=None, help="one-way delay per link")
    parser.add_argument("--subnet", default="10.213.0.0/24")
    parser.add_argument("--seconds", type=float, default=2.0, help="measurement length")
    parser.add_argument(
        "--window-clamp",
        type=int,
        default=0,
        help="with --check and --delay-ms: also measure a stream whose receiver clamps its "
        "window to this many bytes (TCP_WINDOW_CLAMP), against window / round trip",
    )
    parser.add_argument(
        "--check",
        action="store_true",
        help="measure TCP throughput between the first two hosts, then tear down "
        "(default: print the layout and hold the cluster until Ctrl-C)",
    )
    args = parser.parse_args(argv)
    if args.hosts < 1 or (args.check and args.hosts < 2):
        parser.error("--hosts must be >= 1 (>= 2 with --check)")
    ok, reason = available()
    if not ok:
        print(f"netns: not available: {reason}", file=sys.stderr)
        return 2
    # SIGTERM would otherwise end the process without unwinding `with`, leaking the cluster.
    signal.signal(signal.SIGTERM, _raise_system_exit)
    shape = LinkShape(rate_mbit=args.rate_mbit, delay_ms=args.delay_ms)
    hosts = [f"h{i}" for i in range(args.hosts)]
    with Cluster(hosts, shape, subnet=args.subnet) as cluster:
        for host in hosts:
            print(f"{host}: {cluster.address(host)}  ({shlex.join(cluster.command(host, []))})")
        if not args.check:
            print("holding the cluster; Ctrl-C tears it down", flush=True)
            with contextlib.suppress(KeyboardInterrupt):
                signal.pause()
            return 0
        _check(cluster, hosts[0], hosts[1], args)
    return 0


def _check(cluster: Cluster, src: str, dst: str, args: argparse.Namespace) -> None:
    """Print the echo round trip (with a delay), one stream's throughput and, with
    --window-clamp, a window-clamped stream's against window / round trip."""
    rtt_ms = None
    if args.delay_ms:
        rtts = measure_rtt(cluster, src, dst, count=21)[1:]  # the first also waits for ARP
        rtt_ms = statistics.median(rtts)
        print(
            f"echo {src} -> {dst}: round trip median {rtt_ms:.2f} ms (min {min(rtts):.2f}, "
            f"max {max(rtts):.2f}; expected {4 * args.delay_ms:g} = 4 x {args.delay_ms:g} ms)"
        )
    before = {h: cluster.delay_line_counters(h) for h in (src, dst) if h in cluster.delay_lines}
    began = time.monotonic()
    measured, _ = measure_stream(cluster, src, dst, seconds=args.seconds)
    elapsed = time.monotonic() - began
    configured = "unlimited" if args.rate_mbit is None else f"{args.rate_mbit:g} Mbit/s"
    ratio = "" if args.rate_mbit is None else f" ({measured / args.rate_mbit:.0%})"
    print(f"TCP {src} -> {dst}: configured {configured}, measured {measured:.1f} Mbit/s{ratio}")
    for host, first in before.items():
        now = cluster.delay_line_counters(host)
        packets = now["forwarded"] - first["forwarded"]
        cpu_ms = now["cpu_ms"] - first["cpu_ms"]
        print(
            f"  delay line of {host}: {packets} packets ({packets / elapsed / 1e3:.1f} kpps), "
            f"{now['dropped'] - first['dropped']} dropped, peak {now['peak_held_bytes']} bytes "
            f"held, CPU {cpu_ms} ms ({cpu_ms / 10 / elapsed:.0f} % of a core)"
        )
    if args.window_clamp and rtt_ms is not None:
        clamped, window = measure_stream(
            cluster, src, dst, seconds=args.seconds, port=5202, window_clamp=args.window_clamp
        )
        bound = window * 8 / (rtt_ms / 1000) / 1e6
        if args.rate_mbit is not None:
            bound = min(bound, args.rate_mbit)
        print(
            f"TCP {src} -> {dst}, receive window clamped to {args.window_clamp} bytes "
            f"(advertised {window}): {clamped:.2f} Mbit/s; min(rate, window / round trip) "
            f"{bound:.2f} Mbit/s; ratio {clamped / bound:.2f}"
        )


if __name__ == "__main__":
    sys.exit(main())
