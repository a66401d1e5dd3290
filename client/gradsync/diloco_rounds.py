"""`gradsync.DiLoCo`'s straggler settings: partial rounds, late contributions, weights.

Turns the keyword arguments into the `pb.OuterOptimizer` fields the
coordinator runs them with (`gradsync_server.dataplane.rounds`), checking each
here first so that a mistake is a `ValueError` naming the setting at
construction rather than a refused job. The coordinator checks them again
(it trusts no client).
"""

from __future__ import annotations

import math
from typing import Any

__all__ = ["LATE_POLICIES", "check_samples", "straggler_settings"]

#: What becomes of a contribution whose round closed without it.
LATE_POLICIES = ("drop", "merge")


def straggler_settings(
    min_contributors: int | None,
    round_deadline_s: float | None,
    late: str,
    max_staleness: int | None,
    weighted: bool,
    world_size: int | None,
) -> dict[str, Any]:
    """The `pb.OuterOptimizer` fields of these settings (all unset: every round waits for all).

    Raises:
        ValueError: a setting out of range, or one that needs another (naming both).
    """
    fields: dict[str, Any] = {}
    if round_deadline_s is not None and min_contributors is None:
        min_contributors = 1  # a deadline alone: close with whoever made it
    if min_contributors is not None:
        if isinstance(min_contributors, bool) or not isinstance(min_contributors, int):
            raise ValueError(f"min_contributors must be an integer >= 1, got {min_contributors!r}")
        if min_contributors < 1 or (world_size is not None and min_contributors > world_size):
            raise ValueError(
                f"min_contributors must be in [1, world_size={world_size}], got {min_contributors}"
            )
        deadline = 0.0 if round_deadline_s is None else float(round_deadline_s)
        if not (math.isfinite(deadline) and deadline >= 0):
            raise ValueError(f"round_deadline_s must be finite and >= 0, got {round_deadline_s!r}")
        fields.update(min_contributors=min_contributors, round_deadline_s=deadline)
    if late not in LATE_POLICIES:
        raise ValueError(f"late must be one of {LATE_POLICIES}, got {late!r}")
    if late == "merge":
        if min_contributors is None:
            raise ValueError(
                'late="merge" needs partial rounds (min_contributors or round_deadline_s): '
                "without them no contribution is ever late"
            )
        staleness = 1 if max_staleness is None else max_staleness
        if isinstance(staleness, bool) or not isinstance(staleness, int) or staleness < 1:
            raise ValueError(f"max_staleness must be an integer >= 1 round, got {max_staleness!r}")
        fields.update(merge_late=True, max_staleness=staleness)
    elif max_staleness is not None:
        raise ValueError(
            f'max_staleness={max_staleness!r} needs late="merge" (late contributions are '
            "dropped otherwise)"
        )
    if not isinstance(weighted, bool):
        raise ValueError(f"weighted must be True or False, got {weighted!r}")
    if weighted:
        fields["weighted"] = True
    return fields


def check_samples(samples: float | None, inner_step: int) -> float:
    """The samples one inner step counts for (1 if not given).

    Raises:
        ValueError: negative, not finite, or not a number.
    """
    if samples is None:
        return 1.0
    if isinstance(samples, bool) or not isinstance(samples, int | float):
        raise ValueError(f"samples must be a number, got {samples!r} at inner step {inner_step}")
    if not (math.isfinite(samples) and samples >= 0):
        raise ValueError(
            f"samples must be finite and >= 0, got {samples!r} at inner step {inner_step}"
        )
    return float(samples)
