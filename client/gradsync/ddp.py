"""`gradsync.DistributedDataParallel`: DDP-style gradient averaging via a coordinator.

How one synchronized backward pass flows:

1. Each parameter has a post-accumulate-grad hook. The first hook of a
   backward pass queues an end-of-backward callback with the autograd engine.
2. When the last gradient of a bucket lands, the hook copies the bucket's
   gradients into one flat buffer and hands it to the transport thread, which
   uploads it in chunks while autograd keeps computing earlier layers.
3. The end-of-backward callback uploads any bucket still missing gradients
   (parameters unused in this pass contribute zeros), waits (bounded) for
   every averaged bucket and writes the averages into `param.grad`. So
   `loss.backward()` returns with averaged gradients; user code is unchanged.

Hooks never block on the network and never raise: failures are recorded and
raised from the callback, i.e. from `backward()`, as `GradSyncError`s.

This module is the nn.Module wrapper and that per-step path only. What happens
between steps (joining, rank 0's broadcast, checkpoints, healing, reconnecting
to a restarted coordinator) lives in `gradsync.session`; the network sits
behind the `gradsync.link.CoordinatorLink` protocol, so the step logic runs
unchanged over gRPC (`gradsync.transport`) or over a test's fake.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from gradsync.bucketing import BucketPlan, assign_buckets
from gradsync.buffers import BucketBuffer
from gradsync.config import ClientConfig
from gradsync.errors import (
    ClosedError,
    CoordinatorRestartedError,
    CoordinatorUnavailableError,
    GradSyncError,
    StepAbortedError,
)
from gradsync.instruments import Instruments
from gradsync.link import CoordinatorLink, LinkFactory
from gradsync.metrics import resolve_metrics_port
from gradsync.protocol import defaults
from gradsync.session import Session
from gradsync.signature import bucket_wire_dtype, model_signature, wire_dtype
from gradsync.transport import Transport

log = logging.getLogger("gradsync.client")


class _State(enum.Enum):
    OPEN = "open"
    CLOSED = "closed"


class DistributedDataParallel(nn.Module):
    """Wrap `module` so that `backward()` leaves averaged gradients in `param.grad`.

    Args:
        module: the model; its `forward` is used unchanged (`.module` returns it).
        coordinator: "host:port" of the coordinator; default $GRADSYNC_COORDINATOR.
        rank: this worker's rank; default $RANK (torchrun sets it).
        world_size: number of workers; default $WORLD_SIZE.
        job_id: name shared by the job's ranks; default $GRADSYNC_JOB_ID or "default".
        bucket_cap_mb: cap of each gradient bucket (MiB), as in torch DDP.
        first_bucket_mb: cap of the first bucket (MiB), small so uploads start early.
        timeout_s: bound on the wait for each step's averaged gradients.
        join_timeout_s: bound on the wait for every rank to join and for rank 0's state.
        metrics_port: serve this worker's Prometheus metrics on this port plus
            $LOCAL_RANK (default $GRADSYNC_METRICS_PORT; 0 = a free port; unset = off).
        trace_path: write a Chrome trace-event file of every step there.
        reconnect_timeout_s: when the coordinator is lost, keep reconnecting (with
            backoff) this long; a restarted coordinator resumes the job from its
            latest checkpoint and backward raises CoordinatorRestartedError.
            0 disables reconnecting.
        overlap: upload each bucket as soon as its gradients are ready (default).
            False uploads everything after backward: slower, kept to measure the
            gain of overlapping communication with the backward pass.
        link_factory: builds the link to the coordinator from (address, rank);
            default: `gradsync.transport.Transport` (gRPC). Tests pass a fake
            to exercise the step logic without sockets (see `gradsync.link`).

    Construction blocks until all ranks have joined, then copies rank 0's
    parameters and buffers to every rank. Only dense gradients are supported.
    A parameter that gets no gradient in a step contributes zeros to the
    average; afterwards its `.grad` holds the average on every rank (zeros if
    no rank used it), so all ranks stay identical.

    Raises:
        ValueError: invalid or missing settings.
        GradSyncError: joining failed (coordinator unreachable, join refused, ...).
    """

    def __init__(
        self,
        module: nn.Module,
        coordinator: str | None = None,
        rank: int | None = None,
        world_size: int | None = None,
        *,
        job_id: str | None = None,
        bucket_cap_mb: float = defaults.BUCKET_CAP_MB,
        first_bucket_mb: float = defaults.FIRST_BUCKET_MB,
        timeout_s: float = defaults.TIMEOUT_S,
        join_timeout_s: float = defaults.JOIN_TIMEOUT_S,
        overlap: bool = True,
        metrics_port: int | None = None,
        trace_path: str | Path | None = None,
        reconnect_timeout_s: float = defaults.RECONNECT_TIMEOUT_S,
        link_factory: LinkFactory | None = None,
    ) -> None:
        super().__init__()
        self.module = module
        self.config = ClientConfig.resolve(
            coordinator,
            rank,
            world_size,
            job_id,
            bucket_cap_mb,
            first_bucket_mb,
            timeout_s,
            join_timeout_s,
        )
        named = list(module.named_parameters())
        if not any(p.requires_grad for _, p in named):
            raise ValueError("the module has no parameters that require gradients")
        self._named_parameters = named
        self._named_buffers = list(module.named_buffers())
        self._buckets = self._plan_buckets()
        self._bucket_of = [-1] * len(named)
        for bucket_index, plan in enumerate(self._buckets):
            for index in plan.parameter_indices:
                self._bucket_of[index] = bucket_index
        self._state = _State.OPEN
        self._require_sync = True
        self._overlap = overlap
        self._backward_active = False
        self._ready = [0] * len(self._buckets)
        self._launched = [False] * len(self._buckets)
        self._errors: list[Exception] = []
        # Host copies of gradients that are not contiguous CPU tensors, to copy back.
        self._staged: list[tuple[torch.Tensor, nn.Parameter]] = []
        self._hooks: list[Any] = []
        self.last_contributors = 0
        bucket_bytes = [plan.num_bytes for plan in self._buckets]
        self._instruments = Instruments(
            self.config.rank,
            resolve_metrics_port(metrics_port, os.environ),
            Path(trace_path) if trace_path is not None else None,
            bucket_bytes,
        )
        try:
            self._session = Session(
                self.config,
                module,
                [p for _, p in named] + [b for _, b in self._named_buffers],
                model_signature(named, self._named_buffers, self._buckets),
                bucket_bytes,
                link_factory or Transport,
                self._instruments.on_bucket_event,
                reconnect_timeout_s,
            )
            self._step = self._session.start()
        except BaseException:
            self._instruments.close()
            raise
        for index, (_, param) in enumerate(named):
            if self._bucket_of[index] >= 0:
                hook = self._make_hook(index)
                self._hooks.append(param.register_post_accumulate_grad_hook(hook))  # type: ignore[no-untyped-call]

    # ---------------------------------------------------------------- public
    @property
    def rank(self) -> int:
        """This worker's rank."""
        return self.config.rank

    @property
    def world_size(self) -> int:
        """Number of ranks in the job."""
        return self.config.world_size

    @property
    def step(self) -> int:
        """Index of the next synchronized step (synced backward passes so far)."""
        return self._step

    @property
    def bucket_plans(self) -> list[BucketPlan]:
        """The bucket layout (indices into `module.named_parameters()`)."""
        return list(self._buckets)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run the wrapped module's forward (after a due periodic checkpoint, on rank 0)."""
        if self._state is _State.CLOSED:
            raise ClosedError("DistributedDataParallel used after close()", rank=self.rank)
        if self._backward_active:
            self.abandon_step("its backward pass was interrupted by an exception")
        # Before the next step's forward the optimizer has applied the previous
        # step: parameters and optimizer state are consistent.
        self._session.at_step_boundary(self._step)
        return self.module(*args, **kwargs)

    def abandon_step(self, reason: str = "abandoned by the training loop") -> None:
        """Give up on a synchronized step whose backward pass did not finish.

        An exception inside `backward()` (an out-of-memory error, say) skips the
        end-of-backward callback, leaving the step half uploaded. The coordinator
        is told to abort the step for every rank (they get StepAbortedError and
        skip it), and this rank moves on to the next step. The next `forward()`
        does this automatically; call it yourself right after catching the
        exception if your loop reads `model.step`.
        """
        if not self._backward_active:
            return
        step = self._step
        log.warning("rank %d: abandoning step %d: %s", self.rank, step, reason)
        self._link.abandon_step(step, reason)
        self._backward_active = False
        self._staged.clear()
        self._errors.clear()
        self._step = step + 1
        self._link.current_step = self._step

    def register_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Include `optimizer`'s state in checkpoints (and restore it when resuming).

        Call it once, right after creating the optimizer.
        """
        self._session.register_optimizer(optimizer)

    def save_checkpoint(self, wait: bool = True, timeout_s: float | None = None) -> int:
        """Upload a checkpoint of rank 0's state through the coordinator (rank 0 only).

        The checkpoint holds the module's state dict, the registered optimizer's
        state dict and the step training resumes at. Other ranks return at once.

        Args:
            wait: block until the coordinator reports the checkpoint durable.
            timeout_s: bound on that wait (default: the sync timeout).

        Returns:
            The checkpoint's step.

        Raises:
            CheckpointFailedError: with wait=True, the store could not save it.
            SyncTimeoutError: no answer within the timeout.
        """
        return self._session.save_checkpoint(self._step, wait, timeout_s or self.config.timeout_s)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Skip synchronization inside the block; gradients accumulate locally.

        The next backward pass outside the block averages the accumulated
        gradients, as with torch DDP.
        """
        previous = self._require_sync
        self._require_sync = False
        try:
            yield
        finally:
            self._require_sync = previous

    def close(self) -> None:
        """Remove the hooks and leave the job cleanly. Idempotent."""
        if self._state is _State.CLOSED:
            return
        self._state = _State.CLOSED
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()
        self._session.close()
        self._instruments.close()

    def __enter__(self) -> DistributedDataParallel:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # ------------------------------------------------------------- layout
    @property
    def _link(self) -> CoordinatorLink:
        """The current link to the coordinator (a reconnect replaces it)."""
        return self._session.link

    def _plan_buckets(self) -> list[BucketPlan]:
        sizes, dtypes = [], []
        for name, param in self._named_parameters:
            wire_dtype(name, param)  # refuse an unsupported dtype before joining
            trainable = param.requires_grad and param.numel() > 0
            sizes.append(param.numel() * param.element_size() if trainable else 0)
            dtypes.append(param.dtype)
        return assign_buckets(
            sizes, dtypes, self.config.bucket_cap_bytes, self.config.first_bucket_cap_bytes
        )

    # -------------------------------------------------------------- hooks
    def _make_hook(self, index: int) -> Any:
        def hook(_: torch.Tensor) -> None:
            self._on_gradient_ready(index)

        return hook

    def _on_gradient_ready(self, index: int) -> None:
        """Autograd hook body: count readiness, launch full buckets. Never raises."""
        if not self._require_sync or self._state is _State.CLOSED:
            return
        try:
            if not self._backward_active:
                self._backward_active = True
                self._instruments.backward_started(self._step)
                self._ready = [0] * len(self._buckets)
                self._launched = [False] * len(self._buckets)
                torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)
            bucket_index = self._bucket_of[index]
            self._ready[bucket_index] += 1
            bucket_size = len(self._buckets[bucket_index].parameter_indices)
            if self._overlap and self._ready[bucket_index] == bucket_size:
                self._launch(bucket_index)
        except Exception as exc:  # raised at the end of backward, with context
            self._errors.append(exc)

    def _launch(self, bucket_index: int) -> None:
        """Queue a bucket's gradients for upload, straight from `param.grad` (no copy).

        Gradients that are not contiguous CPU tensors are staged through a host
        copy and copied back after averaging. A parameter without a gradient
        gets a zero gradient here, so its average has somewhere to land.
        """
        plan = self._buckets[bucket_index]
        segments = []
        for index in plan.parameter_indices:
            name, param = self._named_parameters[index]
            grad = param.grad
            if grad is None:
                grad = param.grad = torch.zeros_like(param, memory_format=torch.contiguous_format)
            elif grad.is_sparse:
                raise ValueError(
                    f"'{name}' has a sparse gradient; gradsync averages dense gradients only"
                )
            host = grad.detach()
            if host.device.type != "cpu" or not host.is_contiguous():
                host = host.to("cpu", memory_format=torch.contiguous_format)
                self._staged.append((host, param))
            segments.append(host.reshape(-1).view(torch.uint8).numpy())
        self._launched[bucket_index] = True
        self._instruments.bucket_ready(self._step, bucket_index)
        self._link.submit_bucket(
            self._step, bucket_index, BucketBuffer(segments), bucket_wire_dtype(plan)
        )

    def _finish_backward(self) -> None:
        """End-of-backward callback: flush, wait for averages, write them to .grad."""
        step = self._step
        try:
            if self._errors:
                error = self._errors[0]
                self._errors.clear()
                raise GradSyncError(
                    f"preparing gradients for upload failed: {error}", rank=self.rank, step=step
                ) from error
            for bucket_index, launched in enumerate(self._launched):
                if not launched:  # some parameter got no gradient this pass
                    self._launch(bucket_index)
            wait_started = self._instruments.now()
            try:
                self.last_contributors = self._link.wait_step(step, self.config.timeout_s)
            except StepAbortedError as exc:
                self._instruments.step_aborted(exc)
                raise
            except CoordinatorUnavailableError as exc:
                # Only a lost coordinator is worth reconnecting to; every other
                # error (declared dead, refused, checkpoint failed) propagates.
                if self._session.reconnect_timeout_s <= 0:
                    raise
                resumed_at = self._session.reconnect(exc, step)
                step = resumed_at - 1  # `finally` moves on to the resumed step
                raise CoordinatorRestartedError(
                    f"lost the coordinator and reconnected; state restored from the checkpoint "
                    f"of step {resumed_at}. Nothing was applied for this backward pass: skip "
                    "optimizer.step() and continue at model.step",
                    rank=self.rank,
                    step=resumed_at,
                ) from exc
            self._instruments.step_done(step, wait_started)
            with torch.no_grad():
                for host, param in self._staged:
                    assert param.grad is not None
                    param.grad.copy_(host.view_as(param.grad))
        finally:
            self._staged.clear()
            self._backward_active = False
            self._step = step + 1
            self._link.current_step = self._step
