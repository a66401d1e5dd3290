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

__all__ = ["measure_throughput"]

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
