"""`gradsync.DiLoCo`'s settings: the outer optimizer, the wire, streaming, stragglers.

Turns the keyword arguments into the `pb.OuterOptimizer` the coordinator runs
(straggler settings: `gradsync_server.dataplane.rounds`) and the options of
each fragment's wrapper, checking each here first so that a mistake is a
`ValueError` naming the setting at construction rather than a refused job.
The coordinator checks them again (it trusts no client).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from gradsync_proto.v1 import gradsync_pb2 as pb

from gradsync.hooks import WIRE_DTYPE_HOOKS
from gradsync.path.signature import WIRE_DTYPES

__all__ = [
    "LATE_POLICIES",
    "SCREEN_POLICIES",
    "check_outer",
    "check_samples",
    "check_screen",
    "compact_answer_dtype",
    "flatten_options",
    "outer_optimizer",
    "straggler_settings",
    "streaming_mixing",
]

#: How the coordinator screens pseudo-gradients, from the weakest to the strictest.
SCREEN_POLICIES = ("report", "clip", "exclude", "trimmed_mean", "median")


def check_screen(screen: str) -> str:
    """`screen`, if it is a screen policy.

    Raises:
        ValueError: it is not (names the allowed ones).
    """
    if screen not in SCREEN_POLICIES:
        raise ValueError(f"screen must be one of {', '.join(SCREEN_POLICIES)}, got {screen!r}")
    return screen


#: What becomes of a contribution whose round closed without it.
LATE_POLICIES = ("drop", "merge")


def check_outer(
    sync_every: int,
    outer_lr: float,
    outer_momentum: float,
    wire_dtype: torch.dtype | None,
    error_feedback: bool | None,
) -> None:
    """Check the settings every DiLoCo has.

    Raises:
        ValueError: a setting out of range, naming it and its value.
    """
    if isinstance(sync_every, bool) or not isinstance(sync_every, int) or sync_every < 1:
        raise ValueError(f"sync_every must be an integer >= 1, got {sync_every!r}")
    if not (math.isfinite(outer_lr) and outer_lr > 0):
        raise ValueError(f"outer_lr must be finite and > 0, got {outer_lr!r}")
    if not (math.isfinite(outer_momentum) and 0 <= outer_momentum < 1):
        raise ValueError(f"outer_momentum must be in [0, 1), got {outer_momentum!r}")
    if wire_dtype is not None and wire_dtype not in (*WIRE_DTYPE_HOOKS, torch.int8):
        raise ValueError(
            f"wire_dtype={wire_dtype!r} is not supported: None (float32), torch.bfloat16, "
            "torch.float16 or torch.int8"
        )
    if error_feedback and wire_dtype is None:
        raise ValueError(
            "error_feedback needs a 16-bit or int8 wire_dtype: a float32 wire loses nothing"
        )


def compact_answer_dtype(
    wire_dtype: torch.dtype | None,
    answer_dtype: torch.dtype | str | None,
    min_contributors: int | None = None,
) -> torch.dtype | None:
    """The compact answer's dtype (None = exact float32), after checking it fits the wire.

    "auto" (DiLoCo's default) answers an int8 wire in int8: a quarter of the bytes down
    for a rounding the next answer carries forward, and an int8 wire's job is flat already.
    Every other wire, and partial rounds (`min_contributors`, which answer a late rank with
    the exact parameters), get the exact float32 answer. The choice depends only on
    settings every rank shares, so all ranks resolve it alike.
    """
    if answer_dtype == "auto":
        return torch.int8 if wire_dtype is torch.int8 and not min_contributors else None
    if isinstance(answer_dtype, str):
        raise ValueError(
            f'answer_dtype={answer_dtype!r} is not supported: "auto", None (float32), '
            "torch.int8 or torch.bfloat16"
        )
    if answer_dtype is None or answer_dtype is torch.float32:
        return None
    if answer_dtype not in (torch.int8, torch.bfloat16):
        raise ValueError(
            f"answer_dtype={answer_dtype!r} is not supported: None (float32), torch.int8 "
            "or torch.bfloat16"
        )
    if wire_dtype is not answer_dtype:
        raise ValueError(
            f"answer_dtype={answer_dtype!r} needs wire_dtype={answer_dtype!r} (the answer to "
            f"each uploaded chunk travels on its grid), got wire_dtype={wire_dtype!r}"
        )
    return answer_dtype


def streaming_mixing(
    sync_every: int, fragments: int, overlap_steps: int, mixing: float | None
) -> float:
    """The merge's mixing factor, after checking the streaming settings."""
    if isinstance(fragments, bool) or not isinstance(fragments, int) or fragments < 1:
        raise ValueError(f"fragments must be an integer >= 1, got {fragments!r}")
    if fragments > sync_every:
        raise ValueError(
            f"fragments={fragments} is more than sync_every={sync_every}: each fragment "
            "needs an inner step of its own to synchronize at"
        )
    if not isinstance(overlap_steps, int) or not 0 <= overlap_steps < sync_every:
        raise ValueError(
            f"overlap_steps must be an integer in [0, sync_every={sync_every}), "
            f"got {overlap_steps!r}"
        )
    if mixing is None:
        return 1.0 if overlap_steps == 0 else 0.5
    if not (math.isfinite(mixing) and 0 < mixing <= 1):
        raise ValueError(f"mixing must be in (0, 1], got {mixing!r}")
    return mixing


def straggler_settings(
    min_contributors: int | None,
    round_deadline_s: float | str | None,
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
    auto = isinstance(round_deadline_s, str)
    if auto and round_deadline_s != "auto":
        raise ValueError(
            f'round_deadline_s must be a number of seconds or "auto", got {round_deadline_s!r}'
        )
    if round_deadline_s is not None and min_contributors is None:
        min_contributors = 1  # a deadline alone: close with whoever made it
    if min_contributors is not None:
        if isinstance(min_contributors, bool) or not isinstance(min_contributors, int):
            raise ValueError(f"min_contributors must be an integer >= 1, got {min_contributors!r}")
        if min_contributors < 1 or (world_size is not None and min_contributors > world_size):
            raise ValueError(
                f"min_contributors must be in [1, world_size={world_size}], got {min_contributors}"
            )
        if isinstance(round_deadline_s, bool):
            raise ValueError(
                f"round_deadline_s must be a number of seconds, got {round_deadline_s!r}"
            )
        deadline = 0.0 if round_deadline_s is None or auto else float(round_deadline_s)
        if not (math.isfinite(deadline) and deadline >= 0):
            raise ValueError(f"round_deadline_s must be finite and >= 0, got {round_deadline_s!r}")
        fields.update(min_contributors=min_contributors, round_deadline_s=deadline)
        if auto:
            fields["round_deadline_auto"] = True
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


def outer_optimizer(
    lr: float,
    momentum: float,
    nesterov: bool,
    answer_dtype: torch.dtype | None,
    stragglers: dict[str, Any],
) -> pb.OuterOptimizer:
    """The outer optimizer the coordinator runs (checked by `check_outer`, `straggler_settings`)."""
    return pb.OuterOptimizer(
        lr=lr,
        momentum=momentum,
        nesterov=nesterov and momentum > 0,
        answer_dtype=0 if answer_dtype is None else WIRE_DTYPES[answer_dtype],  # type: ignore[arg-type]  # an int is a DType
        **stragglers,
    )


def flatten_options(
    outer: pb.OuterOptimizer,
    fragments: int,
    wire_dtype: torch.dtype | None,
    answer_dtype: torch.dtype | None,
    options: dict[str, Any],
) -> None:
    """Turn `hierarchical` off in the wrappers' `options` where the rounds need flat ranks.

    Raises:
        ValueError: partial rounds with several fragments or a compact answer, or
            `hierarchical` asked for with settings a local group cannot serve.
    """
    if outer.min_contributors and fragments > 1:
        raise ValueError(
            f"partial rounds (min_contributors={outer.min_contributors}) are not possible "
            f"with fragments={fragments} yet: pass fragments=1"
        )
    if outer.min_contributors and answer_dtype is not None:
        raise ValueError(
            f"partial rounds (min_contributors={outer.min_contributors}) are not possible "
            f"with answer_dtype={answer_dtype!r} yet (a late rank is answered with the "
            "global parameters, not the public copy): pass answer_dtype=None"
        )
    summed = "a local group sums its ranks before the coordinator sees them"
    if outer.min_contributors or outer.weighted:
        _flat(options, "partial or weighted rounds", summed)
    if outer.screen not in ("", "report"):
        if outer.weighted or outer.merge_late:
            raise ValueError(
                f"screen={outer.screen!r} is not possible with weighted rounds or "
                "late='merge' (it screens each rank's own unweighted pseudo-gradient)"
            )
        _flat(options, f"screen={outer.screen!r}", summed)
    if wire_dtype is torch.int8 or answer_dtype is not None:
        setting = "wire_dtype=torch.int8" if wire_dtype is torch.int8 else "answer_dtype"
        _flat(options, setting, "a local group sums and answers in full precision")


def _flat(options: dict[str, Any], setting: str, why: str) -> None:
    """Turn `hierarchical` off in `options`, which `setting` needs (`why`: why it does).

    Raises:
        ValueError: `hierarchical` was asked for (naming `setting`).
    """
    if options.get("hierarchical") not in (None, False):
        raise ValueError(
            f"hierarchical={options['hierarchical']!r} is not possible with {setting} "
            f"({why}): pass hierarchical=False"
        )
    options["hierarchical"] = False


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
