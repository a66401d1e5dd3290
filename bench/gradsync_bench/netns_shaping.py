"""Link shaping of the emulated cluster: :class:`LinkShape` and the ``tc`` qdiscs that enforce it.

Every emulated host's link gets a bandwidth (tc ``tbf``) and optionally a one-way latency (a
userspace delay line on a TUN device, :mod:`gradsync_bench.netns_delay`: this kernel has no
``sch_netem``). Choosing the qdisc parameters so that a single TCP stream really reaches the
configured rate, without bufferbloat, is a concern of its own, with its own reasoning about
burst and queue sizes; it lives here, as pure functions that only *build* ``tc`` command lines,
so it can be read and tested without root. :mod:`gradsync_bench.netns` runs the commands.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["UNSHAPED", "LinkShape", "shape_commands", "tbf_args"]

# tbf sizing (see tbf_args). A GSO/TSO "super-packet" on a veth is up to 64 KiB; a bucket smaller
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
        delay_ms: One-way latency of each link in milliseconds (a TUN delay line per host,
            :mod:`gradsync_bench.netns_delay`); ``None`` adds none. Host to host crosses two
            links, so the one-way delay between hosts is ``2 * delay_ms`` and the round-trip
            time ``4 * delay_ms``. Needs ``/dev/net/tun`` (see :func:`delay_available`).
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


def tbf_args(rate_mbit: float) -> list[str]:
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


def shape_commands(tc: list[str], dev: str, shape: LinkShape) -> list[list[str]]:
    """The tc command that installs ``shape``'s rate on the egress of ``dev`` (none: unlimited).

    The delay is not a qdisc (see :mod:`gradsync_bench.netns_delay`); packets pass the delay
    line first and ``tbf`` after it, whose byte-limited queue is the path's bottleneck buffer.
    """
    if shape.rate_mbit is not None:
        root = [*tc, "qdisc", "replace", "dev", dev, "root", "handle", "1:"]
        return [[*root, *tbf_args(shape.rate_mbit)]]
    return []
