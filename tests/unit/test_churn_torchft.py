"""The torchft churn soak's pure parts (`gradsync_bench.churn_torchft`): the failure kinds
it maps, the job's stalls, its membership samples and its Markdown rows."""

from __future__ import annotations

from typing import Any

from gradsync_bench.churn_checks import Incarnation
from gradsync_bench.churn_schedule import KINDS, STOP_S
from gradsync_bench.churn_torchft import (
    COUNTERPARTS,
    longest_stall,
    markdown_lines,
    participant_samples,
    rank_applied_after,
    torchft_kinds,
)


def test_only_the_kinds_with_a_torchft_counterpart_are_injected_in_order() -> None:
    kept, left_out = torchft_kinds(KINDS)
    assert kept == ("worker-kill", "worker-stop", "coordinator-kill")
    assert left_out == ("shard-kill", "redis-restart")
    assert set(kept) == set(COUNTERPARTS)
    assert torchft_kinds(("redis-restart", "worker-stop")) == (("worker-stop",), ("redis-restart",))


def test_the_longest_stall_after_a_failure_is_counted_whole() -> None:
    times = [0.0, 1.0, 2.0, 4.0, 9.0, 9.5, 20.0]
    # The failure at 1.5 falls in the gap 1.0-2.0 (in flight); the 2.0-4.0 gap follows it.
    assert longest_stall(times, 1.5, 3.0) == (1.0, 2.0)
    assert longest_stall(times, 1.5, 6.0) == (2.0, 4.0)
    # The 4.0-9.0 gap holds the next failure (at 5.0): it is that one's.
    assert longest_stall(times, 4.5, 5.0) is None
    assert longest_stall(times, 5.0, 9.2) == (4.0, 9.0)
    # The last failure's stall is counted whole.
    assert longest_stall(times, 9.7, float("inf")) == (9.5, 20.0)


def _events(rank: int, *rows: tuple[str, int, float, int]) -> Incarnation:
    events: list[dict[str, Any]] = [{"e": "start", "t": rows[0][2] - 0.5}]
    events += [{"e": e, "s": s, "t": t, "c": c} for e, s, t, c in rows]
    return Incarnation(rank, events)


def test_samples_are_first_applications_with_the_participant_count() -> None:
    logs = [
        _events(0, ("applied", 0, 1.0, 2), ("applied", 1, 2.0, 2), ("applied", 2, 3.2, 1)),
        _events(1, ("applied", 0, 0.9, 2), ("applied", 1, 2.1, 2), ("applied", 3, 5.0, 2)),
    ]
    samples = participant_samples(logs)
    assert [(s.t, s.open_step, s.epoch) for s in samples] == [
        (0.9, 0, 2),
        (2.0, 1, 2),
        (3.2, 2, 1),
        (5.0, 3, 2),
    ]
    # Rank 1 frozen at 5.0 - STOP_S - 0.5 is back at 5.0, its first step after it was woken;
    # frozen at 2.0, it applied none after 2.0 + STOP_S.
    at = 5.0 - STOP_S - 0.5
    assert rank_applied_after(logs, "rank 1", at) == 5.0 - at
    assert rank_applied_after(logs, "rank 1", 2.0) is None


def _run(steps: int, uncommitted: int) -> dict[str, Any]:
    return {
        "steps_per_s": steps / 10,
        "steps_in_window": steps,
        "uncommitted": uncommitted,
        "uncommitted_in_window": uncommitted,
        "replicas": {"ok": True, "live_ranks": [0, 1], "distinct_digests": 1},
        "applied_once": {"ok": True, "steps_applied": steps, "steps_advanced": steps},
        "per_kind": {},
        "injection_errors": [],
        "errors": [],
    }


def test_the_markdown_names_the_left_out_kinds_and_the_ratio() -> None:
    churn = _run(80, 3) | {
        "per_kind": {
            "worker-kill": {
                "count": 2,
                "detect_s": {"median": 0.1, "max": 0.2, "n": 2},
                "recover_s": None,
                "longest_stall_s": {"median": 2.0, "max": 2.5, "n": 2},
                "rank_back_s": None,
                "recomputed": 2,
            }
        }
    }
    suite = {
        "plan": {
            "world_size": 2,
            "min_replicas": 2,
            "duration_s": 10.0,
            "interval_s": 5.0,
            "kinds": ["worker-kill"],
            "left_out": ["shard-kill"],
        },
        "baseline": _run(100, 0),
        "churn": churn,
        "steps_per_s_ratio": 0.8,
    }
    text = "\n".join(markdown_lines(suite))
    assert "left out: shard-kill" in text
    assert "| churn | 8.0 | 80 | replicas identical (2 live, 1 digest(s))" in text
    assert "| 3 (3) |" in text
    assert "Steps/s under churn / churn-free: 0.80." in text
    assert "| worker-kill | 2 | 0.10 / 0.20 (2) | - | 2.00 / 2.50 (2) | - | 2 |" in text
    assert markdown_lines({}) == []
