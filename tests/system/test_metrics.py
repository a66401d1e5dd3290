"""Metrics: every exported name, type and label set; the /metrics HTTP endpoint; straggler
attribution (LagTracker); the workers' metrics-port rule; and a real Prometheus scraping a
coordinator's metrics."""

from __future__ import annotations

import math
import socket
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import prometheus_client
import pytest
from gradsync.config import ENV_LOCAL_RANK
from gradsync.metrics import ENV_METRICS_PORT, WorkerMetrics, resolve_metrics_port
from gradsync_proto.net.exposition import LATENCY_BUCKETS_S, serve_metrics
from gradsync_server.dataplane.observer import LagTracker
from gradsync_server.metrics import CoordinatorMetrics
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from support.promserver import NO_PROMETHEUS, PROMETHEUS, PrometheusServer

pytestmark = pytest.mark.timeout(60)

#: Exported family name -> (type, label names other than a histogram's `le`).
COORDINATOR_METRICS = {
    "gradsync_received_bytes_total": ("counter", set()),
    "gradsync_sent_bytes_total": ("counter", set()),
    "gradsync_chunks_received_total": ("counter", set()),
    "gradsync_buckets_completed_total": ("counter", set()),
    "gradsync_steps_completed_total": ("counter", set()),
    "gradsync_bucket_round_trip_seconds": ("histogram", set()),
    "gradsync_step_sync_seconds": ("histogram", set()),
    "gradsync_workers_alive": ("gauge", set()),
    "gradsync_membership_epoch": ("gauge", set()),
    "gradsync_current_step": ("gauge", set()),
    "gradsync_jobs": ("gauge", set()),
    "gradsync_rank_lag_seconds": ("histogram", {"rank"}),
    "gradsync_rejected_messages_total": ("counter", {"reason"}),
    "gradsync_step_aborts_total": ("counter", {"reason"}),
    "gradsync_errors_total": ("counter", {"kind"}),
    "gradsync_nonfinite_contributions_total": ("counter", {"rank"}),
    "gradsync_segment_bytes_total": ("counter", {"direction"}),
    "gradsync_failure_detect_seconds": ("histogram", set()),
    "gradsync_failure_recover_seconds": ("histogram", {"kind"}),
    "gradsync_restarts_total": ("counter", {"outcome"}),
    "gradsync_steps_recomputed_total": ("counter", set()),
    "gradsync_contribution_norm": ("gauge", {"rank"}),
    "gradsync_contribution_cosine": ("gauge", {"rank"}),
    "gradsync_contribution_flagged_total": ("counter", {"rank"}),
    "gradsync_contribution_excluded_total": ("counter", {"rank"}),
    "gradsync_round_window_seconds": ("gauge", set()),
    "gradsync_round_missed_total": ("counter", {"rank"}),
    "gradsync_collectives_total": ("counter", {"op"}),
    "gradsync_collective_bytes_total": ("counter", {"op", "direction"}),
}
WORKER_METRICS = {
    "gradsync_worker_exposed_comm_seconds": ("histogram", {"rank"}),
    "gradsync_worker_sent_bytes_total": ("counter", {"rank"}),
    "gradsync_worker_received_bytes_total": ("counter", {"rank"}),
    "gradsync_worker_bucket_latency_seconds": ("histogram", {"rank"}),
    "gradsync_worker_steps_total": ("counter", {"rank"}),
    "gradsync_worker_step_aborts_total": ("counter", {"rank", "reason"}),
    "gradsync_worker_local_reduce_seconds": ("histogram", {"rank"}),
    "gradsync_worker_host_sent_bytes_total": ("counter", {"rank"}),
    "gradsync_worker_local_group_size": ("gauge", {"rank"}),
}


def scrape(registry: CollectorRegistry) -> dict[str, tuple[str, set[str], dict[str, float]]]:
    """Parse the exposition text: family name -> (type, label names, {sample key: value}).

    Counter families are keyed with their `_total` suffix (the name a query uses). The
    `*_created` timestamps client_python adds beside counters and histograms are left out
    (the Dockerfile turns them off with PROMETHEUS_DISABLE_CREATED_SERIES).
    """
    families = {}
    for family in text_string_to_metric_families(generate_latest(registry).decode()):
        if family.name.endswith("_created"):
            continue
        name = family.name + "_total" if family.type == "counter" else family.name
        labels: set[str] = set()
        samples: dict[str, float] = {}
        for sample in family.samples:
            labels |= set(sample.labels) - {"le"}
            rendered = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
            samples[f"{sample.name}{{{rendered}}}"] = sample.value
        families[name] = (family.type, labels, samples)
    return families


def exercised_coordinator() -> CoordinatorMetrics:
    """A coordinator's metrics after two ranks synced one step of one 2-chunk bucket."""
    metrics = CoordinatorMetrics()
    metrics.set_membership(workers_alive=2, epoch=3, jobs=1)
    for _rank in (0, 1):
        metrics.observe_chunk(1000)
        metrics.observe_chunk(24)
    metrics.observe_bucket_arrival(0, 0.0)
    metrics.observe_bucket_arrival(1, 0.02)
    metrics.observe_bucket_done(round_trip_s=0.05, sent_bytes=2048)
    metrics.observe_step_done(sync_s=0.07, step=17)
    metrics.observe_rejection("INVALID_ARGUMENT")
    metrics.observe_abort("ABORTED")
    metrics.observe_error("RuntimeError")
    metrics.observe_segment_bytes("read", 4096)
    metrics.observe_nonfinite(1)
    metrics.observe_contribution(0, norm=1.5, cosine=0.9, flagged=False, excluded=False)
    metrics.observe_contribution(1, norm=150.0, cosine=-0.9, flagged=True, excluded=True)
    metrics.observe_round_window(2.5, missed=(1,))
    metrics.observe_collective("all_reduce_sum", received_bytes=2 * 96, sent_bytes=2 * 96)
    metrics.observe_collective("all_reduce_sum", received_bytes=2 * 96, sent_bytes=2 * 96)
    return metrics


def test_coordinator_exports_every_metric_with_its_type_labels_and_values() -> None:
    families = scrape(exercised_coordinator().registry)
    assert {name: (kind, labels) for name, (kind, labels, _) in families.items()} == (
        COORDINATOR_METRICS
    )
    values = {key: value for _, _, samples in families.values() for key, value in samples.items()}
    assert values["gradsync_received_bytes_total{}"] == 2048
    assert values["gradsync_chunks_received_total{}"] == 4
    assert values["gradsync_sent_bytes_total{}"] == 2048
    assert values["gradsync_buckets_completed_total{}"] == 1
    assert values["gradsync_steps_completed_total{}"] == 1
    assert values['gradsync_segment_bytes_total{direction="read"}'] == 4096
    assert values["gradsync_bucket_round_trip_seconds_sum{}"] == pytest.approx(0.05)
    assert values["gradsync_step_sync_seconds_count{}"] == 1
    assert values["gradsync_current_step{}"] == 17
    assert values["gradsync_workers_alive{}"] == 2
    assert values["gradsync_membership_epoch{}"] == 3
    assert values["gradsync_jobs{}"] == 1
    assert values['gradsync_contribution_norm{rank="1"}'] == 150.0
    assert values['gradsync_contribution_cosine{rank="0"}'] == pytest.approx(0.9)
    assert values['gradsync_contribution_flagged_total{rank="1"}'] == 1
    assert values['gradsync_contribution_excluded_total{rank="1"}'] == 1
    # An honest rank has no flagged or excluded series (the screen tests rely on it).
    assert 'gradsync_contribution_flagged_total{rank="0"}' not in values
    assert values["gradsync_round_window_seconds{}"] == 2.5
    assert values['gradsync_round_missed_total{rank="1"}'] == 1
    assert values['gradsync_collectives_total{op="all_reduce_sum"}'] == 2
    key = 'gradsync_collective_bytes_total{direction="received",op="all_reduce_sum"}'
    assert values[key] == 4 * 96
    assert values[key.replace("received", "sent")] == 4 * 96
    # The first rank observes 0: it is in the smallest bucket; rank 1's 20 ms is not.
    assert values['gradsync_rank_lag_seconds_bucket{le="0.001",rank="0"}'] == 1
    assert values['gradsync_rank_lag_seconds_bucket{le="0.01",rank="1"}'] == 0
    assert values['gradsync_rank_lag_seconds_bucket{le="0.025",rank="1"}'] == 1
    assert values['gradsync_rejected_messages_total{reason="INVALID_ARGUMENT"}'] == 1
    assert values['gradsync_step_aborts_total{reason="ABORTED"}'] == 1
    assert values['gradsync_errors_total{kind="RuntimeError"}'] == 1
    assert values['gradsync_nonfinite_contributions_total{rank="1"}'] == 1


def test_worker_exports_every_metric_with_its_rank_label() -> None:
    metrics = WorkerMetrics(rank=2)
    metrics.observe_exposed_comm(0.004)
    metrics.observe_sent(4096)
    metrics.observe_received(4096)
    metrics.observe_bucket_latency(0.03)
    metrics.observe_step_done()
    metrics.observe_abort("DEADLINE_EXCEEDED")
    metrics.observe_local_reduce(0.002)
    metrics.observe_host_sent(8192)
    metrics.set_local_group_size(4)
    families = scrape(metrics.registry)
    assert {name: (kind, labels) for name, (kind, labels, _) in families.items()} == (
        WORKER_METRICS
    )
    values = {key: value for _, _, samples in families.values() for key, value in samples.items()}
    assert values['gradsync_worker_sent_bytes_total{rank="2"}'] == 4096
    assert values['gradsync_worker_received_bytes_total{rank="2"}'] == 4096
    assert values['gradsync_worker_steps_total{rank="2"}'] == 1
    assert values['gradsync_worker_exposed_comm_seconds_count{rank="2"}'] == 1
    assert values['gradsync_worker_bucket_latency_seconds_sum{rank="2"}'] == pytest.approx(0.03)
    key = 'gradsync_worker_step_aborts_total{rank="2",reason="DEADLINE_EXCEEDED"}'
    assert values[key] == 1
    assert values['gradsync_worker_local_reduce_seconds_sum{rank="2"}'] == pytest.approx(0.002)
    assert values['gradsync_worker_host_sent_bytes_total{rank="2"}'] == 8192
    assert values['gradsync_worker_local_group_size{rank="2"}'] == 4
    with pytest.raises(ValueError, match="rank must be >= 0, got -1"):
        WorkerMetrics(rank=-1)


def test_latency_histograms_span_1ms_to_60s() -> None:
    families = scrape(exercised_coordinator().registry)
    for name in (
        "gradsync_bucket_round_trip_seconds",
        "gradsync_step_sync_seconds",
        "gradsync_rank_lag_seconds",
    ):
        bounds = sorted(
            {
                float(key.split('le="')[1].split('"')[0])
                for key in families[name][2]
                if 'le="' in key
            }
        )
        assert bounds[0] == 0.001 and bounds[-2] == 60.0 and math.isinf(bounds[-1]), name
    assert tuple(sorted(LATENCY_BUCKETS_S)) == LATENCY_BUCKETS_S


def test_registries_are_private_and_independent() -> None:
    first, second = CoordinatorMetrics(), CoordinatorMetrics()
    WorkerMetrics(rank=0), WorkerMetrics(rank=0)  # would raise "Duplicated timeseries" if shared
    first.observe_chunk(10)
    assert "gradsync_received_bytes_total 10.0" in generate_latest(first.registry).decode()
    assert "gradsync_received_bytes_total 0.0" in generate_latest(second.registry).decode()
    assert b"gradsync_" not in generate_latest(prometheus_client.REGISTRY)
    shared = CollectorRegistry()
    metrics = CoordinatorMetrics(registry=shared)
    assert metrics.registry is shared


def fetch(url: str) -> tuple[int, str, str]:
    with urllib.request.urlopen(url, timeout=5) as reply:
        return reply.status, reply.headers["Content-Type"], reply.read().decode()


def test_http_server_serves_metrics_on_a_free_port_and_closes() -> None:
    metrics = exercised_coordinator()
    with serve_metrics(0, metrics.registry, host="127.0.0.1") as server:
        assert server.port != 0
        assert server.url == f"http://127.0.0.1:{server.port}/metrics"
        status, content_type, body = fetch(server.url)
        assert status == 200
        assert content_type.startswith("text/plain")
        assert "gradsync_received_bytes_total 2048.0" in body
        assert 'gradsync_rank_lag_seconds_count{rank="1"} 1.0' in body
        metrics.observe_chunk(1)
        assert "gradsync_received_bytes_total 2049.0" in fetch(server.url)[2]
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", server.port), timeout=1).close()


def test_http_server_reports_a_port_in_use() -> None:
    with (
        serve_metrics(0, CollectorRegistry(), host="127.0.0.1") as server,
        pytest.raises(OSError, match=f"could not serve metrics on 127.0.0.1:{server.port}"),
    ):
        serve_metrics(server.port, CollectorRegistry(), host="127.0.0.1")
    with pytest.raises(ValueError, match=r"0\.\.65535"):
        serve_metrics(70000, CollectorRegistry())


# --- LagTracker: straggler attribution -------------------------------------------------------


def test_lag_tracker_means_over_a_window() -> None:
    tracker = LagTracker(window=3)
    assert tracker.mean_lag(0) is None and tracker.samples(0) == 0
    for lag in (0.0, 0.3, 0.6, 0.9):  # the first sample falls out of the window
        tracker.record(0, lag)
    assert tracker.samples(0) == 3
    assert tracker.mean_lag(0) == pytest.approx(0.6)


def test_lag_tracker_names_the_slowest_ranks_first_with_ties_by_rank() -> None:
    tracker = LagTracker(window=10)
    lags = {0: [0.0, 0.0], 1: [0.2, 0.4], 2: [0.5, 0.1], 3: [0.05, 0.05]}
    for rank in (3, 2, 1, 0):  # first-seen order must not matter
        for lag in lags[rank]:
            tracker.record(rank, lag)
    assert tracker.slowest(2) == [(1, pytest.approx(0.3)), (2, pytest.approx(0.3))]
    assert [rank for rank, _ in tracker.slowest(10)] == [1, 2, 3, 0]
    assert tracker.slowest(0) == []


def test_lag_tracker_persistently_behind_needs_enough_samples_and_forgives_recovery() -> None:
    tracker = LagTracker(window=4)
    # Rank 2 is always 200 ms late; rank 1 had one slow bucket (a GC pause).
    for _ in range(4):
        tracker.record(0, 0.0)
        tracker.record(2, 0.2)
    tracker.record(1, 1.5)
    assert tracker.persistently_behind(threshold_s=0.1, min_samples=3) == [2]
    assert tracker.persistently_behind(threshold_s=0.1, min_samples=1) == [1, 2]
    assert tracker.persistently_behind(threshold_s=0.2, min_samples=3) == []  # strictly above
    # Rank 2 recovers: after a window of on-time buckets it is no longer named.
    for _ in range(4):
        tracker.record(2, 0.0)
    assert tracker.persistently_behind(threshold_s=0.1, min_samples=3) == []
    tracker.forget(1)
    assert tracker.samples(1) == 0
    assert [rank for rank, _ in tracker.slowest(5)] == [0, 2]


def test_lag_tracker_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="window must be >= 1"):
        LagTracker(window=0)
    tracker = LagTracker(window=5)
    for bad in (-0.1, math.nan, math.inf):
        with pytest.raises(ValueError, match="rank 3: lag must be a finite number >= 0"):
            tracker.record(3, bad)
    with pytest.raises(ValueError, match=r"min_samples must be in 1\.\.5"):
        tracker.persistently_behind(0.1, min_samples=6)
    with pytest.raises(ValueError, match="k must be >= 0"):
        tracker.slowest(-1)


def test_coordinator_metrics_feed_the_lag_tracker() -> None:
    metrics = CoordinatorMetrics(lag_window=2)
    for lag in (0.0, 0.5, 0.7):
        metrics.observe_bucket_arrival(1, lag)
    metrics.observe_bucket_arrival(0, 0.0)
    assert metrics.lag_tracker.slowest(1) == [(1, pytest.approx(0.6))]
    metrics.lag_tracker.forget(1)
    assert metrics.lag_tracker.samples(1) == 0
    # The Prometheus series is cumulative and keeps all three observations.
    assert (
        'gradsync_rank_lag_seconds_count{rank="1"} 3.0'
        in generate_latest(metrics.registry).decode()
    )


# --- Metrics ports of workers sharing a host ----------------------------------------------------


@pytest.mark.parametrize(
    ("explicit", "environ", "expected"),
    [
        (None, {}, None),  # nothing set: metrics off
        (None, {ENV_METRICS_PORT: ""}, None),
        (None, {ENV_METRICS_PORT: "9100"}, 9100),  # one worker per host/container
        (None, {ENV_METRICS_PORT: "9100", ENV_LOCAL_RANK: "3"}, 9103),  # torchrun's 4th worker
        (9200, {ENV_METRICS_PORT: "9100", ENV_LOCAL_RANK: "1"}, 9201),  # the flag wins
        (None, {ENV_METRICS_PORT: "0", ENV_LOCAL_RANK: "2"}, 0),  # 0: each picks a free port
        (0, {}, 0),
    ],
)
def test_resolve_metrics_port(
    explicit: int | None, environ: dict[str, str], expected: int | None
) -> None:
    assert resolve_metrics_port(explicit, environ) == expected


@pytest.mark.parametrize(
    ("explicit", "environ", "message"),
    [
        (None, {ENV_METRICS_PORT: "http"}, "GRADSYNC_METRICS_PORT='http' is not an integer"),
        (None, {ENV_METRICS_PORT: "70000"}, r"must be in 0\.\.65535, got 70000"),
        (-1, {}, r"--metrics-port must be in 0\.\.65535, got -1"),
        (9100, {ENV_LOCAL_RANK: "x"}, "LOCAL_RANK='x' is not an integer"),
        (9100, {ENV_LOCAL_RANK: "-1"}, "LOCAL_RANK must be >= 0"),
        (65535, {ENV_LOCAL_RANK: "1"}, "65536 is past 65535"),
    ],
)
def test_resolve_metrics_port_rejects_bad_values(
    explicit: int | None, environ: dict[str, str], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        resolve_metrics_port(explicit, environ)


# --- A real Prometheus scraping a coordinator's metrics -----------------------------------------


@pytest.fixture
def prometheus_factory(tmp_path: Path) -> Iterator[type[PrometheusServer]]:
    """Start real Prometheus servers on demand; every one is stopped after the test."""
    if PROMETHEUS is None:
        pytest.skip(NO_PROMETHEUS)
    started: list[PrometheusServer] = []

    def start(targets: list[str]) -> PrometheusServer:
        server = PrometheusServer(tmp_path / f"prometheus{len(started)}", targets)
        started.append(server)
        return server

    yield start  # type: ignore[misc]
    for server in started:
        server.stop()


def test_real_prometheus_scrapes_coordinator_metrics(prometheus_factory) -> None:
    metrics = exercised_coordinator()
    for _ in range(4):  # three more buckets in which rank 1 arrives late
        metrics.observe_bucket_arrival(0, 0.0)
        metrics.observe_bucket_arrival(1, 0.3)
    with serve_metrics(0, metrics.registry, host="127.0.0.1") as exporter:
        prometheus = prometheus_factory([f"127.0.0.1:{exporter.port}"])
        prometheus.wait_for_value("gradsync_received_bytes_total", 2048, timeout_s=30)
        prometheus.wait_for_value('gradsync_rank_lag_seconds_count{rank="1"}', 5, timeout_s=10)
        assert prometheus.values('gradsync_rank_lag_seconds_bucket{rank="1",le="0.25"}')[0][1] == 1
        by_reason = prometheus.values("gradsync_rejected_messages_total")
        assert [(labels["reason"], value) for labels, value in by_reason] == [
            ("INVALID_ARGUMENT", 1)
        ]
        # What the dashboard asks: which rank is slow (a mean lag per rank).
        mean_lag = prometheus.values(
            "sum by (rank) (gradsync_rank_lag_seconds_sum) "
            "/ sum by (rank) (gradsync_rank_lag_seconds_count)"
        )
        assert {labels["rank"]: value for labels, value in mean_lag} == {
            "0": 0.0,
            "1": pytest.approx((0.02 + 4 * 0.3) / 5),
        }
