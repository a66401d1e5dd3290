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
  ``rate_mbit`` each, like a full-duplex NIC, plus an optional one-way ``delay_ms``.

Typical use::

    with Cluster(["coord", "w0", "w1"], LinkShape(rate_mbit=1000)) as cluster:
        server = cluster.popen("coord", [sys.executable, "-m", "gradsync.cli", "serve", ...])
        address = cluster.address("coord")  # e.g. "10.213.0.2"
        ...

Everything needs root (CAP_NET_ADMIN and the right to mount ``/run/netns``); call
:func:`available` first and skip when it says no. ``python -m gradsync.bench.netns --check`` is a
self-test that measures TCP throughput between two emulated hosts.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import ipaddress
import json
import math
import os
import re
import secrets
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache
from types import FrameType, TracebackType
from typing import Any

__all__ = [
    "Cluster",
    "LinkShape",
    "NetnsError",
    "available",
    "delay_available",
    "measure_throughput",
]

#: Linux limits interface names to IFNAMSIZ - 1 = 15 bytes.
MAX_IFNAME = 15
#: Upper bound for every `ip`/`tc` call; they normally take milliseconds, so hitting this means
#: the kernel or a lock is wedged, and failing loudly beats hanging a test run.
COMMAND_TIMEOUT_S = 10.0
#: How long :meth:`Cluster.close` waits after SIGTERM before it sends SIGKILL.
TERMINATE_GRACE_S = 3.0
#: Name of the host-side interface inside every namespace (namespaces isolate names, so all
#: hosts can use the same, familiar one).
HOST_IFNAME = "eth0"

# tbf sizing (see _tbf_args). A GSO/TSO "super-packet" on a veth is up to 64 KiB; a bucket smaller
# than one of those makes tbf split every such packet in software, which costs CPU and rate.
_MIN_BURST_BYTES = 128 * 1024
# The tc-tbf manual asks for burst >= rate / HZ, so that one timer tick's worth of tokens fits
# in the bucket; 4 ms covers CONFIG_HZ=250 (the common minimum) and is harmless with HZ=1000.
_BURST_SECONDS = 0.004
# Queue allowed to build up behind the bucket, as time at the configured rate: enough that
# TCP's bursts (and several senders converging on one downlink) are absorbed instead of
# dropped, small enough that the queue does not add noticeable latency (bufferbloat).
_QUEUE_SECONDS = 0.020
_MIN_QUEUE_BYTES = 4 * 64 * 1024
# netem holds packets in a queue counted in packets, and must hold everything in flight during
# the delay: rate * delay / (smallest full-size packet), with headroom. For unlimited links we
# assume the veth can do about 20 Gbit/s.
_NETEM_MIN_LIMIT = 1000
_UNLIMITED_BITS_PER_S = 20e9

_HOST_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,31}$")
_PREFIX = re.compile(r"^[a-z][a-z0-9]{0,7}$")


class NetnsError(RuntimeError):
    """An ``ip``/``tc`` (or other) command failed; carries the command and its stderr.

    The message always names the exact command line and what it printed, because "RTNETLINK
    answers: File exists" alone says nothing about which of a few dozen setup steps failed.
    """

    def __init__(
        self, argv: Sequence[str], returncode: int | None, stderr: str, what: str = ""
    ) -> None:
        self.argv = list(argv)
        self.returncode = returncode
        self.stderr = stderr
        if not what:
            what = f"failed with exit code {returncode}"
        detail = stderr.strip() or "(no stderr)"
        super().__init__(f"command `{shlex.join(self.argv)}` {what}: {detail}")


def _text(data: str | bytes | None) -> str:
    if data is None:
        return ""
    if isinstance(data, bytes):
        return data.decode(errors="replace")
    return data


def _run(argv: Sequence[str], *, timeout: float = COMMAND_TIMEOUT_S) -> str:
    """Run one command to completion and return its stdout; raise NetnsError on any failure."""
    try:
        done = subprocess.run(
            list(argv), capture_output=True, text=True, timeout=timeout, check=False
        )
    except subprocess.TimeoutExpired as exc:
        raise NetnsError(argv, None, _text(exc.stderr), f"timed out after {timeout:g} s") from exc
    except OSError as exc:
        raise NetnsError(argv, None, str(exc), "could not be started") from exc
    if done.returncode != 0:
        raise NetnsError(argv, done.returncode, done.stderr)
    return done.stdout


def _ip(*args: str) -> str:
    """Run ``ip ARGS...`` (see :func:`_run`)."""
    return _run(["ip", *args])


def _netns_exists(name: str) -> bool:
    """Whether namespace ``name`` exists; True when that cannot be told (so teardown reports)."""
    try:
        listing = _ip("netns", "list")
    except NetnsError:
        return True
    return any(line.split()[0] == name for line in listing.splitlines() if line.strip())


def _link_exists(name: str) -> bool:
    """Whether root-namespace interface ``name`` exists; True when that cannot be told."""
    try:
        shown = subprocess.run(
            ["ip", "link", "show", "dev", name],
            capture_output=True,
            timeout=COMMAND_TIMEOUT_S,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return True
    return shown.returncode == 0


@dataclass(frozen=True)
class LinkShape:
    """Bandwidth and latency of every host's link, applied in both directions.

    The shaping is installed on the egress of *both* ends of each host's veth: the namespace
    end limits what the host sends (uplink), the bridge end limits what it receives (downlink).
    Traffic between two hosts therefore crosses two shaped links, the sender's uplink and the
    receiver's downlink, exactly as through a switch: a single stream gets ``rate_mbit``, and
    two hosts sending to a third share that third host's downlink.

    Attributes:
        rate_mbit: Bandwidth per direction in Mbit/s (tc ``tbf``); ``None`` leaves the veth
            unlimited (several Gbit/s, bounded by CPU).
        delay_ms: One-way latency of each link in milliseconds (tc ``netem``); ``None`` adds
            none. Host to host crosses two links, so the one-way delay between hosts is
            ``2 * delay_ms`` and the round-trip time ``4 * delay_ms``. Needs a kernel with
            ``sch_netem`` (see :func:`delay_available`).
    """

    rate_mbit: float | None = None
    delay_ms: float | None = None

    def __post_init__(self) -> None:
        if self.rate_mbit is not None and not (
            math.isfinite(self.rate_mbit) and self.rate_mbit > 0
        ):
            raise ValueError(f"rate_mbit must be a positive number or None, not {self.rate_mbit}")
        if self.delay_ms is not None and not (math.isfinite(self.delay_ms) and self.delay_ms >= 0):
            raise ValueError(f"delay_ms must be >= 0 or None, not {self.delay_ms}")


#: The default shape: no limits (named so it can be a default argument value).
UNSHAPED = LinkShape()


def _tbf_args(rate_mbit: float) -> list[str]:
    """tbf parameters that let one TCP stream reach close to ``rate_mbit``.

    * ``burst`` (bucket size) is max(128 KiB, 4 ms at the rate). It has to hold a whole 64 KiB
      GSO packet, or tbf segments each one in software; and at least one timer tick (1/HZ, 4 ms
      at HZ=250) of tokens, or a coarse timer caps the achievable rate below the configured one.
      A bigger bucket would only allow longer line-rate bursts after idle periods.
    * ``limit`` (bytes queued behind the bucket) is burst + max(20 ms at the rate, 256 KiB):
      with a tiny queue TCP's bursts overflow it and every drop halves the congestion window,
      so a single stream stays well below the rate; with a huge one latency balloons.
    """
    rate_bytes_per_s = rate_mbit * 1e6 / 8
    burst = max(_MIN_BURST_BYTES, math.ceil(rate_bytes_per_s * _BURST_SECONDS))
    limit = burst + max(_MIN_QUEUE_BYTES, math.ceil(rate_bytes_per_s * _QUEUE_SECONDS))
    rate_bit = max(1, round(rate_mbit * 1e6))
    return ["tbf", "rate", f"{rate_bit}bit", "burst", str(burst), "limit", str(limit)]


def _netem_args(delay_ms: float, rate_mbit: float | None) -> list[str]:
    """netem parameters for a fixed one-way delay; ``limit`` sized to the packets in flight."""
    bits_per_s = _UNLIMITED_BITS_PER_S if rate_mbit is None else rate_mbit * 1e6
    in_flight = bits_per_s / 8 * delay_ms / 1000 / 1500  # worst case: MTU-sized packets
    limit = max(_NETEM_MIN_LIMIT, math.ceil(2 * in_flight))
    return ["netem", "delay", f"{delay_ms:g}ms", "limit", str(limit)]


def _shape_commands(tc: list[str], dev: str, shape: LinkShape) -> list[list[str]]:
    """The tc commands that install ``shape`` on the egress of ``dev``.

    With both a delay and a rate, netem is the root and tbf its child (the combination the
    netem documentation gives): packets first wait out the delay in netem's time-ordered
    queue, then pass the token bucket. The reverse nesting (netem under tbf) replaces tbf's
    byte-limited queue by netem's and makes tbf poll a queue whose head is not yet due.
    """
    root = [*tc, "qdisc", "replace", "dev", dev, "root", "handle", "1:"]
    if shape.delay_ms:
        commands = [[*root, *_netem_args(shape.delay_ms, shape.rate_mbit)]]
        if shape.rate_mbit is not None:
            child = [*tc, "qdisc", "replace", "dev", dev, "parent", "1:1", "handle", "10:"]
            commands.append([*child, *_tbf_args(shape.rate_mbit)])
        return commands
    if shape.rate_mbit is not None:
        return [[*root, *_tbf_args(shape.rate_mbit)]]
    return []


class Cluster:
    """A set of emulated hosts on a private, shaped switch; a context manager.

    Entering builds the namespaces, the bridge and the veths; leaving (also through an
    exception, and at interpreter exit if ``close`` was never reached) kills the processes
    started with :meth:`popen` and deletes everything that was created, and nothing else.

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
        _ip("link", "add", br, "type", "bridge", *nf_off)
        self._created_links.append(br)
        _ip("link", "set", "dev", br, "addrgenmode", "none")
        _ip("link", "set", "dev", br, "up")
        prefix_len = str(self.subnet.prefixlen)
        for host in self.hosts:
            ns, port = self.netns(host), self.bridge_port(host)
            _ip("netns", "add", ns)
            self._created_netns.append(ns)
            # Creating the peer directly inside the namespace avoids a second, temporary name
            # in the root namespace that could collide.
            _ip("link", "add", port, "type", "veth", "peer", "name", HOST_IFNAME, "netns", ns)
            self._created_links.append(port)
            _ip("link", "set", "dev", port, "addrgenmode", "none")
            _ip("link", "set", "dev", port, "master", br)
            _ip("link", "set", "dev", port, "up")
            _ip("-n", ns, "link", "set", "dev", "lo", "up")
            _ip("-n", ns, "link", "set", "dev", HOST_IFNAME, "addrgenmode", "none")
            _ip("-n", ns, "addr", "add", f"{self.address(host)}/{prefix_len}", "dev", HOST_IFNAME)
            _ip("-n", ns, "link", "set", "dev", HOST_IFNAME, "up")
            # No default route is added: the only route in the namespace is the connected
            # subnet, so nothing a host sends can leave the cluster.
            for command in _shape_commands(["tc", "-n", ns], HOST_IFNAME, self.shape):
                _run_tc(command)
            for command in _shape_commands(["tc"], port, self.shape):
                _run_tc(command)

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
                _ip("link", "del", "dev", link)
            except NetnsError as exc:
                if _link_exists(link):
                    errors.append(str(exc))
        self._created_links.clear()
        for ns in reversed(self._created_netns):
            try:
                _ip("netns", "del", ns)
            except NetnsError as exc:
                if _netns_exists(ns):
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

    def set_link(self, host: str, up: bool) -> None:
        """Cut (``up=False``) or restore one host's link, e.g. for partition tests.

        The switch-side end is set down, which is what pulling the cable does: the host keeps
        its address, routes and sockets (``eth0`` just loses carrier), packets to and from it
        vanish, so peers see timeouts rather than immediate errors; after ``up=True``
        established TCP connections recover by retransmission.
        """
        _ip("link", "set", "dev", self.bridge_port(host), "up" if up else "down")


def _signal(process: subprocess.Popen[Any], signum: int, group: bool) -> None:
    try:
        if group:
            os.killpg(process.pid, signum)
        else:
            process.send_signal(signum)
    except ProcessLookupError:
        pass


def _run_tc(argv: list[str]) -> None:
    """Run a tc command, explaining the most likely cause of "unknown qdisc"."""
    try:
        _run(argv)
    except NetnsError as exc:
        if "qdisc kind is unknown" in exc.stderr:
            kind = "netem" if "netem" in argv else "tbf"
            exc.add_note(f"this kernel lacks the {kind} qdisc (CONFIG_NET_SCH_{kind.upper()})")
        raise


# -- capability probe ----------------------------------------------------------------------


@dataclass(frozen=True)
class _Probe:
    ok: bool
    reason: str
    netem: bool


@cache
def _probe() -> _Probe:
    """Try every kernel feature a Cluster needs once, on throwaway objects, and clean up."""
    if not sys.platform.startswith("linux"):
        return _Probe(False, f"network namespaces need Linux, this is {sys.platform}", False)
    if os.geteuid() != 0:
        return _Probe(False, "network namespaces need root (CAP_NET_ADMIN)", False)
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return _Probe(False, "iproute2 is not installed (no `ip` or `tc` command)", False)
    tag = "gp" + secrets.token_hex(3)
    ns, bridge, port = f"{tag}-probe", f"{tag}br", f"{tag}v0"
    created: list[list[str]] = []
    try:
        _ip("netns", "add", ns)
        created.append(["ip", "netns", "del", ns])
        _ip("link", "add", bridge, "type", "bridge")
        created.append(["ip", "link", "del", "dev", bridge])
        _ip("link", "add", port, "type", "veth", "peer", "name", HOST_IFNAME, "netns", ns)
        created.append(["ip", "link", "del", "dev", port])
        _ip("link", "set", "dev", port, "master", bridge)
        _run(["tc", "qdisc", "replace", "dev", port, "root", *_tbf_args(100)])
        try:
            _run(["tc", "qdisc", "replace", "dev", port, "root", *_netem_args(1, None)])
            netem = True
        except NetnsError:
            netem = False
        return _Probe(True, "", netem)
    except NetnsError as exc:
        return _Probe(False, f"cannot build an emulated cluster: {exc}", False)
    finally:
        for argv in reversed(created):
            with contextlib.suppress(NetnsError):
                _run(argv)


def available() -> tuple[bool, str]:
    """Whether clusters can be built here: ``(True, "")`` or ``(False, reason)``.

    Besides root it really creates (and removes) a namespace, a bridge, a veth and a tbf
    qdisc, because containers and minimal kernels often lack one of them even for root;
    tests use the reason in their skip message. The answer is cached per process.
    """
    probe = _probe()
    return probe.ok, probe.reason


def delay_available() -> tuple[bool, str]:
    """Like :func:`available`, and also that the kernel has netem for ``LinkShape.delay_ms``."""
    probe = _probe()
    if not probe.ok:
        return False, probe.reason
    if not probe.netem:
        return False, "this kernel lacks the netem qdisc (CONFIG_NET_SCH_NETEM), so no delay"
    return True, ""


# -- throughput measurement ---------------------------------------------------------------

# Kept as source text run with `python -c`, so the measuring processes need nothing importable
# inside the namespace (no cwd or PYTHONPATH assumptions).
_RECEIVER = """
import json, socket, sys, time
srv = socket.create_server((sys.argv[1], int(sys.argv[2])))
srv.settimeout(float(sys.argv[3]))
conn, _ = srv.accept()
conn.settimeout(float(sys.argv[3]))
buf = bytearray(1 << 20)
first = last = None
total = 0
while True:
    n = conn.recv_into(buf)
    if not n:
        break
    now = time.monotonic()
    if first is None:
        first = now  # time from the end of the first read: excludes connection setup
    else:
        total += n
    last = now
print(json.dumps({"bytes": total, "seconds": (last - first) if first is not None else 0.0}))
"""

_SENDER = """
import socket, sys, time
host, port, seconds = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
give_up = time.monotonic() + 10
while True:  # the receiver may not be listening yet
    try:
        sock = socket.create_connection((host, port), timeout=2)
        break
    except (ConnectionRefusedError, TimeoutError):
        if time.monotonic() > give_up:
            raise
        time.sleep(0.05)
sock.settimeout(seconds + 10)
chunk = b"\\0" * (256 * 1024)
stop = time.monotonic() + seconds
while time.monotonic() < stop:
    sock.sendall(chunk)
sock.close()
"""


def measure_throughput(
    cluster: Cluster, src: str, dst: str, seconds: float = 1.5, port: int = 5201
) -> float:
    """Single-stream TCP throughput from ``src`` to ``dst`` in Mbit/s (payload only).

    A tiny Python sender/receiver pair rather than iperf, so nothing beyond Python is needed.
    The receiver times from its first read to EOF, which leaves out connection setup. Payload
    goodput is ~3-5 % below the configured link rate because tbf also counts TCP/IP/Ethernet
    headers.
    """
    deadline = seconds + 20
    target = [cluster.address(dst), str(port)]
    recv_args = [*target, str(deadline)]
    send_args = [*target, str(seconds)]
    # For error messages: the command lines with the scripts abbreviated.
    recv_shown = cluster.command(dst, [sys.executable, "-c", "<receiver>", *recv_args])
    send_shown = cluster.command(src, [sys.executable, "-c", "<sender>", *send_args])
    pipes: dict[str, Any] = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True}
    receiver = cluster.popen(dst, [sys.executable, "-c", _RECEIVER, *recv_args], **pipes)
    sender = cluster.popen(src, [sys.executable, "-c", _SENDER, *send_args], **pipes)
    try:
        _, send_err = sender.communicate(timeout=deadline)
    except subprocess.TimeoutExpired as exc:
        raise NetnsError(send_shown, None, "", f"timed out after {deadline:g} s") from exc
    if sender.returncode != 0:
        receiver.kill()  # it would wait for a connection until its own deadline
        receiver.communicate()
        raise NetnsError(send_shown, sender.returncode, send_err)
    try:
        out, recv_err = receiver.communicate(timeout=deadline)
    except subprocess.TimeoutExpired as exc:
        raise NetnsError(recv_shown, None, "", f"timed out after {deadline:g} s") from exc
    if receiver.returncode != 0:
        raise NetnsError(recv_shown, receiver.returncode, recv_err)
    result: dict[str, float] = json.loads(out)
    if result["seconds"] <= 0:
        raise NetnsError(recv_shown, 0, f"receiver measured nothing: {out}")
    return float(result["bytes"]) * 8 / result["seconds"] / 1e6


# -- command line -------------------------------------------------------------------------


def _raise_system_exit(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    """`python -m gradsync.bench.netns`: build a cluster, then measure (--check) or hold it."""
    parser = argparse.ArgumentParser(
        prog="python -m gradsync.bench.netns",
        description="Emulate a cluster of hosts with network namespaces (needs root).",
    )
    parser.add_argument("--hosts", type=int, default=2, help="number of hosts (default 2)")
    parser.add_argument("--rate-mbit", type=float, default=None, help="link rate per direction")
    parser.add_argument("--delay-ms", type=float, default=None, help="one-way delay per link")
    parser.add_argument("--subnet", default="10.213.0.0/24")
    parser.add_argument("--seconds", type=float, default=2.0, help="measurement length")
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
        measured = measure_throughput(cluster, hosts[0], hosts[1], seconds=args.seconds)
        configured = "unlimited" if args.rate_mbit is None else f"{args.rate_mbit:g} Mbit/s"
        ratio = "" if args.rate_mbit is None else f" ({measured / args.rate_mbit:.0%})"
        print(
            f"TCP {hosts[0]} -> {hosts[1]}: configured {configured}, "
            f"measured {measured:.1f} Mbit/s{ratio}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
