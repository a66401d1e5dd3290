"""A rank's state: broadcast at the start, written for checkpoints and healing, read back
into a model, and digested into the position a live rank claims when it rejoins.

Apart from `gradsync.control.session` so that the session keeps the rules of
joining and reconnecting, and this module the checks a blob from the network
must pass: a checkpoint is read with `torch.load(weights_only=True)` only; a
live rank's state offered for a direct transfer (`heal_channel`) is read as a
raw state, bounded by this model's size; every failure becomes a
`CheckpointMismatchError` that names the job and the step (torch's own errors
name neither, and suggest `weights_only=False`, which gradsync never uses).
"""

from __future__ import annotations

import hashlib
import io
import logging
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from gradsync_proto import auth
from gradsync_proto.v1 import gradsync_pb2 as pb
from torch import nn
from torch.nn.modules.batchnorm import _NormBase

from gradsync.config import ClientConfig
from gradsync.control import heal_channel, raw_state
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
#: How long a step's end waits for a joiner still reading the live state (the step
#: needs the joiner, so it normally ended before); then the transfer is cut off.
_RELEASE_WAIT_S = 30.0
#: `_load_from_state_dict`s that copy each tensor (batch norm's adds only version fixes).
_PLAIN_LOADERS = (nn.Module._load_from_state_dict, _NormBase._load_from_state_dict)


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


def broadcast_start_state(
    link: SessionLink,
    rank: int,
    tensors: Sequence[torch.Tensor],
    welcome: pb.Welcome,
    timeout_s: float,
) -> None:
    """Rank 0 sends `tensors` as one blob; every other rank overwrites its own with it."""
    with torch.no_grad():
        if rank == 0:
            flat = [t.detach().reshape(-1).view(torch.uint8).cpu() for t in tensors if t.numel()]
            blob = torch.cat(flat) if flat else torch.empty(0, dtype=torch.uint8)
            link.send_state(blob.numpy())
        elif welcome.state_bytes:
            raw = link.receive_state(welcome.state_bytes, timeout_s)
            offset = 0
            for tensor in tensors:
                if tensor.numel() == 0:
                    continue
                source = torch.frombuffer(
                    raw, dtype=tensor.dtype, count=tensor.numel(), offset=offset
                )
                tensor.copy_(source.view_as(tensor))
                offset += tensor.numel() * tensor.element_size()


def torch_blob(state: dict[str, Any]) -> bytes:
    """`state` serialized by `torch.save` (checkpoints: readable by torch alone)."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    return buffer.getvalue()


class DirectHealError(CheckpointMismatchError):
    """A live rank's direct offer of its state could not be read (the joiner may rejoin
    to be healed through the coordinator instead)."""


class HealDonor:
    """This rank's offer of its state to the ranks it heals, while it is served.

    `release` is called before the parameters or optimizer state change
    (the end of a step's backward, the next step boundary): it waits,
    bounded, for a joiner still reading them (`StateOffer.release`).
    """

    def __init__(self) -> None:
        self._offer: heal_channel.StateOffer | None = None

    def send(
        self,
        link: SessionLink,
        config: ClientConfig,
        module: nn.Module,
        optimizer: torch.optim.Optimizer | None,
        step: int,
        settle: bool,
        relay: bool = False,
    ) -> None:
        """Upload this rank's state of `step` for the ranks it heals; keep its offer while served.

        With the coordinator on this host (a loopback address) the upload is an
        offer of a direct transfer (`heal_channel`). With `settle`, this waits
        (bounded) for the first joiner to read the live state before it returns;
        without, it returns at once and the caller must `release` the offer
        before the parameters or the optimizer state change (the module's
        buffers, which a forward pass changes, are served from a copy). Else (a
        remote coordinator: the joiner may be on another host, or
        `$GRADSYNC_HEAL_CHANNEL=0`, or `relay`: the joiner could not read a direct offer
        before) the state itself goes through the coordinator.
        """
        if self._offer is not None:
            self._offer.close()
            self._offer = None
        state = live_state(module, optimizer, step, config.world_size)
        flag = os.environ.get(ENV_HEAL_CHANNEL, "").strip().lower()
        loopback = all(auth.is_loopback(a) for a in config.coordinator.split(","))
        if flag in ("0", "false", "no", "off") or not loopback or relay:
            # Raw, not pickled: written (and read) in slices, so heartbeats keep going.
            link.send_heal(step, raw_state.to_bytes(state))
            return
        state["module"] = _buffers_copied(module, state["module"])
        offer = self._offer = heal_channel.StateOffer(state, serve_s=_SERVE_S)
        link.send_heal(step, offer.offer())
        if settle and not offer.settle(wait_s=min(_FIRST_FETCH_WAIT_S, config.join_timeout_s)):
            log.warning(
                "rank %d: no rank came for the state it offered within %gs; training on",
                config.rank,
                _FIRST_FETCH_WAIT_S,
            )

    def release(self) -> None:
        """The live tensors are about to change: wait for a transfer of them to end."""
        if self._offer is not None:
            self._offer.release(wait_s=_RELEASE_WAIT_S)

    def close(self) -> None:
        """Stop serving (the rank leaves)."""
        if self._offer is not None:
            self._offer.close()


def _buffers_copied(module: nn.Module, module_state: dict[str, Any]) -> dict[str, Any]:
    """`module_state` with every tensor that is not a parameter copied (buffers: small)."""
    parameters = {p.data_ptr() for p in module.parameters()}
    for name, value in module_state.items():
        if isinstance(value, torch.Tensor) and value.data_ptr() not in parameters:
            module_state[name] = value.clone()
    return module_state


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
    blob: bytes | bytearray,
    module: nn.Module,
    job_id: str,
    rank: int,
    step: int,
    timeout_s: float = 60.0,
) -> Any:
    """Load `blob`'s module state into `module`; return its optimizer state (or None).

    `blob` is a checkpoint, a live rank's state, or a live rank's offer of its
    state (`heal_channel`): then the state is fetched from it (within `timeout_s`).

    Raises:
        CheckpointMismatchError: the blob is not a gradsync checkpoint, or not this model's,
            or the offered state could not be fetched.
    """
    if heal_channel.is_offer(blob) or bytes(blob[: len(raw_state.MAGIC)]) == raw_state.MAGIC:
        return _load_raw(blob, module, job_id, rank, step, timeout_s)  # a live rank's
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


def _load_raw(
    blob: bytes | bytearray, module: nn.Module, job_id: str, rank: int, step: int, timeout_s: float
) -> Any:
    """Read a live rank's state (offered directly, or relayed by the coordinator), bounded
    by this model's size, into this model's own tensors where they fit; load it."""
    offered = heal_channel.is_offer(blob)
    own = module.state_dict()
    limit = _OPTIMIZER_FACTOR * sum(t.numel() * t.element_size() for t in own.values())
    limit += _MARGIN_BYTES
    in_place = _own_targets(module, own)
    read_into_own: list[bool] = []

    def into(layout: raw_state.Layout) -> dict[int, torch.Tensor]:
        targets = in_place(layout)
        read_into_own.append(bool(targets))
        return targets

    try:
        if offered:
            state = heal_channel.fetch(blob, limit, timeout_s, into)
        else:
            state = raw_state.decode(blob, limit, into)
    except heal_channel.HealChannelError as exc:  # not a mismatch: the donor may be gone
        raise DirectHealError(
            f"rank {rank} could not read a live rank's state of step {step} to rejoin job "
            f"'{job_id}': {exc}. Start this rank again to rejoin (another live rank "
            "donates)",
            job_id=job_id,
            rank=rank,
            step=step,
        ) from exc
    except raw_state.BadRawState as exc:
        raise mismatch(job_id, rank, step, f"a live rank's state is unreadable: {exc}") from exc
    mine = bool(read_into_own and read_into_own[0])
    log.info(
        "rank %d: fetched a live rank's state of step %d %s%s",
        rank,
        step,
        "directly (loopback)" if offered else "through the coordinator",
        ", into its own parameters" if mine else "",
    )
    if mine:  # already in place: load_state_dict would only copy it onto itself
        return state.get("optimizer")
    return _apply(state, module, job_id, rank, step)


def _own_targets(
    module: nn.Module, own: dict[str, Any]
) -> Callable[[raw_state.Layout], dict[int, torch.Tensor]]:
    """How to map an offered state's module tensors onto this module's own (or none).

    Reading into them stands for `load_state_dict` only where that would be
    a plain copy: every entry of this module's state dict is a parameter's
    or buffer's own memory, no module has load hooks or its own
    `_load_from_state_dict` (batch norm's only handles versions, which must
    be equal), and the offered state has exactly these names, shapes, dtypes
    and versions. Anything else (an empty mapping) is read into new tensors
    and loaded by `load_state_dict`, which names what does not fit.
    """
    storage = {t.data_ptr() for t in [*module.parameters(), *module.buffers()]}
    plain = all(
        isinstance(v, torch.Tensor) and v.data_ptr() in storage and v.numel() for v in own.values()
    ) and not any(_custom_loading(m) for m in module.modules())
    metadata = getattr(own, "_metadata", None)

    def targets(layout: raw_state.Layout) -> dict[int, torch.Tensor]:
        if not plain:
            return {}
        paths = raw_state.tensor_paths(layout)
        module_paths = {p[1]: i for p, i in paths.items() if len(p) == 2 and p[0] == "module"}
        if set(module_paths) != set(own) or _offered_metadata(layout) != metadata:
            return {}
        chosen = {module_paths[name]: tensor for name, tensor in own.items()}
        if not all(raw_state.fits(t, layout.tensors[i]) for i, t in chosen.items()):
            return {}
        return chosen

    return targets


def _custom_loading(module: nn.Module) -> bool:
    """True when `module` loads its state other than by copying each tensor."""
    hooks = module._load_state_dict_pre_hooks or module._load_state_dict_post_hooks
    method = type(module)._load_from_state_dict
    return bool(hooks) or method not in _PLAIN_LOADERS


def _offered_metadata(layout: raw_state.Layout) -> Any:
    """The `_metadata` (versions) of the offered module state dict, or None."""
    try:
        module_state = layout.build([torch.empty(0)] * len(layout.tensors)).get("module")
    except AttributeError:  # not a dict at the top
        return None
    return getattr(module_state, "_metadata", None)


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


def position(module: nn.Module, optimizer: torch.optim.Optimizer | None, step: int) -> pb.Position:
    """This rank's position: `step` steps applied, and the digest of its state."""
    return pb.Position(step=step, digest=state_digest(module, optimizer))


def state_digest(module: nn.Module, optimizer: torch.optim.Optimizer | None) -> bytes:
    """SHA-256 of the parameters (by name) and the optimizer state, in a fixed order.

    A rank that loses its coordinator keeps its parameters and optimizer state;
    when it rejoins, it claims a `Join.position` (`position`): the steps it has
    applied and this digest. A restarted coordinator lets the ranks that agree
    continue from there (`gradsync_server.control.restart`), so nothing rolls back
    to a checkpoint and nothing is computed twice. Not the buffers: under DDP every
    rank's buffers are rank 0's only at the start of a forward pass (and each rank's
    own with `broadcast_buffers=False`), so ranks that agree on everything training
    depends on may still differ there; parameters and optimizer state are equal bit
    for bit on every rank after every step.
    """
    digest = hashlib.sha256()
    with torch.no_grad():
        for name, parameter in module.named_parameters():
            digest.update(name.encode())
            _feed(digest, parameter)
        if optimizer is not None:
            _feed(digest, optimizer.state_dict())
    return digest.digest()


def _feed(digest: Any, value: Any) -> None:
    """Hash `value` (tensors by dtype, shape and bytes; containers in a fixed order)."""
    if isinstance(value, torch.Tensor):
        tensor = value.detach().cpu().contiguous()
        digest.update(f"T{tensor.dtype}{tuple(tensor.shape)}".encode())
        if tensor.numel():
            digest.update(tensor.reshape(-1).view(torch.uint8).numpy())
    elif isinstance(value, Mapping):
        digest.update(b"{")
        for key in sorted(value, key=repr):
            digest.update(repr(key).encode())
            _feed(digest, value[key])
        digest.update(b"}")
    elif isinstance(value, Sequence) and not isinstance(value, str | bytes):
        digest.update(b"[")
        for item in value:
            _feed(digest, item)
        digest.update(b"]")
    else:
        digest.update(repr(value).encode())
