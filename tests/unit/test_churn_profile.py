"""The churn run's profile (`gradsync_bench.churn_profile`): rejoins and takeovers read
from the workers' JSON lines and the coordinators' timestamped logs."""

from __future__ import annotations

import datetime
from pathlib import Path
from typing import Any

from gradsync_bench.churn_checks import Incarnation
from gradsync_bench.churn_profile import medians, profile
from gradsync_bench.churn_report import profile_lines
from gradsync_bench.churn_schedule import Failure

T0 = datetime.datetime(2026, 12, 6, 12, 0, 0).timestamp()  # local time, as the logs


def _stamp(t: float) -> str:
    moment = datetime.datetime.fromtimestamp(t)
    return moment.strftime("%Y-%m-%d %H:%M:%S,") + f"{moment.microsecond // 1000:03d}"


def _log(path: Path, *lines: tuple[float, str]) -> None:
    text = "gradsync coordinator listening on 127.0.0.1:1 (no timestamp)\n"
    text += "".join(f"{_stamp(t)} [coordinator] INFO gradsync.server: {m}\n" for t, m in lines)
    path.write_text(text)


def _applied(rank: int, *steps: tuple[int, float]) -> list[dict[str, Any]]:
    return [{"e": "applied", "s": s, "t": t, "c": 4} for s, t in steps]


def test_a_rejoin_and_a_takeover_are_timed_from_the_logs(tmp_path: Path) -> None:
    t = T0
    _log(
        tmp_path / "coordinator1.log",
        (t + 10.5, "job 'default': rank(s) [2] rejoined job 'default' at step 7 with rank 0's"),
        (t + 20.8, "started 1 local shard process(es): 1 on :2"),
        (t + 21.4, "took over the lease with fence 2 (previous holder ...)"),
        (t + 21.6, "job 'default': rank 0 joined from ipv4:127.0.0.1:3 (incarnation 'x')"),
        (t + 21.9, "job 'default': rank 2 joined from ipv4:127.0.0.1:4 (incarnation 'y')"),
        (t + 22.0, "shard 1 registered: 127.0.0.1:2 (...); all shards registered"),
        (t + 22.1, "job 'default' continued at step 9 from the ranks' own state"),
        (t + 25.0, "job 'default': rank 2 joined from ipv4:127.0.0.1:5 (a later rejoin)"),
    )
    survivor = Incarnation(0, [{"e": "start", "t": t}, *_applied(0, (6, t + 10.4), (7, t + 11.3))])
    survivor.events += _applied(0, (8, t + 20.0), (9, t + 22.3))
    first = Incarnation(2, [{"e": "start", "t": t}, *_applied(2, (6, t + 10.4))])
    second = Incarnation(2, [{"e": "start", "t": t + 10.0}, {"e": "joined", "t": t + 11.0}])
    second.events += [{"e": "submit", "s": 7, "t": t + 11.1}, *_applied(2, (7, t + 11.3))]
    kill = Failure("coordinator-kill", t + 20.1, "coordinator0")
    found = profile(
        tmp_path, [Failure("worker-kill", t + 9.0, "rank 2"), kill], [survivor, first, second]
    )

    (rejoin,) = found["rejoins"]
    assert rejoin["rank"] == 2
    assert abs(rejoin["admitted_s"] - 0.5) < 0.01 and abs(rejoin["joined_s"] - 1.0) < 1e-6
    assert abs(rejoin["first_applied_s"] - 1.3) < 1e-6
    # The others applied step 6 at 10.4 and waited for step 7 until 11.3.
    assert abs(rejoin["others_waited_s"] - 0.9) < 1e-6
    (takeover,) = found["takeovers"]
    assert takeover["by"] == "coordinator1"
    expected = {
        "shards_started_s": 0.7,
        "took_over_s": 1.3,
        "first_rank_joined_s": 1.5,
        "last_rank_joined_s": 1.8,  # the later rejoin at 25.0 is not the takeover's
        "shards_registered_s": 1.9,
        "continued_s": 2.0,
        "first_step_s": 2.2,
    }
    for key, value in expected.items():
        assert abs(takeover[key] - value) < 0.01, (key, takeover[key])
    assert medians(found["takeovers"])["took_over_s"] == takeover["took_over_s"]
    text = "\n".join(profile_lines(found))
    assert "Rejoins (1;" in text and "waited 0.90 s" in text
    assert "lease taken 1.30" in text and "first step 2.20." in text
    assert profile_lines(None) == [] and profile_lines({"rejoins": [], "takeovers": []}) == []
