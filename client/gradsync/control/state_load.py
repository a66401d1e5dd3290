"""Reading a resume blob (a checkpoint, or a live rank's state) back into a model.

Apart from `gradsync.control.session` so that the session keeps the rules of
joining and reconnecting, and this module the checks a blob from the network
must pass: it is read with `torch.load(weights_only=True)` only, and every
failure becomes a `CheckpointMismatchError` that names the job and the step
(torch's own errors name neither, and suggest `weights_only=False`, which
gradsync never uses).
"""

from __future__ import annotations

import io
from typing import Any

import torch
from torch import nn

from gradsync.errors import CheckpointMismatchError


def mismatch(job_id: str, rank: int, step: int, why: str) -> CheckpointMismatchError:
    """The error for a blob that cannot be restored, with what to do about it."""
    return CheckpointMismatchError(
        f"cannot resume job '{job_id}' from the checkpoint of step {step}: {why}. Was "
        "another model trained under the same job id? Use another job id, or start the "
        "coordinator with --fresh-start",
        job_id=job_id,
        rank=rank,
        step=step,
    )


def load_module_state(blob: bytes, module: nn.Module, job_id: str, rank: int, step: int) -> Any:
    """Load `blob`'s module state into `module`; return its optimizer state (or None).

    Raises:
        CheckpointMismatchError: the blob is not a gradsync checkpoint, or not this model's.
    """
    try:
        # weights_only: tensors and plain containers, never arbitrary objects.
        state = torch.load(io.BytesIO(blob), weights_only=True)
    except Exception as exc:  # UnpicklingError, RuntimeError (not a zip), EOFError, ...
        raise mismatch(
            job_id,
            rank,
            step,
            f"it is not a gradsync checkpoint ({len(blob)} bytes that "
            f"torch.load(weights_only=True) cannot read: {type(exc).__name__})",
        ) from exc
    if not isinstance(state, dict) or not isinstance(state.get("module"), dict):
        raise mismatch(
            job_id,
            rank,
            step,
            f"it is not a gradsync checkpoint (a {type(state).__name__} without the "
            "'module' state dict that gradsync saves)",
        )
    try:
        module.load_state_dict(state["module"])
    except (RuntimeError, ValueError, TypeError, KeyError) as exc:
        raise mismatch(job_id, rank, step, f"it does not fit this model: {brief(exc)}") from exc
    return state.get("optimizer")


def brief(exc: BaseException, limit: int = 300) -> str:
    """torch's multi-line error text on one line, bounded."""
    text = " ".join(str(exc).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."
