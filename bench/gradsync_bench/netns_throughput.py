"""Measure single-stream TCP throughput between two hosts of an emulated cluster.

This is the measuring side of the emulated network: it checks that a shaped link delivers what
:class:`~gradsync_bench.netns_shaping.LinkShape` promises (``python -m gradsync_bench.netns
--check``, and the netns tests). It is separate from :mod:`gradsync_bench.netns` because it is a
client of a built cluster (it only starts processes on its hosts), not part of building or
tearing one down; the cluster module imports it only for its command line.
"""

from __future__ import annotations

import json
import subprocess
import sys
from typing import TYPE_CHECKING, Any

from gradsync_bench.netns_commands import NetnsError

if TYPE_CHECKING:
    from gradsync_bench.netns import Cluster

__all__ = ["measure_rtt", "measure_stream", "measure_throughput"]

# Kept as source text run with `python -c`, so the measuring processes need nothing importable
# inside the namespace (no cwd or PYTHONPATH assumptions).
_RECEIVER = """
import json, socket, sys, time
srv = socket.create_server((sys.argv[1], int(sys.argv[2])))
clamp = int(sys.argv[4])
if clamp:
    srv.setsockopt(socket.IPPROTO_TCP, socket.TCP_WINDOW_CLAMP, clamp)
srv.settimeout(float(sys.argv[3]))
conn, _ = srv.accept()
if clamp:
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_WINDOW_CLAMP, clamp)
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
# The window the receiver last advertised: struct tcp_info's tcpi_snd_wnd (Linux >= 6.2).
info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 256)
print(int.from_bytes(info[228:232], "little") if len(info) >= 232 else 0)
sock.close()
"""


_PINGER = """
import json, os, socket, struct, sys, time
dst, count, interval = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
SO_TIMESTAMPNS = 35  # Linux: the kernel's receive time of each packet, as a timespec
try:  # be scheduled at once when the reply is due, like the delay lines themselves
    os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(10))
except OSError:
    pass
sock = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP)
sock.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPNS, 1)
sock.settimeout(5.0)
ident = os.getpid() & 0xFFFF
def checksum(data):
    total = sum(struct.unpack(f"!{len(data) // 2}H", data))
    total = (total >> 16) + (total & 0xFFFF)
    return ~(total + (total >> 16)) & 0xFFFF
rtts = []
for seq in range(count):
    payload = b"gradsync-rtt" * 4
    header = struct.pack("!BBHHH", 8, 0, 0, ident, seq)
    packet = struct.pack("!BBHHH", 8, 0, checksum(header + payload), ident, seq) + payload
    sent = time.time_ns()
    sock.sendto(packet, (dst, 0))
    while True:
        reply, ancillary, _, _ = sock.recvmsg(2048, 64)
        icmp = reply[(reply[0] & 0x0F) * 4:]
        if icmp[0] == 0 and struct.unpack("!HH", icmp[4:8]) == (ident, seq):
            break
    received = time.time_ns()
    for level, kind, data in ancillary:
        if level == socket.SOL_SOCKET and kind == SO_TIMESTAMPNS:
            seconds, nanos = struct.unpack("qq", data[:16])
            received = seconds * 10**9 + nanos
    rtts.append((received - sent) / 1e6)
    time.sleep(interval)
print(json.dumps(rtts))
"""


def measure_rtt(
    cluster: Cluster, src: str, dst: str, count: int = 10, interval_s: float = 0.1
) -> list[float]:
    """Round-trip times of ``count`` ICMP echoes from ``src`` to ``dst``, in ms (like ping).

    A raw socket in a small Python script, so no ``ping`` binary is needed (the namespaces run
    as root). Each echo waits for its reply (5 s at most) before the next is sent. The reply's
    time is the kernel's receive timestamp (``SO_TIMESTAMPNS``) and the script runs at a
    real-time priority where allowed, so a busy machine's scheduling delays do not count.
    """
    argv = [dst_address := cluster.address(dst), str(count), str(interval_s)]
    shown = cluster.command(src, [sys.executable, "-c", "<pinger>", *argv])
    deadline = count * (interval_s + 5.0) + 10.0
    pinger = cluster.popen(
        src,
        [sys.executable, "-c", _PINGER, *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        out, err = pinger.communicate(timeout=deadline)
    except subprocess.TimeoutExpired as exc:
        raise NetnsError(shown, None, "", f"timed out after {deadline:g} s") from exc
    if pinger.returncode != 0:
        raise NetnsError(shown, pinger.returncode, err, f"(echo to {dst_address}) failed")
    rtts: list[float] = json.loads(out)
    return rtts


def measure_throughput(
    cluster: Cluster,
    src: str,
    dst: str,
    seconds: float = 1.5,
    port: int = 5201,
    window_clamp: int = 0,
) -> float:
    """Single-stream TCP throughput from ``src`` to ``dst`` in Mbit/s (payload only).

    A tiny Python sender/receiver pair rather than iperf, so nothing beyond Python is needed.
    The receiver times from its first read to EOF, which leaves out connection setup. Payload
    goodput is ~3-5 % below the configured link rate because tbf also counts TCP/IP/Ethernet
    headers. ``window_clamp`` (bytes, 0: none) caps the receiver's advertised window
    (``TCP_WINDOW_CLAMP``), which bounds the stream to about window / round-trip time.
    """
    return measure_stream(cluster, src, dst, seconds, port, window_clamp)[0]


def measure_stream(
    cluster: Cluster,
    src: str,
    dst: str,
    seconds: float = 1.5,
    port: int = 5201,
    window_clamp: int = 0,
) -> tuple[float, int]:
    """Like :func:`measure_throughput`, and the receive window the sender saw at its end.

    Returns:
        (Mbit/s of payload, the receiver's last advertised window in bytes as the sender's
        kernel reports it, ``tcpi_snd_wnd``; 0 where the kernel does not report it).
    """
    deadline = seconds + 20
    target = [cluster.address(dst), str(port)]
    recv_args = [*target, str(deadline), str(window_clamp)]
    send_args = [*target, str(seconds)]
    # For error messages: the command lines with the scripts abbreviated.
    recv_shown = cluster.command(dst, [sys.executable, "-c", "<receiver>", *recv_args])
    send_shown = cluster.command(src, [sys.executable, "-c", "<sender>", *send_args])
    pipes: dict[str, Any] = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True}
    receiver = cluster.popen(dst, [sys.executable, "-c", _RECEIVER, *recv_args], **pipes)
    sender = cluster.popen(src, [sys.executable, "-c", _SENDER, *send_args], **pipes)
    try:
        send_out, send_err = sender.communicate(timeout=deadline)
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
    window = int(send_out.strip() or 0)
    return float(result["bytes"]) * 8 / result["seconds"] / 1e6, window
