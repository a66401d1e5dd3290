"""The churn suite's Markdown: the end checks, throughput, memory, and each failure kind."""

from __future__ import annotations

from typing import Any

from gradsync_bench.churn_profile import medians


def _seconds(stats: dict[str, Any] | None) -> str:
    """ "median / max (n)" of a per-kind timing, "-" when there is none."""
    if not stats:
        return "-"
    return f"{stats['median']:.2f} / {stats['max']:.2f} ({stats['n']})"


def _mib(stats: dict[str, float]) -> str:
    return f"{stats['first']:.0f} / {stats['last']:.0f} / {stats['max']:.0f}"


def end_checks(run: dict[str, Any]) -> list[str]:
    """The end checks every churn cluster's run has: the replicas, each step applied once."""
    once = run["applied_once"]
    replicas = run["replicas"]
    return [
        f"replicas {'identical' if replicas['ok'] else 'DIFFER'} "
        f"({len(replicas['live_ranks'])} live, {replicas['distinct_digests']} digest(s))",
        f"steps applied {once['steps_applied']} == advanced {once['steps_advanced']}"
        if once["ok"]
        else f"APPLIED TWICE OR SKIPPED: {once['problems'][:3]}",
    ]


def kind_rows(per_kind: dict[str, Any], header: str) -> list[str]:
    """The per-failure-kind table under `header` (its seven columns' names)."""
    lines = [header, "|---|---|---|---|---|---|---|"]
    for kind, entry in per_kind.items():
        lines.append(
            f"| {kind} | {entry['count']} | {_seconds(entry['detect_s'])} | "
            f"{_seconds(entry['recover_s'])} | {_seconds(entry['longest_stall_s'])} | "
            f"{_seconds(entry['rank_back_s'])} | {entry['recomputed']} |"
        )
    return lines


def _check(run: dict[str, Any]) -> str:
    replay = run["replay"]
    words = end_checks(run)
    if "max_relative_error" in replay:
        words.append(
            "replay "
            + (
                "bitwise equal"
                if replay["bitwise"]
                else f"max rel. error {replay['max_relative_error']:.1e}"
            )
            + ("" if replay["ok"] else " (FAILED)")
        )
    else:
        words.append(f"replay FAILED: {replay.get('error')}")
    if replay.get("unresolved_count"):
        words.append(f"{replay['unresolved_count']} step(s) of unknown contributors")
    return "; ".join(words)


def markdown_lines(suite: dict[str, Any]) -> list[str]:
    """The suite's section; nothing when it did not run."""
    if not suite:
        return []
    plan = suite["plan"]
    lines = [
        f"**Churn soak** (W = {plan['world_size']}, elastic, a standby coordinator, "
        f"--shards {plan['shards']}, real Redis; {plan['duration_s']:g} s with a failure "
        f"every {plan['interval_s']:g} s cycling over {', '.join(plan['kinds'])}; against a "
        "churn-free run of the same length)",
        "",
        "| run | steps/s | steps | end checks | coordinator RSS MiB first / last / max "
        "(longest-lived leader; with its shards) |",
        "|---|---|---|---|---|",
    ]
    for name in ("baseline", "churn"):
        run = suite[name]
        longest = run["coordinator_rss"]["longest_lived"]
        memory = (
            f"{_mib(longest['leader_mib'])}; {_mib(longest['with_shards_mib'])} "
            f"(lived {longest['lived_s']:.0f} s)"
            if longest
            else "-"
        )
        lines.append(
            f"| {name} | {run['steps_per_s']:.1f} | {run['steps_in_window']} | "
            f"{_check(run)} | {memory} |"
        )
    ratio = suite["steps_per_s_ratio"]
    lines += [
        "",
        f"Steps/s under churn / churn-free: {ratio:.2f} (goal >= 0.80)."
        if ratio is not None
        else "Steps/s ratio: no churn-free steps.",
        "",
        *kind_rows(
            suite["churn"]["per_kind"],
            "| failure | count | detect s (median / max (n)) | training again s | longest stall s "
            "| restarted rank training again s | steps computed again |",
        ),
    ]
    lines += profile_lines(suite["churn"].get("profile"))
    skipped = suite["churn"].get("injections_skipped") or []
    if skipped:
        lines += ["", f"Failures not injected (no target): {'; '.join(skipped[:5])}"]
    errors = suite["churn"].get("injection_errors") or []
    if errors:
        lines.append("")
        lines.append(f"Injections that failed: {'; '.join(errors[:5])}")
    lines.append("")
    return lines


def _at(stats: dict[str, float], key: str) -> str:
    return f"{stats[key]:.2f}" if key in stats else "-"


def profile_lines(profile: dict[str, Any] | None) -> list[str]:
    """The medians of the rejoins' and the takeovers' timelines (`churn_profile`)."""
    if not profile:
        return []
    lines: list[str] = []
    rejoins, takeovers = profile["rejoins"], profile["takeovers"]
    if rejoins:
        m = medians(rejoins)
        lines += [
            "",
            f"Rejoins ({len(rejoins)}; median s from the process start, after its imports): "
            f"admitted {_at(m, 'admitted_s')}, wrapper built and optimizer registered "
            f"{_at(m, 'joined_s')}, first step applied {_at(m, 'first_applied_s')}; the "
            f"other ranks waited {_at(m, 'others_waited_s')} s at the admission.",
        ]
    if takeovers:
        m = medians(takeovers)
        lines += [
            "",
            f"Takeovers ({len(takeovers)}; median s from the kill): local shards started "
            f"{_at(m, 'shards_started_s')}, lease taken {_at(m, 'took_over_s')}, ranks joined "
            f"{_at(m, 'first_rank_joined_s')}-{_at(m, 'last_rank_joined_s')}, shards "
            f"registered {_at(m, 'shards_registered_s')}, job continued "
            f"{_at(m, 'continued_s')}, first step {_at(m, 'first_step_s')}.",
        ]
    return lines
