"""Writing a rank's state for checkpoints and healing, and reading one back into a model.

Apart from `gradsync.control.session` so that the session keeps the rules of
joining and reconnecting, and this module the checks a blob from the network
must pass: a checkpoint is read with `torch.load(weights_only=True)` only; a
live rank's state offered for a direct transfer (`heal_channel`) is read as a
raw state, bounded by this model's size; every failure becomes a
`CheckpointMismatchError` that names the job and the step (torch's own errors
name neither, and suggest `weights_only=False`, which gradsync never uses).
"""

from __future__ import annotations

import io
import logging
import os
from typing import Any

import torch
from torch import nn

from gradsync.config import ClientConfig
from gradsync.control import heal_channel
from gradsync.control.link import SessionLink
from gradsync.errors import CheckpointMismatchError

log = logging.getLogger("gradsync.client")

#: Workers: "0" sends a healing state through the coordinator (gRPC) even on loopback.
ENV_HEAL_CHANNEL = "GRADSYNC_HEAL_CHANNEL"
#: An optimizer keeps a few tensors per parameter (Adam two, amsgrad three): the most
#: tensor bytes a healing state may have is this many times the module's, plus a margin.
_OPTIMIZER_FACTOR = 4
_MARGIN_BYTES = 64 << 20
#: How long a donor waits for the first joiner to come for its live state (it comes
#: within milliseconds of the coordinator relaying the offer; longer means it is gone,
#: or the coordinator asked again for another step).
_FIRST_FETCH_WAIT_S = 5.0
#: How long the donor serves the snapshot to other joiners (those healed together come
#: at once; its memory, one copy of the state, goes back then).
_SERVE_S = 60.0


def live_state(
    module: nn.Module, optimizer: torch.optim.Optimizer | None, step: int, world_size: int
) -> dict[str, Any]:
    """Module state, optimizer state and step: what a checkpoint or a healing holds."""
    return {
        "module": module.state_dict(),
        "optimizer": optimizer.state_dict() if optimizer is not None else None,
        "step": step,
        "world_size": world_size,
    }


def torch_blob(state: dict[str, Any]) -> bytes:
    """`state` serialized by `torch.save` (checkpoints: readable by torch alone)."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    return buffer.getvalue()


def send_heal_state(
    link: SessionLink,
    config: ClientConfig,
    module: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    step: int,
    previous: heal_channel.StateOffer | None,
) -> heal_channel.StateOffer | None:
    """Upload this rank's state for the ranks it heals; return its offer while served.

    With the coordinator on this host (a loopback address) the upload is an
    offer of a direct transfer (`heal_channel`): this waits, bounded, for the
    first joiner to read the live state, so that nothing else competes with
    the transfer, then returns once a snapshot serves any other joiner. Else
    (a remote coordinator: the joiner may be on another host, or
    `$GRADSYNC_HEAL_CHANNEL=0`) the state itself goes through the coordinator.
    """
    if previous is not None:
        previous.close()
    state = live_state(module, optimizer, step, config.world_size)
    flag = os.environ.get(ENV_HEAL_CHANNEL, "").strip().lower()
    loopback = all(heal_channel.loopback_host(a) for a in config.coordinator.split(","))
    if flag in ("0", "false", "no", "off") or not loopback:
        link.send_heal(step, torch_blob(state))
        return None
    offer = heal_channel.StateOffer(state, serve_s=_SERVE_S)
    link.send_heal(step, offer.offer())
    if not offer.settle(wait_s=min(_FIRST_FETCH_WAIT_S, config.join_timeout_s)):
        log.warning(
            "rank %d: no rank came for the state it offered within %gs; training on",
            config.rank,
            _FIRST_FETCH_WAIT_S,
        )
    return offer


def load_optimizer_state(
    optimizer: torch.optim.Optimizer, state: Any, job_id: str, rank: int, step: int
) -> None:
    """Restore a checkpoint's optimizer state; a mismatch names job and step."""
    try:
        optimizer.load_state_dict(state)
    except (RuntimeError, ValueError, TypeError, KeyError) as exc:
        raise mismatch(
            job_id, rank, step, f"its optimizer state does not fit this optimizer: {brief(exc)}"
        ) from exc


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


def load_module_state(
    blob: bytes, module: nn.Module, job_id: str, rank: int, step: int, timeout_s: float = 60.0
) -> Any:
    """Load `blob`'s module state into `module`; return its optimizer state (or None).

    `blob` is a checkpoint, a live rank's state, or a live rank's offer of its
    state (`heal_channel`): then the state is fetched from it (within `timeout_s`).

    Raises:
        CheckpointMismatchError: the blob is not a gradsync checkpoint, or not this model's,
            or the offered state could not be fetched.
    """
    if heal_channel.is_offer(blob):
        return _load_offered(blob, module, job_id, rank, step, timeout_s)
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
    return _apply(state, module, job_id, rank, step)


def _load_offered(
    offer: bytes, module: nn.Module, job_id: str, rank: int, step: int, timeout_s: float
) -> Any:
    """Fetch an offered state (bounded by this model's size) and load it."""
    own = sum(t.numel() * t.element_size() for t in module.state_dict().values())
    limit = _OPTIMIZER_FACTOR * own + _MARGIN_BYTES
    try:
        state = heal_channel.fetch(offer, limit, timeout_s)
    except heal_channel.HealChannelError as exc:  # not a mismatch: the donor may be gone
        raise CheckpointMismatchError(
            f"rank {rank} could not read a live rank's state of step {step} to rejoin job "
            f"'{job_id}': {exc}. Start this rank again to rejoin (another live rank donates)",
            job_id=job_id,
            rank=rank,
            step=step,
        ) from exc
    log.info("rank %d: fetched a live rank's state of step %d directly (loopback)", rank, step)
    return _apply(state, module, job_id, rank, step)


def _apply(state: Any, module: nn.Module, job_id: str, rank: int, step: int) -> Any:
    """Load a state tree's module state into `module`; return its optimizer state."""
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
