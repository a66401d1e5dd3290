"""`gradsync.DiLoCo`: low-communication training, the outer optimizer on the coordinator.

DiLoCo (Douillard et al., arXiv 2311.08105) trains every rank on its own for
`sync_every` inner steps, then runs one *outer* step: each rank's
pseudo-gradient, the global parameters minus its local ones, is averaged,
and an outer optimizer (SGD with Nesterov momentum) applies that average to
the global parameters, which every rank then continues from. The ranks talk
once per `sync_every` steps instead of every step.

Here the coordinator holds the global parameters and runs the outer
optimizer (`gradsync_server.dataplane.outer`): a rank uploads its
pseudo-gradient as one synchronized "backward pass" of the wrapped
`DistributedDataParallel` (every bucket, overlapped, through the same
coordinator and shards, in float32 or a 16-bit wire), and the answer to
every bucket is the new global parameters, in float32, which it copies into
its model. So every rank holds bitwise the same global model after every
round, whatever the arrival order, and nothing but the coordinator keeps the
outer momentum. The first round after joining seeds the coordinator's global
parameters with the ranks' (identical, after rank 0's broadcast) parameters,
always in float32.

The inner optimizer and its state stay on the rank, untouched. Buffers
(BatchNorm statistics) are not synchronized: each rank keeps its own, as in
DiLoCo.

On a 16-bit or int8 wire the rounding error of each pseudo-gradient is kept
on the rank and added to the next one (`error_feedback`, on by default there),
so what the coordinator receives sums to the true pseudo-gradients over rounds.
The int8 wire (a quarter of float32's bytes) quantizes every chunk with its
own scale, on the transport's chunk grid, and keeps its error per bucket
(`gradsync.quantized_wire`); it is DiLoCo's alone, and needs a flat job (no
same-host group sums int8).
"""

from __future__ import annotations

import math
import time
from typing import Any

import torch
from gradsync_proto.v1 import gradsync_pb2 as pb
from torch import nn

from gradsync.ddp import DistributedDataParallel
from gradsync.hooks import WIRE_DTYPE_HOOKS, GradBucket
from gradsync.quantized_wire import ChunkGrid, Int8Quantization

__all__ = ["DiLoCo"]


class _SeedableCast:
    """The comm hook of a 16-bit DiLoCo wire: the seed round travels in float32.

    The seed is the global parameters themselves, which must reach the
    coordinator exactly; pseudo-gradients are rounded to `wire_dtype` (their
    error is fed back by `DiLoCo`). Answers are float32 either way.
    """

    def __init__(self, wire_dtype: torch.dtype) -> None:
        self.wire_dtype = wire_dtype
        self.seeding = True

    def before_upload(self, state: Any, bucket: GradBucket) -> torch.Tensor:
        if self.seeding or bucket.buffer.dtype != torch.float32:
            return bucket.buffer
        return bucket.buffer.to(self.wire_dtype)

    def after_average(self, state: Any, bucket: GradBucket, averaged: torch.Tensor) -> None:
        bucket.buffer.copy_(averaged)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.wire_dtype})"


class DiLoCo:
    """Synchronize `model` every `sync_every` inner steps through an outer optimizer.

    Args:
        model: the module to train (not wrapped: forward it directly).
        inner_optimizer: the rank's own optimizer over `model`'s parameters (kept
            for reference and checkpoints; `DiLoCo` never steps it).
        sync_every: inner steps between two outer rounds (H).
        outer_lr: the outer optimizer's learning rate.
        outer_momentum: its momentum (0 = plain outer SGD).
        nesterov: Nesterov momentum (as torch.optim.SGD); ignored at momentum 0.
        wire_dtype: pseudo-gradients on the wire: None (float32), torch.bfloat16,
            torch.float16 or torch.int8 (a float32 scale per chunk; float32
            parameters only, and no `hierarchical`). The global parameters
            always come back in float32.
        error_feedback: keep each round's rounding error and add it to the next
            pseudo-gradient (default: on with a narrow wire; meaningless without).
        coordinator, rank, world_size, job_id: as `DistributedDataParallel` (and the
            same environment variables as defaults).
        **options: any other keyword argument of `DistributedDataParallel`
            (`token`, `tls_ca`, `timeout_s`, `bucket_cap_mb`, `metrics_port`, ...).

    Raises:
        ValueError: a setting out of range (naming it and its value).
    """

    def __init__(
        self,
        model: nn.Module,
        inner_optimizer: torch.optim.Optimizer,
        sync_every: int = 50,
        outer_lr: float = 0.7,
        outer_momentum: float = 0.9,
        *,
        nesterov: bool = True,
        wire_dtype: torch.dtype | None = None,
        error_feedback: bool | None = None,
        coordinator: str | None = None,
        rank: int | None = None,
        world_size: int | None = None,
        job_id: str | None = None,
        **options: Any,
    ) -> None:
        _check(sync_every, outer_lr, outer_momentum, wire_dtype, error_feedback)
        feedback = wire_dtype is not None if error_feedback is None else error_feedback
        int8 = wire_dtype is torch.int8
        if int8:
            if options.get("hierarchical") not in (None, False):
                raise ValueError(
                    f"hierarchical={options['hierarchical']!r} is not possible with "
                    "wire_dtype=torch.int8 (a local group sums in full precision): pass "
                    "hierarchical=False"
                )
            options["hierarchical"] = False
        self.model = model
        self.inner_optimizer = inner_optimizer
        self.sync_every = sync_every
        outer = pb.OuterOptimizer(
            lr=outer_lr, momentum=outer_momentum, nesterov=nesterov and outer_momentum > 0
        )
        self._hook: _SeedableCast | Int8Quantization | None = None
        if int8:  # the cut is the transport's, known once joined: read at every bucket
            self._hook = Int8Quantization(
                lambda: ChunkGrid.of(self._ddp._session.welcome), feedback
            )
        elif wire_dtype is not None:
            self._hook = _SeedableCast(wire_dtype)
        self._ddp = DistributedDataParallel(
            model,
            coordinator=coordinator,
            rank=rank,
            world_size=world_size,
            job_id=job_id,
            broadcast_buffers=False,
            # The wrapper refuses int8 (not a per-step wire): DiLoCo installs its own hook.
            wire_dtype=None if int8 else wire_dtype,
            wire_answer_dtype=None if wire_dtype is None or int8 else torch.float32,
            _outer=outer,
            **options,
        )
        if self._hook is not None:
            # In place of the built-in cast `wire_dtype` registered (none for int8),
            # made to let the seed through in fp32.
            self._ddp._reducer.comm_hook = self._hook
        self._ddp._require_sync = False  # inner backward passes stay on this rank
        self._params = [p for p in model.parameters() if p.requires_grad]
        # A 16-bit wire's error, per parameter (int8 keeps its own per bucket, in the hook).
        per_parameter = feedback and not int8
        self._residuals = [torch.zeros_like(p) for p in self._params] if per_parameter else None
        self._global = [p.detach().clone() for p in self._params]
        #: Inner steps taken (calls of `step`).
        self.inner_steps = 0
        #: Outer rounds completed (the seed not counted).
        self.rounds = 0
        #: Bytes this rank uploaded in its last round, and that round's seconds.
        self.last_round_bytes = 0
        self.last_round_s = 0.0
        self._round(seed=True)

    @property
    def rank(self) -> int:
        return self._ddp.rank

    @property
    def world_size(self) -> int:
        return self._ddp.world_size

    @property
    def ddp(self) -> DistributedDataParallel:
        """The wrapper that carries the rounds (its step counts them, the seed included)."""
        return self._ddp

    def step(self) -> bool:
        """Count one inner step; every `sync_every`-th runs an outer round. True if one ran."""
        self.inner_steps += 1
        if self.inner_steps % self.sync_every:
            return False
        self._round(seed=False)
        self.rounds += 1
        return True

    def sync(self) -> None:
        """Run an outer round now (at the end of training, say), whatever the step count."""
        self._round(seed=False)
        self.rounds += 1

    def _round(self, seed: bool) -> None:
        """Upload the pseudo-gradients (the parameters, to seed); adopt the global parameters."""
        started, sent = time.monotonic(), self._ddp.bytes_sent
        params = self._params
        inner_grads = [p.grad for p in params]
        with torch.no_grad():
            if seed:
                uploads = [p.detach().clone() for p in params]
            else:
                uploads = [g - p for g, p in zip(self._global, params, strict=True)]
                if self._residuals is not None and isinstance(self._hook, _SeedableCast):
                    wire = self._hook.wire_dtype
                    for upload, residual in zip(uploads, self._residuals, strict=True):
                        upload += residual
                        residual.copy_(upload - upload.to(wire).to(upload.dtype))
        if self._hook is not None:
            self._hook.seeding = seed
        for p in params:
            p.grad = None
        self._ddp._require_sync = True
        try:
            # One synchronized backward pass whose gradients are the uploads: the
            # wrapper's hooks fire, buckets go out as they fill, and the answers (the
            # new global parameters) land in `.grad` before this returns.
            torch.autograd.backward(params, grad_tensors=uploads)
        finally:
            self._ddp._require_sync = False
        with torch.no_grad():
            for p, global_p in zip(params, self._global, strict=True):
                assert p.grad is not None
                global_p.copy_(p.grad)
                p.copy_(p.grad)
        for p, grad in zip(params, inner_grads, strict=True):
            p.grad = grad
        self.last_round_bytes = self._ddp.bytes_sent - sent
        self.last_round_s = time.monotonic() - started

    def close(self) -> None:
        """Leave the job (as `DistributedDataParallel.close`)."""
        self._ddp.close()

    def __enter__(self) -> DiLoCo:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _check(
    sync_every: int,
    outer_lr: float,
    outer_momentum: float,
    wire_dtype: torch.dtype | None,
    error_feedback: bool | None,
) -> None:
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
