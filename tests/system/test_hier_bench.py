"""The benchmark's hierarchy rows, from records to table, without running a benchmark.

Running them takes minutes (`gradsync bench` without --quick; the numbers are in
bench/results/); here the arithmetic of a row and its rendering are checked on
made-up records: which rank speaks for a host, the bounds, the table's columns.
"""

from __future__ import annotations

from typing import Any

from gradsync_bench import netns_hosts, runner, suites


def _rep(tx: int, rx: int) -> dict[str, Any]:
    return {"wall_s": 0.1, "cpu_s": 0.1, "coordinator_cpu_s": 0.0, "link_tx": tx, "link_rx": rx}


def test_a_hosts_first_rank_speaks_for_its_link() -> None:
    # 2 hosts x 2 ranks; the second rank of each host read other (ignored) numbers.
    records = [
        {method: [_rep(100 * (rank + 1), 10 * (rank + 1))] * 3 for method in netns_hosts.METHODS}
        for rank in range(4)
    ]
    found = netns_hosts.bytes_per_host(records, ranks_per_host=2)
    assert set(found) == set(netns_hosts.METHODS)
    assert found["hierarchical"] == {"h0": {"tx": 100, "rx": 10}, "h1": {"tx": 300, "rx": 30}}
    assert [netns_hosts.host_of(rank, 2) for rank in range(4)] == ["h0", "h0", "h1", "h1"]


def _stats(median_ms: float) -> dict[str, float]:
    return {
        "median_ms": median_ms,
        "algbw_mb_s": 1000.0 / median_ms,
        "cpu_s_per_gb": 1.0,
        "cpu_s_per_sync": 0.1,
        "cpu_utilisation": 0.5,
        "server_cores": 0.2,
        "busiest_server_cores": 0.2,
    }


def test_hierarchy_rows_render_in_the_tables() -> None:
    link = {"h0": {"tx": 16e6, "rx": 16e6}, "h1": {"tx": 16e6, "rx": 16e6}}
    document = {
        "started_at": "2025-01-01T00:00:00+00:00",
        "duration_s": 1.0,
        "machine": {"cores": 2, "cpu_model": "test", "torch": "x", "grpcio": "y"},
        "suites": {
            "loopback": [
                {
                    "world_size": 4,
                    "shards": 1,
                    "megabytes": 25.0,
                    "gradsync": _stats(100),
                    "gloo": _stats(50),
                    suites.HIERARCHICAL: _stats(40),
                    "bandwidth_ratio": 0.5,
                    "hierarchical_bandwidth_ratio": 1.25,
                }
            ],
            "netns_hierarchy": [
                {
                    "hosts": 2,
                    "ranks_per_host": 2,
                    "megabytes": 16.0,
                    "rate_mbit": 200.0,
                    "gradsync": _stats(2800),
                    "hierarchical": _stats(1400),
                    "gloo": _stats(1100),
                    "gradsync_bound_ms": 2684,
                    "hierarchical_bound_ms": 1342,
                    "gloo_bound_ms": 1006,
                    "hierarchical_of_bound": 0.96,
                    "hierarchical_to_flat_time": 0.5,
                    "hierarchical_to_flat_bytes": 0.51,
                    "ddp-backend": _stats(2000),
                    "backend_to_wrapper": 0.7,
                    "link_bytes": {
                        "gradsync": {h: {d: 2 * v for d, v in x.items()} for h, x in link.items()},
                        "hierarchical": link,
                        "ddp-backend": {h: {"tx": 24e6, "rx": 16e6} for h in link},
                        "gloo": link,
                    },
                }
            ],
        },
    }
    table = runner.markdown(document)
    assert "| 4 | 1 | 25 | 100.0 | 50.0 |" in table
    assert "| 40.0 | 25 | 1.25 | 1.00 |" in table  # the hierarchical columns
    assert (
        "| 2 x 2 | 16 | 200 | 2800 (2684) | 1400 (1342) | 96% | 1100 (1006) | 0.50 | "
        "32.0 / 32.0 | 16.0 / 16.0 | 16.0 / 16.0 | 0.51 | 2000 | 24.0 / 16.0 | 0.70 |"
    ) in table
    # A row measured without the backend leaves its columns empty.
    del document["suites"]["netns_hierarchy"][0]["ddp-backend"]
    del document["suites"]["netns_hierarchy"][0]["backend_to_wrapper"]
    del document["suites"]["netns_hierarchy"][0]["link_bytes"]["ddp-backend"]
    assert "| 0.51 | - | - | - |" in runner.markdown(document)
