"""Where a live rank stands, for a restarted coordinator: steps applied and a state digest.

A rank that loses its coordinator keeps its parameters and optimizer state.
When it rejoins, it claims a `Join.position`: the number of steps it has
applied and a SHA-256 of that state. A restarted coordinator lets the ranks
that agree continue from there (`gradsync_server.control.restart`), so
nothing rolls back to a checkpoint and nothing is computed twice.

The digest covers the parameters and the optimizer's state, not the buffers:
under DDP every rank's buffers are rank 0's only at the start of a forward
pass (and each rank's own with `broadcast_buffers=False`), so ranks that agree
on everything that training depends on may still differ there. Parameters and
optimizer state are equal bit for bit on every rank after every step.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from gradsync_proto.v1 import gradsync_pb2 as pb
from torch import nn


def position(module: nn.Module, optimizer: torch.optim.Optimizer | None, step: int) -> pb.Position:
    """This rank's position: `step` steps applied, and the digest of its state."""
    return pb.Position(step=step, digest=state_digest(module, optimizer))


def state_digest(module: nn.Module, optimizer: torch.optim.Optimizer | None) -> bytes:
    """SHA-256 of the parameters (by name) and the optimizer state, in a fixed order."""
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
