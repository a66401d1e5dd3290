"""A hierarchical job on the coordinator's own host moves its payloads through shared memory.

Two ranks and the coordinator share `$GRADSYNC_HOST_ID`, so rank 0, the local
leader, hands its segment to the coordinator and uploads header-only; the
coordinator's `gradsync_segment_bytes_total` counts what it read and wrote
there. The same ranks then train flat over TCP: with two ranks the summation
order is the same (rank 0 + rank 1, then divided), so the runs agree bitwise.
"""

from __future__ import annotations

import re
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from support.hierarchy import assert_ranks_identical, finish, params_of, run_of, start_job
from support.processes import CoordinatorProcess

pytestmark = pytest.mark.timeout(120)

HOST = "payload-host"


def segment_bytes(metrics_url: str, direction: str) -> float:
    with urllib.request.urlopen(metrics_url, timeout=5) as response:
        text = response.read().decode()
    found = re.search(
        rf'^gradsync_segment_bytes_total{{direction="{direction}"}} (\S+)$', text, re.M
    )
    return float(found.group(1)) if found else 0.0


def test_a_same_host_leader_uses_the_segment_and_matches_flat(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("GRADSYNC_HOST_ID", HOST)  # the coordinator's id (it inherits the env)
    coordinator = CoordinatorProcess(2, "--metrics-port", "0")
    try:
        banner = "".join(coordinator.startup_lines)
        url = re.search(r"metrics (http://\S+?)[,)]", banner)
        assert url is not None, banner
        metrics_url = url.group(1)
        processes = start_job(
            coordinator.address,
            2,
            tmp_path,
            "--runs",
            "hier,flat",
            "--steps",
            "3",
            hosts=[HOST, HOST],
        )
        reports = finish(processes, tmp_path, timeout_s=90)
        hier, flat = run_of(reports, 0, tmp_path), run_of(reports, 1, tmp_path)
        assert [r["local_ranks"] for r in hier] == [[0, 1], [0, 1]]
        assert segment_bytes(metrics_url, "read") > 0
        assert segment_bytes(metrics_url, "written") > 0
    finally:
        _, log = coordinator.stop()
    assert "moves its gradient payloads through its shared-memory segment" in log
    assert_ranks_identical(hier)
    for name, value in params_of(flat[0]).items():
        np.testing.assert_array_equal(params_of(hier[0])[name], value, err_msg=name)
