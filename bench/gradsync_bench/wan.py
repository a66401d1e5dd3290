"""The wan suite: the slow-link scorecard of DiLoCo against every-step synchronization.

W worker hosts and one coordinator host are network namespaces (`gradsync_bench.netns`)
whose links are shaped to B Mbit/s each way (tc tbf) and, when the plan gives a delay for
that rate (`WanPlan.delays_ms`), a one-way delay D ms per link (a userspace TUN delay line,
`gradsync_bench.netns_delay`; host to host crosses two links, so the round trip is 4 D).
Without a delay only bandwidth is shaped; a real 50 ms link adds about one round trip per
round for DiLoCo and per bucket exchange for DDP. `DELAYED_LINKS` are the issue's delayed
configurations (100 Mbit/s + 25 ms, i.e. a 100 ms round trip; 100 Mbit/s + 100 ms;
20 Mbit/s + 50 ms).

On one cluster per B, with the same ranks on the same hosts, every method trains the same
character-level transformer (`gradsync_bench.wan_task`, 19.4 MB of float32 parameters) on
the same per-rank batches with AdamW (`gradsync_bench.wan_worker`): the no-sync reference,
torch DDP over gloo, gradsync DDP, DiLoCo at H = 10 and 50 with an fp32 and an int8 wire,
and streaming DiLoCo (F = 4 fragments, int8, 5 inner steps of overlap); outer lr 0.7,
Nesterov momentum 0.9. Every gradsync method gets a fresh coordinator on the coordinator
host. Per method and B a row holds samples/s, utilization (samples/s over the no-sync
reference's), bytes per inner step from each worker host's eth0 counters (up + down) and
from the client's own upload count, the training losses and the held-out loss.

Loss does not depend on the link, so the quality comparison (DiLoCo's loss against DDP's at
the same number of samples) runs for more steps on the same hosts with their links
unshaped (`quality_steps`), where DDP's steps cost seconds less each.

The scorecard (`scorecard`) holds the issue's targets at 100 Mbit/s as PASS / MISS with the
measured ratio.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gradsync_bench.netns import Cluster
from gradsync_bench.netns_commands import HOST_IFNAME, run_tc
from gradsync_bench.netns_probe import available, delay_available
from gradsync_bench.netns_shaping import LinkShape, shape_commands
from gradsync_bench.procs import flag_args, progress, wait_ranks
from gradsync_bench.sharded import GLOO_PORT, Topology, on_host, running_coordinator
from gradsync_bench.suites import Row
from gradsync_bench.torchft_wan import lighthouse
from gradsync_bench.wan_worker import METHODS, Method

#: The methods of the quality (unshaped, longer) pass, where they are selected.
QUALITY_METHODS = ("ddp-gloo", "diloco-h10-fp32", "diloco-h10-int8")
#: The methods run at rates below 100 Mbit/s by default: at 20 Mbit/s a round of a
#: 19.4 MB model through one coordinator costs half a minute, so H = 10 would take most of
#: the suite's time there (`slow_methods` changes this).
SLOW_LINK_METHODS = (
    "nosync",
    "ddp-gloo",
    "gradsync-ddp",
    "diloco-h50-fp32",
    "diloco-h50-int8",
    "streaming-f4-int8",
    "diloco-h50-int8x2",
    "diloco-h50-topk2",
    "torchft-h50-fp32",
)
#: The link rate the issue's targets are stated at.
TARGET_RATE_MBIT = 100.0
#: The one-way delay per link of the issue's targets at that rate (a 100 ms round trip host
#: to host); the scorecard uses the rows of that link when they exist.
TARGET_DELAY_MS = 25.0
#: The delayed links of the scorecard, (Mbit/s, one-way ms per link): pass
#: `rates_mbit=[r for r, _ in DELAYED_LINKS], delays_ms=[d for _, d in DELAYED_LINKS]`.
DELAYED_LINKS = ((100.0, 25.0), (100.0, 100.0), (20.0, 50.0))
#: The methods of the hub pass (the coordinator host on a faster link than the workers'),
#: where they are selected: what a hub gains there against torchft's ring, which does not
#: use that host's link.
HUB_METHODS = (
    "nosync",
    "diloco-h50-fp32",
    "diloco-h50-int8",
    "diloco-h50-int8x2",
    "torchft-h50-fp32",
)
#: The coordinator serves at its defaults: the workers' heartbeats travel beside their frame
#: connections, so the default 5 s heartbeat timeout holds even while a round of 4 x 19.5 MB
#: holds a 20 Mbit/s link for half a minute (`gradsync_bench.wan_liveness`).
SERVE_ARGS: tuple[str, ...] = ()
#: Per-method time allowed for W processes importing torch on two cores and joining.
STARTUP_ALLOWANCE_S = 240.0


@dataclass(frozen=True)
class WanPlan:
    """What the wan suite runs (`gradsync bench --wan-*` set these)."""

    world_size: int = 4
    rates_mbit: Sequence[float] = (100.0, 20.0)
    #: One-way delay per link in ms for each of `rates_mbit` (None or 0: none); empty: no
    #: delay at any rate.
    delays_ms: Sequence[float | None] = ()
    methods: Sequence[str] = tuple(METHODS)
    #: Inner steps of the no-sync reference and the DiLoCo methods (a multiple of 50 keeps
    #: H = 50's rounds whole: 50 = one round of H = 50, four fragment rounds of streaming).
    steps: int = 50
    #: Steps of the every-step methods at 100 Mbit/s (they cost seconds each), scaled with
    #: the rate below it and at least 2.
    sync_steps: int = 6
    #: Inner steps of the unshaped quality pass (0: none).
    quality_steps: int = 100
    #: The methods run at rates below 100 Mbit/s (those of `methods` among them).
    slow_methods: Sequence[str] = SLOW_LINK_METHODS
    #: The hub pass, (workers' Mbit/s, one-way ms per link or None, the coordinator
    #: host's Mbit/s), run after the others with `HUB_METHODS`; None: no hub pass.
    hub_link: tuple[float, float | None, float] | None = None
    batch: int = 4
    context: int = 64
    log_every: int = 5

    def steps_of(self, method: Method, rate_mbit: float | None, quality: bool) -> int:
        """Timed inner steps of `method` at `rate_mbit` (None: unshaped)."""
        if quality:
            return self.quality_steps
        if rate_mbit is None:
            return self.steps
        if method.kind == "diloco" and method.sync_every > self.steps:
            return method.sync_every  # at least one whole round in the timed window
        if not method.every_step:
            # H = 10 has its rounds every 10 steps: half the steps (25 of 50) still hold
            # two, and utilization is a rate; its rounds cost the most time of all.
            if (
                method.kind == "diloco"
                and method.sync_every < 50
                and self.steps >= 4 * method.sync_every
            ):
                return self.steps // 2
            return self.steps
        scale = min(1.0, rate_mbit / TARGET_RATE_MBIT)
        return min(self.steps, max(2, math.ceil(self.sync_steps * scale)))

    def links(self) -> list[tuple[float, float | None]]:
        """The shaped passes' links, (Mbit/s, one-way delay ms per link or None)."""
        if self.delays_ms and len(self.delays_ms) != len(self.rates_mbit):
            raise ValueError(
                f"{len(self.delays_ms)} delays for {len(self.rates_mbit)} rates: "
                "give one delay per rate (0 for none)"
            )
        delays = self.delays_ms or [None] * len(self.rates_mbit)
        return [(rate, delay or None) for rate, delay in zip(self.rates_mbit, delays, strict=True)]

    def methods_at(self, rate_mbit: float | None, quality: bool, hub: bool = False) -> list[Method]:
        """The selected methods of one pass, in table order."""
        chosen = [METHODS[name] for name in METHODS if name in self.methods]
        if hub:
            return [m for m in chosen if m.name in HUB_METHODS]
        if quality:
            return [m for m in chosen if m.name in QUALITY_METHODS]
        if rate_mbit is not None and rate_mbit < TARGET_RATE_MBIT:
            return [m for m in chosen if m.name in self.slow_methods]
        return chosen


def hub_link(values: Sequence[float]) -> tuple[float, float | None, float] | None:
    """`WanPlan.hub_link` from [workers' Mbit/s, one-way ms per link, coordinator host's
    Mbit/s] (empty: None).

    Raises:
        ValueError: not three values, or a rate that is not positive.
    """
    if not values:
        return None
    if len(values) != 3 or values[0] <= 0 or values[2] <= 0:
        raise ValueError(
            f"the hub link is WORKER_MBIT,DELAY_MS,COORDINATOR_MBIT with positive rates, "
            f"got {list(values)}"
        )
    return (float(values[0]), float(values[1]) or None, float(values[2]))


def _worker_argv(
    plan: WanPlan,
    method: Method,
    rank: int,
    steps: int,
    workdir: Path,
    coordinator: str,
    gloo: str,
    address: str,
) -> list[str]:
    """A rank's command line (`coordinator`: gradsync's coordinator, or torchft's
    lighthouse for the torchft methods)."""
    meeting = (
        dict(lighthouse=coordinator) if method.uses_lighthouse else dict(coordinator=coordinator)
    )
    return [
        *(sys.executable, "-m", "gradsync_bench.wan_worker"),
        *flag_args(method=method.name, rank=rank, world_size=plan.world_size, steps=steps),
        *flag_args(batch=plan.batch, context=plan.context, log_every=plan.log_every),
        *flag_args(**meeting, gloo=gloo, workdir=workdir, address=address),
    ]


def _timeout_s(
    plan: WanPlan, method: Method, steps: int, rate_mbit: float | None, delay_ms: float | None
) -> float:
    """Generous: 2 s of compute per step plus every round at 4x its star bound, plus 100
    round trips per round (a delayed link's handshakes, slow starts and bucket exchanges)."""
    megabytes_s = 20e6 * 8 / ((rate_mbit or 1000.0) * 1e6)  # one model over one link
    rounds = steps if method.every_step else steps / method.sync_every + 1
    round_trips_s = 100 * 4 * (delay_ms or 0.0) / 1000
    bound_s = 4 * 2 * plan.world_size * megabytes_s + round_trips_s
    return STARTUP_ALLOWANCE_S + 2.0 * steps + rounds * bound_s


def _link_label(
    rate_mbit: float | None, delay_ms: float | None, hub_mbit: float | None = None
) -> str:
    if rate_mbit is None:
        return "unshaped"
    label = f"{rate_mbit:g} Mbit/s" + (f" + {delay_ms:g} ms" if delay_ms else "")
    return label + (f", coordinator host {hub_mbit:g} Mbit/s" if hub_mbit else "")


def shape_hub(cluster: Cluster, host: str, rate_mbit: float) -> None:
    """Reshape `host`'s link (both directions) to `rate_mbit`, keeping its delay."""
    shape = LinkShape(rate_mbit=rate_mbit)
    for command in shape_commands(["tc", "-n", cluster.netns(host)], HOST_IFNAME, shape):
        run_tc(command)
    for command in shape_commands(["tc"], cluster.bridge_port(host), shape):
        run_tc(command)


def run_method(
    cluster: Cluster,
    plan: WanPlan,
    method: Method,
    rate_mbit: float | None,
    quality: bool,
    delay_ms: float | None = None,
    hub_mbit: float | None = None,
) -> list[dict[str, Any]]:
    """Run one method on `cluster` (a fresh coordinator, or torchft's lighthouse, if it
    needs one); the ranks' records."""
    steps = plan.steps_of(method, rate_mbit, quality)
    topology = Topology("single", plan.world_size, 1)
    gloo = f"{cluster.address('w0')}:{GLOO_PORT}"
    label = f"{method.name} at {_link_label(rate_mbit, delay_ms, hub_mbit)}"
    progress(f"  wan {label}, {steps} steps ...")
    began = time.monotonic()
    # Other jobs on the machine take CPU from the ranks and skew a method's samples/s
    # against the reference's: the row records the load it ran under.
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as scratch:
        workdir = Path(scratch)

        def launch(coordinator: str) -> None:
            processes = [
                on_host(cluster, host)(
                    _worker_argv(
                        plan,
                        method,
                        rank,
                        steps,
                        workdir,
                        coordinator,
                        gloo,
                        cluster.address(host),
                    )
                )
                for rank, host in enumerate(topology.worker_hosts)
            ]
            timeout_s = _timeout_s(plan, method, steps, rate_mbit, delay_ms)
            wait_ranks(
                processes,
                timeout_s,
                lambda rank, code, err: f"{label}: rank {rank} failed (exit {code}): {err[-3000:]}",
                lambda rank: f"{label}: rank {rank} still running after {timeout_s:.0f} s",
            )

        if method.uses_coordinator:
            with running_coordinator(cluster, topology, workdir, SERVE_ARGS) as (address, _):
                launch(address)
        elif method.uses_lighthouse:
            with lighthouse(cluster, topology.shard_hosts[0], plan.world_size) as address:
                launch(address)
        else:
            launch("")
        records = [
            json.loads((workdir / f"{method.name}-rank{rank}.json").read_text())
            for rank in range(plan.world_size)
        ]
    load = (load_before + os.getloadavg()[0]) / 2
    progress(f"    {time.monotonic() - began:.0f} s, load {load:.1f}")
    for record in records:
        record["load_average"] = load
    return records


def summarize(
    records: list[dict[str, Any]],
    method: Method,
    rate_mbit: float | None,
    quality: bool,
    delay_ms: float | None = None,
    hub_mbit: float | None = None,
) -> Row:
    """A row from the ranks' records (bytes per inner step: mean over the worker hosts;
    a round's blocking seconds: the slowest rank's mean over its rounds)."""
    world_size = len(records)
    steps = records[0]["steps"]
    seconds = max(r["seconds"] for r in records)
    samples = world_size * records[0]["batch"] * steps
    up = statistics.mean(r["link_tx"] for r in records) / steps
    down = statistics.mean(r["link_rx"] for r in records) / steps
    client = [r["client_bytes_sent"] for r in records]
    curve = [
        [
            step * world_size * records[0]["batch"],
            statistics.mean(r["losses"][i][1] for r in records),
        ]
        for i, (step, _) in enumerate(records[0]["losses"])
    ]
    rounds = [b for r in records for b in r["round_bytes_sent"]]
    blocking = [statistics.mean(r["round_seconds"]) for r in records if r.get("round_seconds")]
    return {
        "method": method.name,
        "rate_mbit": rate_mbit,
        "delay_ms": delay_ms,
        "hub_mbit": hub_mbit,
        "quality_pass": quality,
        "world_size": world_size,
        "steps": steps,
        "sync_every": method.sync_every,
        "seconds": seconds,
        "samples": samples,
        "samples_per_s": samples / seconds,
        "link_up_bytes_per_step": up,
        "link_down_bytes_per_step": down,
        "link_bytes_per_step": up + down,
        "client_up_bytes_per_step": (
            statistics.mean(client) / steps if all(c is not None for c in client) else None
        ),
        "client_round_upload_bytes": statistics.mean(rounds) if rounds else None,
        "round_blocking_s": max(blocking) if blocking else None,
        "seconds_per_round": (
            None
            if method.every_step or method.kind == "nosync"
            else seconds / max(1, steps // method.sync_every)
        ),
        "parameter_bytes": records[0]["parameter_bytes"],
        "loss_curve": curve,
        "final_train_loss": curve[-1][1],
        "held_out_loss": statistics.mean(r["held_out_loss"] for r in records),
        "held_out_loss_rank0": records[0]["held_out_loss"],
        "load_average": records[0].get("load_average"),
    }


def _failed(
    method: Method,
    rate_mbit: float | None,
    quality: bool,
    exc: Exception,
    delay_ms: float | None,
    hub_mbit: float | None = None,
) -> Row:
    """The row of a method whose run failed: what failed, and no numbers."""
    notes = "\n".join(getattr(exc, "__notes__", []))
    return {
        "method": method.name,
        "rate_mbit": rate_mbit,
        "delay_ms": delay_ms,
        "hub_mbit": hub_mbit,
        "quality_pass": quality,
        "error": f"{type(exc).__name__}: {str(exc)[-1500:]}\n{notes[-1500:]}",
    }


def _with_utilization(rows: list[Row]) -> list[Row]:
    """Utilization = samples/s over the no-sync reference's of the same pass and link."""
    for row in rows:
        if "error" in row:
            continue
        reference = [
            r
            for r in rows
            if r["method"] == "nosync"
            and r["rate_mbit"] == row["rate_mbit"]
            and r.get("delay_ms") == row.get("delay_ms")
            and r.get("hub_mbit") == row.get("hub_mbit")
            and r["quality_pass"] == row["quality_pass"]
            and "error" not in r
        ]
        row["utilization"] = (
            row["samples_per_s"] / reference[0]["samples_per_s"] if reference else None
        )
    return rows


def _target(
    name: str, measured: float | None, target: float, higher_is_better: bool, text: str
) -> dict[str, Any]:
    if measured is None:
        return {
            "target": name,
            "measured": None,
            "goal": target,
            "result": "NOT MEASURED",
            "text": text,
        }
    passed = measured >= target if higher_is_better else measured <= target
    return {
        "target": name,
        "measured": measured,
        "goal": target,
        "result": "PASS" if passed else "MISS",
        "text": text,
    }


def _row(
    rows: list[Row],
    method: str,
    rate: float | None,
    quality: bool,
    delay: float | None = None,
    hub: float | None = None,
) -> Row | None:
    found = [
        r
        for r in rows
        if r["method"] == method
        and r["rate_mbit"] == rate
        and r.get("delay_ms") == delay
        and r.get("hub_mbit") == hub
        and r["quality_pass"] == quality
        and "error" not in r
    ]
    return found[0] if found else None


def scorecard(rows: list[Row]) -> list[dict[str, Any]]:
    """The issue's targets at 100 Mbit/s (and the loss at equal samples, from the quality
    pass), each PASS / MISS with its measured value.

    The rows at 100 Mbit/s + `TARGET_DELAY_MS` are used where they exist (the issue states
    its targets with a 100 ms round trip), else those of the undelayed 100 Mbit/s link."""
    rate = TARGET_RATE_MBIT
    delayed = any(
        r["rate_mbit"] == rate
        and r.get("delay_ms") == TARGET_DELAY_MS
        and not r.get("hub_mbit")
        and "error" not in r
        for r in rows
    )
    delay = TARGET_DELAY_MS if delayed else None
    link = _link_label(rate, delay)
    h50 = _row(rows, "diloco-h50-int8", rate, False, delay)
    streaming = _row(rows, "streaming-f4-int8", rate, False, delay)
    gloo = _row(rows, "ddp-gloo", rate, False, delay)
    gradsync_ddp = _row(rows, "gradsync-ddp", rate, False, delay)
    cards = [
        _target(
            f"utilization, DiLoCo H=50 int8, {link}",
            h50["utilization"] if h50 else None,
            0.90,
            True,
            "samples/s / no-sync samples/s",
        ),
        _target(
            f"utilization, streaming F=4 int8, {link}",
            streaming["utilization"] if streaming else None,
            0.95,
            True,
            "samples/s / no-sync samples/s",
        ),
    ]
    compact = _row(rows, "diloco-h50-int8x2", rate, False, delay)
    compact_h100 = _row(rows, "diloco-h100-int8x2", rate, False, delay)
    if compact is not None:
        cards.append(
            _target(
                f"utilization, DiLoCo H=50 int8 with an int8 answer, {link}",
                compact.get("utilization"),
                0.90,
                True,
                "samples/s / no-sync samples/s",
            )
        )
    candidates = [
        (h50, "DiLoCo H=50 int8"),
        (streaming, "streaming F=4 int8"),
        *(((compact, "DiLoCo H=50 int8 + int8 answer"),) if compact else ()),
        *(((compact_h100, "DiLoCo H=100 int8 + int8 answer"),) if compact_h100 else ()),
    ]
    for reference, name in ((gloo, "torch DDP + gloo"), (gradsync_ddp, "gradsync DDP")):
        for candidate, label in candidates:
            measured = None
            if reference and candidate and candidate["link_bytes_per_step"] > 0:
                measured = reference["link_bytes_per_step"] / candidate["link_bytes_per_step"]
            cards.append(
                _target(
                    f"bytes/inner step reduction, {label} vs {name}, {link}",
                    measured,
                    400.0,
                    True,
                    "reference's eth0 up+down bytes per step / candidate's (goal: >= 400x)",
                )
            )
    ddp_quality = _row(rows, "ddp-gloo", None, True)
    for method in ("diloco-h10-fp32", "diloco-h10-int8"):
        candidate = _row(rows, method, None, True)
        measured = None
        if ddp_quality and candidate:
            measured = abs(candidate["held_out_loss"] / ddp_quality["held_out_loss"] - 1)
        cards.append(
            _target(
                f"held-out loss within 2 % of DDP's at equal samples, {method}",
                measured,
                0.02,
                False,
                "|loss / DDP's loss - 1|, quality pass (links unshaped)",
            )
        )
    return cards + torchft_cards(rows)


def torchft_cards(rows: list[Row]) -> list[dict[str, Any]]:
    """gradsync's DiLoCo H = 50 against torchft's on every link torchft ran on: samples/s
    over torchft's, fp32 against fp32 (goal 1.0: equal wire bits on equal links), and on
    the hub link (the coordinator host faster than the workers) also the int8 wire with the
    int8 answer (goal 1.3 for both there)."""
    cards: list[dict[str, Any]] = []
    # One card per link (a link run twice is compared at its first pass).
    links = dict.fromkeys(
        (r["rate_mbit"], r.get("delay_ms"), r.get("hub_mbit"))
        for r in rows
        if r["method"] == "torchft-h50-fp32" and not r["quality_pass"] and "error" not in r
    )
    for rate, delay, hub in links:
        torchft = _row(rows, "torchft-h50-fp32", rate, False, delay, hub)
        assert torchft is not None
        mine = ["diloco-h50-fp32", *(("diloco-h50-int8x2",) if hub else ())]
        for method in mine:
            candidate = _row(rows, method, rate, False, delay, hub)
            measured = candidate["samples_per_s"] / torchft["samples_per_s"] if candidate else None
            cards.append(
                _target(
                    f"gradsync {method} vs torchft H=50 fp32, {_link_label(rate, delay, hub)}",
                    measured,
                    1.3 if hub else 1.0,
                    True,
                    "gradsync samples/s / torchft samples/s",
                )
            )
    return cards


def wan_suite(plan: WanPlan) -> tuple[dict[str, Any], str]:
    """Every selected method at every rate (and the quality pass); ({rows, scorecard}, reason).

    Returns empty rows and the reason when namespaces cannot be built here.
    """
    ok, reason = available()
    if not ok:
        return {"rows": [], "scorecard": []}, reason
    unknown = [m for m in plan.methods if m not in METHODS]
    if unknown:
        raise ValueError(f"unknown wan methods {unknown}; choose from {', '.join(METHODS)}")
    topology = Topology("single", plan.world_size, 1)
    links = plan.links()
    hub_delay = plan.hub_link[1] if plan.hub_link else None
    delayed = any(delay for _, delay in links) or bool(hub_delay)
    if delayed:
        ok, reason = delay_available()
        if not ok:
            return {"rows": [], "scorecard": []}, reason
    passes: list[tuple[float | None, float | None, float | None, bool, list[Method]]] = [
        (rate, delay, None, False, plan.methods_at(rate, False)) for rate, delay in links
    ]
    if plan.hub_link is not None:
        workers, delay_ms, hub_mbit = plan.hub_link
        hub_methods = plan.methods_at(workers, False, hub=True)
        passes.append((workers, delay_ms or None, hub_mbit, False, hub_methods))
    if plan.quality_steps > 0:
        passes.append((None, None, None, True, plan.methods_at(None, True)))
    rows: list[Row] = []
    for rate, delay, hub, quality, selected in passes:
        shape = LinkShape(rate_mbit=rate, delay_ms=delay)
        with Cluster(topology.hosts, shape) as cluster:
            if hub:
                shape_hub(cluster, topology.shard_hosts[0], hub)
            for method in selected:
                try:
                    records = run_method(cluster, plan, method, rate, quality, delay, hub)
                except (RuntimeError, TimeoutError, OSError) as exc:
                    # One method's failure is a result too; the others still run.
                    progress(f"    failed: {str(exc)[-500:]}")
                    rows.append(_failed(method, rate, quality, exc, delay, hub))
                    continue
                rows.append(summarize(records, method, rate, quality, delay, hub))
    rows = _with_utilization(rows)
    note = "tc tbf on every host link, both directions"
    if delayed:
        note += (
            "; B + D ms: a one-way delay of D ms per link from a userspace TUN delay line "
            "(round trip host to host 4 D)"
        )
    else:
        note = "bandwidth only (" + note + "); no propagation delay"
    return {"rows": rows, "scorecard": scorecard(rows), "delay_emulated": delayed, "note": note}, ""
