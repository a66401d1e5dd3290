"""`gradsync bench`'s flags turned into a :class:`~gradsync_bench.runner.BenchPlan`."""

from __future__ import annotations

import dataclasses
from typing import Any

from gradsync_bench.runner import BenchPlan

#: The plan's fields each override flag sets (by the flag's dest), besides the latency
#: plan's (`_LATENCY`) and the churn plan's (`--churn-<field>`).
_OVERRIDES = {
    "sizes_mb": ("sizes_mb", "netns_sizes_mb", "heal_states_mb"),  # heal: the live state's size
    "worlds": ("worlds", "train_worlds", "netns_worlds", "heal_worlds"),
    "reps": ("reps", "netns_reps"),
    "layouts": ("netns_layouts",),
    "shards": ("netns_shards",),
    **{
        name: (name,)
        for name in (
            *("train_model_mb", "train_steps", "netns_rate_mbit", "netns_wires", "wan_world"),
            *("wan_rates_mbit", "wan_delays_ms", "wan_methods", "wan_steps", "wan_sync_steps"),
            *("wan_quality_steps", "wan_hub"),
        )
    },
}
_LATENCY = {"worlds": "worlds", "reps": "reps", "train_steps": "steps"}
_CHURN = ("duration_s", "interval_s", "kinds", "shards", "work_dir")


def plan_from_args(args: Any) -> BenchPlan:
    """The plan `gradsync bench`'s flags ask for: a preset, then each override given."""
    plan = BenchPlan.quick() if args.quick else BenchPlan()
    given = {name: value for name, value in vars(args).items() if value is not None}
    overrides: dict[str, Any] = {"suites": args.suites}
    for flag, fields in _OVERRIDES.items():
        if flag in given:
            overrides.update(dict.fromkeys(fields, given[flag]))
    if "shards" in given:
        overrides["loopback_shards"] = sorted({1, *given["shards"]})
    latency = {field: given[flag] for flag, field in _LATENCY.items() if flag in given}
    if latency:
        if "worlds" in latency:
            latency["worlds"] = tuple(latency["worlds"])
        overrides["latency"] = dataclasses.replace(plan.latency, **latency)
    churn = {name: given[f"churn_{name}"] for name in _CHURN if f"churn_{name}" in given}
    if churn:
        overrides["churn"] = dataclasses.replace(plan.churn, **churn)
    return dataclasses.replace(plan, **overrides)
