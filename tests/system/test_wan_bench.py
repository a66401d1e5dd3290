"""`gradsync bench --suites wan`, for real and short: namespaces, shaped links, real ranks.

Two worker hosts and a coordinator host (network namespaces, links shaped to 100 Mbit/s)
train the wan suite's char transformer with the no-sync reference, torch DDP + gloo,
gradsync DDP, DiLoCo H = 10 int8 and torchft's DiLoCo H = 10 (its lighthouse on the
coordinator host, one replica group per worker host), a few steps each, through one real
`gradsync bench` command; the test checks the structure of what it measured (not speeds:
timings are noisy here): every method trained and was timed, the link counters tell the
methods apart as their protocols say, the losses are finite and fall. Needs root
(namespaces); skips with the reason otherwise.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from gradsync.arguments import BENCH_WAN_METHODS
from gradsync_bench import wan
from gradsync_bench.suites import Row
from gradsync_bench.wan_worker import METHODS as WORKER_METHODS
from support.components import netns_available

METHODS = ("nosync", "ddp-gloo", "gradsync-ddp", "diloco-h10-int8", "torchft-h10-fp32")


@pytest.mark.timeout(460)
def test_wan_suite_measures_every_method_and_torchft_on_shaped_links(tmp_path: Path) -> None:
    ok, reason = netns_available()
    if not ok:
        pytest.skip(reason)
    argv = [
        sys.executable, "-m", "gradsync.cli", "bench", "--suites", "wan",
        "--wan-world", "2", "--wan-rates", "100", "--wan-steps", "20",
        "--wan-sync-steps", "2", "--wan-quality-steps", "0",
        "--wan-methods", ",".join(METHODS), "--out", str(tmp_path),
    ]  # fmt: skip
    result = subprocess.run(
        argv, capture_output=True, text=True, timeout=420, env=dict(os.environ), cwd=tmp_path
    )
    assert result.returncode == 0, result.stderr[-4000:]
    document = json.loads((tmp_path / "latest.json").read_text())
    assert "wan" not in document["skipped"]
    rows = {row["method"]: row for row in document["suites"]["wan"]["rows"]}
    assert set(rows) == set(METHODS)
    model_bytes = rows["nosync"]["parameter_bytes"]
    assert model_bytes >= 16 * (1 << 20)

    for method, row in rows.items():
        assert "error" not in row, (method, row.get("error"))
        assert row["samples_per_s"] > 0, method
        assert row["utilization"] is not None and row["utilization"] > 0, method
        assert math.isfinite(row["held_out_loss"]), method
        # The untrained model is near uniform over 256 bytes: ln 256 = 5.55 nats.
        assert row["held_out_loss"] < math.log(256), (method, row["held_out_loss"])
        assert all(math.isfinite(loss) for _, loss in row["loss_curve"]), method

    # Without communication a worker link carries almost nothing (a few ARP/TCP bytes).
    assert rows["nosync"]["link_bytes_per_step"] < 1e4
    # Every step, both DDPs move about the whole model each way through each worker link
    # (gloo's ring at W = 2: N each way; gradsync: N up, N down).
    for method in ("ddp-gloo", "gradsync-ddp"):
        assert rows[method]["link_up_bytes_per_step"] > 0.9 * model_bytes, method
        assert rows[method]["link_down_bytes_per_step"] > 0.9 * model_bytes, method
    # gradsync counts what it uploads; the wire agrees to within the framing.
    client = rows["gradsync-ddp"]["client_up_bytes_per_step"]
    assert 0.9 * client < rows["gradsync-ddp"]["link_up_bytes_per_step"] < 1.2 * client
    # DiLoCo H = 10, int8 up and fp32 down once per 10 steps: far below every-step DDP.
    diloco = rows["diloco-h10-int8"]
    assert diloco["link_bytes_per_step"] < rows["ddp-gloo"]["link_bytes_per_step"] / 5
    assert diloco["link_up_bytes_per_step"] < diloco["link_down_bytes_per_step"] / 2
    # An int8 round uploads about a quarter of the fp32 model (plus per-chunk scales).
    assert 0.2 * model_bytes < diloco["client_round_upload_bytes"] < 0.35 * model_bytes
    # The training loss falls over the run where it was logged more than once.
    for method in ("nosync", "diloco-h10-int8"):
        curve = rows[method]["loss_curve"]
        assert curve[-1][1] < curve[0][1] - 0.3, (method, curve)

    scorecard = document["suites"]["wan"]["scorecard"]
    assert scorecard and all(
        card["result"] in ("PASS", "MISS", "NOT MEASURED") for card in scorecard
    )
    table = (tmp_path / "latest.md").read_text()
    assert "Slow-link scorecard" in table
    assert (tmp_path / "latest.png").stat().st_size > 0

    # torchft's DiLoCo, its lighthouse on the coordinator host, one replica group per worker
    # host, in the same run beside the reference.
    torchft = rows["torchft-h10-fp32"]
    assert "error" not in torchft, torchft.get("error")
    # The worker checked that torchft's manager committed both rounds (20 steps, H = 10).
    assert torchft["steps"] == 20 and torchft["seconds_per_round"] > 0
    assert torchft["round_blocking_s"] > 0
    # A ring all-reduce at W = 2 moves the model once each way per round through each
    # worker link: two rounds in 20 steps, about N / 10 each way per step.
    model_bytes = torchft["parameter_bytes"]
    for direction in ("link_up_bytes_per_step", "link_down_bytes_per_step"):
        assert 0.09 * model_bytes < torchft[direction] < 0.13 * model_bytes, direction
    assert torchft["client_up_bytes_per_step"] is None  # gradsync took no part
    assert torchft["utilization"] is not None and torchft["utilization"] > 0
    curve = torchft["loss_curve"]
    assert all(math.isfinite(loss) for _, loss in curve)
    assert curve[-1][1] < curve[0][1] - 0.3, curve
    assert torchft["held_out_loss"] < math.log(256)
    assert "torchft DiLoCo H=10 fp32" in table


def _row(method: str, samples_per_s: float, link: float, loss: float = 2.0, **kw: Any) -> Row:
    return {
        "method": method,
        "rate_mbit": kw.get("rate", 100.0),
        "delay_ms": kw.get("delay"),
        "hub_mbit": kw.get("hub"),
        "quality_pass": kw.get("quality", False),
        "samples_per_s": samples_per_s,
        "link_bytes_per_step": link,
        "held_out_loss": loss,
    }


def test_scorecard_passes_and_misses_by_the_measured_ratios() -> None:
    rows = wan._with_utilization(
        [
            _row("nosync", 100.0, 0.0),
            _row("ddp-gloo", 20.0, 60e6),
            _row("gradsync-ddp", 10.0, 40e6),
            _row("diloco-h50-int8", 91.0, 0.5e6),  # 91 %; 120x and 80x fewer bytes
            _row("streaming-f4-int8", 94.0, 0.1e6),  # 94 %; 600x and 400x
            _row("ddp-gloo", 5.0, 60e6, loss=2.0, rate=None, quality=True),
            _row("diloco-h10-fp32", 5.0, 1e6, loss=2.03, rate=None, quality=True),
            _row("diloco-h10-int8", 5.0, 1e6, loss=2.05, rate=None, quality=True),
        ]
    )
    cards = {card["target"]: card for card in wan.scorecard(rows)}
    results = [(card["result"], round(card["measured"], 3)) for card in cards.values()]
    assert results == [
        ("PASS", 0.91),
        ("MISS", 0.94),
        ("MISS", 120.0),
        ("PASS", 600.0),
        ("MISS", 80.0),
        ("PASS", 400.0),
        ("PASS", 0.015),  # |2.03 / 2 - 1|
        ("MISS", 0.025),
    ]
    # Without the reference there is no utilization, and a target says so.
    lone = wan._with_utilization([_row("diloco-h50-int8", 91.0, 0.5e6)])
    assert lone[0]["utilization"] is None
    assert wan.scorecard(lone)[0]["result"] == "NOT MEASURED"


def test_delayed_links_pair_with_rates_and_carry_the_scorecard() -> None:
    rates, delays = zip(*wan.DELAYED_LINKS, strict=True)
    plan = wan.WanPlan(rates_mbit=rates, delays_ms=delays)
    assert plan.links() == [(100.0, 25.0), (100.0, 100.0), (20.0, 50.0)]
    assert wan.WanPlan(rates_mbit=(100.0, 20.0), delays_ms=(0.0, 50.0)).links() == [
        (100.0, None),
        (20.0, 50.0),
    ]
    with pytest.raises(ValueError, match="1 delays for 2 rates"):
        wan.WanPlan(rates_mbit=(100.0, 20.0), delays_ms=(25.0,)).links()
    # Utilization pairs a row with the reference of its own link; the targets read the
    # 100 Mbit/s + 25 ms rows (a 100 ms round trip) when there are some.
    rows = wan._with_utilization(
        [
            _row("nosync", 100.0, 0.0),
            _row("diloco-h50-int8", 95.0, 0.5e6),
            _row("nosync", 50.0, 0.0, delay=25.0),
            _row("diloco-h50-int8", 40.0, 0.5e6, delay=25.0),
        ]
    )
    assert [row["utilization"] for row in rows] == [1.0, 0.95, 1.0, 0.8]
    card = wan.scorecard(rows)[0]
    assert card["target"] == "utilization, DiLoCo H=50 int8, 100 Mbit/s + 25 ms"
    assert (card["measured"], card["result"]) == (0.8, "MISS")


def test_torchft_cards_compare_fp32_on_every_link_and_the_hub_at_1_3x() -> None:
    rows = wan._with_utilization(
        [
            _row("nosync", 100.0, 0.0, delay=25.0),
            _row("diloco-h50-fp32", 60.0, 0.8e6, delay=25.0),
            _row("torchft-h50-fp32", 70.0, 0.8e6, delay=25.0),
            _row("nosync", 100.0, 0.0, delay=25.0, hub=1000.0),
            _row("diloco-h50-fp32", 75.0, 0.8e6, delay=25.0, hub=1000.0),
            _row("diloco-h50-int8x2", 95.0, 0.2e6, delay=25.0, hub=1000.0),
            _row("torchft-h50-fp32", 70.0, 0.8e6, delay=25.0, hub=1000.0),
        ]
    )
    # The hub pass's rows pair with the hub pass's reference only.
    assert [row["utilization"] for row in rows] == [1.0, 0.6, 0.7, 1.0, 0.75, 0.95, 0.7]
    cards = wan.torchft_cards(rows)
    assert [(c["target"], round(c["measured"], 3), c["goal"], c["result"]) for c in cards] == [
        ("gradsync diloco-h50-fp32 vs torchft H=50 fp32, 100 Mbit/s + 25 ms", 0.857, 1.0, "MISS"),
        (
            "gradsync diloco-h50-fp32 vs torchft H=50 fp32, 100 Mbit/s + 25 ms, "
            "coordinator host 1000 Mbit/s",
            1.071,
            1.3,
            "MISS",
        ),
        (
            "gradsync diloco-h50-int8x2 vs torchft H=50 fp32, 100 Mbit/s + 25 ms, "
            "coordinator host 1000 Mbit/s",
            1.357,
            1.3,
            "PASS",
        ),
    ]
    # The target rows of the scorecard are those of the plain link, not the hub's.
    assert wan.scorecard(rows)[-3:] == cards
    assert wan.hub_link([]) is None
    assert wan.hub_link([100, 25, 1000]) == (100.0, 25.0, 1000.0)
    assert wan.hub_link([100, 0, 1000]) == (100.0, None, 1000.0)
    with pytest.raises(ValueError, match="WORKER_MBIT,DELAY_MS,COORDINATOR_MBIT"):
        wan.hub_link([100, 25])
    plan = wan.WanPlan(methods=tuple(WORKER_METHODS), hub_link=(100.0, 25.0, 1000.0))
    assert [m.name for m in plan.methods_at(100.0, False, hub=True)] == list(wan.HUB_METHODS)


def test_the_cli_offers_exactly_the_workers_methods() -> None:
    assert tuple(WORKER_METHODS) == BENCH_WAN_METHODS
    plan = wan.WanPlan(steps=50, sync_steps=6)
    assert plan.steps_of(WORKER_METHODS["ddp-gloo"], 100.0, False) == 6
    assert plan.steps_of(WORKER_METHODS["ddp-gloo"], 20.0, False) == 2  # scaled with the rate
    assert plan.steps_of(WORKER_METHODS["diloco-h10-int8"], 20.0, False) == 25  # half
    assert plan.steps_of(WORKER_METHODS["diloco-h50-int8"], 20.0, False) == 50
    assert plan.steps_of(WORKER_METHODS["diloco-h10-int8"], None, True) == plan.quality_steps
    slow = [m.name for m in plan.methods_at(20.0, False)]
    assert slow == [m for m in WORKER_METHODS if m in wan.SLOW_LINK_METHODS]
