"""Link delay on emulated hosts: the kernel's TCP pays the real round trip through the TUN line.

Real namespaces, real TUN devices and the real delay line processes: an ICMP echo's round
trip is four link delays (the sender's up and the receiver's down link, each way), and one
TCP stream whose receive window is clamped moves a window per round trip, far below the
link's rate, while an unclamped one gets close to the rate. Skipped, with the reason, where
namespaces or TUN devices cannot be made (not root, no /dev/net/tun).
"""

from __future__ import annotations

import statistics

import pytest
from gradsync_bench.netns import Cluster
from gradsync_bench.netns_probe import delay_available
from gradsync_bench.netns_shaping import LinkShape
from gradsync_bench.netns_throughput import measure_rtt, measure_stream

RATE_MBIT = 100.0
LINK_DELAY_MS = 10.0  # host to host: 20 ms one way, 40 ms round trip
WINDOW_CLAMP = 65536


@pytest.fixture(autouse=True)
def _require_delay() -> None:
    ok, reason = delay_available()
    if not ok:
        pytest.skip(reason)


@pytest.mark.timeout(90)
def test_round_trip_and_window_bound_throughput() -> None:
    with Cluster(["a", "b"], LinkShape(rate_mbit=RATE_MBIT, delay_ms=LINK_DELAY_MS)) as cluster:
        rtts = measure_rtt(cluster, "a", "b", count=11)[1:]  # the first also waits for ARP
        clamped, window = measure_stream(cluster, "a", "b", 2.0, 5301, WINDOW_CLAMP)
        open_mbit, _ = measure_stream(cluster, "a", "b", 3.0, 5302)
        used = {host: cluster.delay_line_counters(host) for host in ("a", "b")}
        lines = list(cluster.delay_lines.values())
    assert all(line.poll() is not None for line in lines), "a delay line outlived its cluster"
    expected_rtt_ms = 4 * LINK_DELAY_MS
    median = statistics.median(rtts)
    # Serialization of a 100-byte echo at 100 Mbit/s is microseconds; the line's timer and a
    # loaded machine's scheduling add a little, never less than the delay.
    assert expected_rtt_ms <= min(rtts), rtts
    assert median <= expected_rtt_ms + 2.0, rtts
    # The delay lines carried the traffic: the data one way, the acknowledgements back.
    for host, counters in used.items():
        assert counters["forwarded"] > 1000, (host, counters)
    assert used["a"]["forwarded_bytes"] > 20e6 / 8, used["a"]
    # The receiver's clamp shows as the window the sender's kernel saw (Linux advertises up
    # to about twice the clamp); the stream then moves one window per round trip.
    assert 0 < window <= 4 * WINDOW_CLAMP, window
    bound_mbit = window * 8 / (median / 1000) / 1e6
    assert bound_mbit < 0.5 * RATE_MBIT
    assert 0.6 * bound_mbit <= clamped <= 1.15 * bound_mbit, (clamped, bound_mbit, window)
    # Without the clamp the same path carries several times more: the round trip, not the
    # link, was the limit.
    assert open_mbit >= max(2 * clamped, 0.5 * RATE_MBIT), (open_mbit, clamped)
