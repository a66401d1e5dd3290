"""Link shaping of the emulated cluster: :class:`LinkShape` and the ``tc`` qdiscs that enforce it.

Every emulated host's link gets a bandwidth (tc ``tbf``) and optionally a one-way latency (tc
``netem``). Choosing the qdisc parameters so that a single TCP stream really reaches the
configured rate, without bufferbloat, is a concern of its own, with its own reasoning about
burst and queue sizes; it lives here, as pure functions that only *build* ``tc`` command lines,
so it can be read and tested without root. :mod:`gradsync_bench.netns` runs the commands.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["UNSHAPED", "LinkShape", "netem_args", "shape_commands", "tbf_args"]

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
# netem holds packets in a queue counted in packets, and must hold everything in flight during
# the delay: rate * delay / (smallest full-size packet), with headroom. For unlimited links we
# assume the veth can do about 20 Gbit/s.
_NETEM_MIN_LIMIT = 1000
_UNLIMITED_BITS_PER_S = 20e9


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


def netem_args(delay_ms: float, rate_mbit: float | None) -> list[str]:
    """netem parameters for a fixed one-way delay; ``limit`` sized to the packets in flight."""
    bits_per_s = _UNLIMITED_BITS_PER_S if rate_mbit is None else rate_mbit * 1e6
    in_flight = bits_per_s / 8 * delay_ms / 1000 / 1500  # worst case: MTU-sized packets
    limit = max(_NETEM_MIN_LIMIT, math.ceil(2 * in_flight))
    return ["netem", "delay", f"{delay_ms:g}ms", "limit", str(limit)]


def shape_commands(tc: list[str], dev: str, shape: LinkShape) -> list[list[str]]:
    """The tc commands that install ``shape`` on the egress of ``dev``.

    With both a delay and a rate, netem is the root and tbf its child (the combination the
    netem documentation gives): packets first wait out the delay in netem's time-ordered
    queue, then pass the token bucket. The reverse nesting (netem under tbf) replaces tbf's
    byte-limited queue by netem's and makes tbf poll a queue whose head is not yet due.
    """
    root = [*tc, "qdisc", "replace", "dev", dev, "root", "handle", "1:"]
    if shape.delay_ms:
        commands = [[*root, *netem_args(shape.delay_ms, shape.rate_mbit)]]
        if shape.rate_mbit is not None:
            child = [*tc, "qdisc", "replace", "dev", dev, "parent", "1:1", "handle", "10:"]
            commands.append([*child, *tbf_args(shape.rate_mbit)])
        return commands
    if shape.rate_mbit is not None:
        return [[*root, *tbf_args(shape.rate_mbit)]]
    return []
