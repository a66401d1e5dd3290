"""A busy rank on a saturated link stays alive; a frozen one is named within timeout + 1 s.

Real hosts (network namespaces), real `gradsync serve` and real workers
(`gradsync_bench.wan_liveness`, the bench's own scenario, scaled down): W = 2
worker hosts and a coordinator host, every link shaped to 8 Mbit/s with `tbf`,
a 2 MiB model synchronized every step, the coordinator at a 2 s heartbeat
timeout. Each rank's upload holds more than 2 s of its share of the
coordinator's link in its socket's send queue, which a Heartbeat on the Sync
stream would wait behind; the workers' beats on their side channel keep both
alive through step 0. Rank 1 is then stopped with SIGSTOP in the middle of its
next upload: although its kernel keeps sending what it had queued, the
coordinator must name it dead within 2 + 1 s of the signal, before any other rank.
Skipped, with the reason, where namespaces cannot be made (not root, no iproute2).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from gradsync_bench.wan_liveness import reproduce
from support.components import netns_available

RATE_MBIT = 8.0
WORLD = 2
WIDTH = 724  # 724 x 724 + 724 float32: 2.0 MiB
TIMEOUT_S = 2.0


@pytest.fixture(autouse=True)
def _require_netns() -> None:
    ok, reason = netns_available()
    if not ok:
        pytest.skip(reason)


@pytest.mark.timeout(120)
def test_saturated_rank_lives_and_frozen_rank_is_named_in_time(tmp_path: Path) -> None:
    summary = reproduce(
        RATE_MBIT,
        None,  # no delay line: tbf only
        WORLD,
        2,
        tmp_path,
        100.0,
        freeze=1,
        width=WIDTH,
        serve_args=("--heartbeat-timeout", f"{TIMEOUT_S:g}"),
    )
    freeze = summary["freeze"]
    assert isinstance(freeze, dict) and freeze["frozen"], summary
    # Step 0 finished on both ranks: neither was declared dead while its upload queued.
    steps_done = summary["steps_done"]
    assert isinstance(steps_done, dict) and steps_done.get(0, 0) >= 1, summary
    # Rank 1 first; rank 0 may follow only as the job's abort ends its process.
    declared = summary["declared_dead"]
    assert isinstance(declared, list) and declared[:1] == [1], summary
    dead_after_s = freeze["dead_after_s"]
    assert isinstance(dead_after_s, float) and TIMEOUT_S - 0.5 <= dead_after_s <= TIMEOUT_S + 1.0
    # The link really was saturated for longer than the timeout: some worker's queue to the
    # coordinator held more than TIMEOUT_S of its share of the coordinator's link.
    largest = summary["largest_send_queue_bytes"]
    assert isinstance(largest, dict)
    share_bytes_per_s = RATE_MBIT * 1e6 / 8 / WORLD
    assert max(largest.values()) > TIMEOUT_S * share_bytes_per_s, summary
