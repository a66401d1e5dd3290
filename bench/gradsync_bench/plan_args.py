"""`gradsync bench`'s flags turned into a :class:`~gradsync_bench.runner.BenchPlan`."""

from __future__ import annotations

import dataclasses
from typing import Any

from gradsync_bench.runner import BenchPlan


def plan_from_args(args: Any) -> BenchPlan:
    """The plan `gradsync bench`'s flags ask for: a preset, then each override given."""
    plan = BenchPlan.quick() if args.quick else BenchPlan()
    overrides: dict[str, Any] = {"suites": args.suites}
    latency: dict[str, Any] = {}
    if args.sizes_mb:
        overrides.update(sizes_mb=args.sizes_mb, netns_sizes_mb=args.sizes_mb)
        overrides["heal_states_mb"] = args.sizes_mb  # the live state's size there
    if args.worlds:
        overrides.update(worlds=args.worlds, train_worlds=args.worlds, netns_worlds=args.worlds)
        overrides["heal_worlds"] = args.worlds
        latency["worlds"] = tuple(args.worlds)
    if args.reps:
        overrides.update(reps=args.reps, netns_reps=args.reps)
        latency["reps"] = args.reps
    if args.train_model_mb:
        overrides["train_model_mb"] = args.train_model_mb
    if args.train_steps:
        overrides["train_steps"] = latency["steps"] = args.train_steps
    if args.netns_rate_mbit:
        overrides["netns_rate_mbit"] = args.netns_rate_mbit
    if getattr(args, "netns_wires", None):
        overrides["netns_wires"] = tuple(args.netns_wires)
    if args.layouts:
        overrides["netns_layouts"] = args.layouts
    if args.shards:
        overrides.update(netns_shards=args.shards, loopback_shards=sorted({1, *args.shards}))
    for name in (
        "wan_world",
        "wan_rates_mbit",
        "wan_delays_ms",
        "wan_methods",
        "wan_steps",
        "wan_sync_steps",
        "wan_quality_steps",
        "wan_hub",
    ):
        value = getattr(args, name, None)
        if value is not None:
            overrides[name] = tuple(value) if name == "wan_methods" else value
    churn = {
        "duration_s": getattr(args, "churn_duration_s", None),
        "interval_s": getattr(args, "churn_interval_s", None),
        "kinds": getattr(args, "churn_kinds", None),
        "shards": getattr(args, "churn_shards", None),
        "work_dir": getattr(args, "churn_work_dir", None),
    }
    churn_overrides = {name: value for name, value in churn.items() if value is not None}
    if latency:
        overrides["latency"] = dataclasses.replace(plan.latency, **latency)
    if churn_overrides:
        overrides["churn"] = dataclasses.replace(plan.churn, **churn_overrides)
    return dataclasses.replace(plan, **overrides)
