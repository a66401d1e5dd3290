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
"""

from __future__ import annotations

import contextlib
import enum
import io
import logging
import os
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from gradsync import __version__
from gradsync.bucketing import BucketPlan, assign_buckets
from gradsync.buffers import BucketBuffer
from gradsync.config import ClientConfig
from gradsync.errors import (
    CheckpointFailedError,
    ClosedError,
    CoordinatorRestartedError,
    CoordinatorUnavailableError,
    GradSyncError,
    StepAbortedError,
    SyncTimeoutError,
)
from gradsync.instruments import Instruments
from gradsync.metrics import resolve_metrics_port
from gradsync.protocol import dtypes
from gradsync.transport import Transport
from gradsync.v1 import gradsync_pb2 as pb

log = logging.getLogger("gradsync.client")

#: torch dtype -> wire dtype. Integer types only ever occur in buffers.
WIRE_DTYPES: dict[torch.dtype, int] = {
    torch.float32: pb.DTYPE_FLOAT32,
    torch.float64: pb.DTYPE_FLOAT64,
    torch.float16: pb.DTYPE_FLOAT16,
    torch.bfloat16: pb.DTYPE_BFLOAT16,
    torch.int64: pb.DTYPE_INT64,
    torch.int32: pb.DTYPE_INT32,
    torch.int16: pb.DTYPE_INT16,
    torch.int8: pb.DTYPE_INT8,
    torch.uint8: pb.DTYPE_UINT8,
    torch.bool: pb.DTYPE_BOOL,
}


class _State(enum.Enum):
    OPEN = "open"
    CLOSED = "closed"


def _wire_dtype(name: str, tensor: torch.Tensor) -> int:
    try:
        return WIRE_DTYPES[tensor.dtype]
    except KeyError:
        raise ValueError(f"'{name}' has unsupported dtype {tensor.dtype}") from None


def _spec(name: str, tensor: torch.Tensor) -> pb.TensorSpec:
    return pb.TensorSpec(name=name, shape=list(tensor.shape), dtype=_wire_dtype(name, tensor))  # type: ignore[arg-type]


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
        bucket_cap_mb: float = 25.0,
        first_bucket_mb: float = 1.0,
        timeout_s: float = 300.0,
        join_timeout_s: float = 300.0,
        overlap: bool = True,
        metrics_port: int | None = None,
        trace_path: str | Path | None = None,
        reconnect_timeout_s: float = 60.0,
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
        self._optimizer: torch.optim.Optimizer | None = None
        self._pending_optimizer_state: dict[str, Any] | None = None
        self._checkpoint_every = 0
        self._last_checkpoint_step = -1
        self._reconnect_timeout_s = reconnect_timeout_s
        self._resumed_from_checkpoint = False
        self._overlap = overlap
        self._backward_active = False
        self._ready = [0] * len(self._buckets)
        self._launched = [False] * len(self._buckets)
        self._errors: list[Exception] = []
        # Host copies of gradients that are not contiguous CPU tensors, to copy back.
        self._staged: list[tuple[torch.Tensor, nn.Parameter]] = []
        self._hooks: list[Any] = []
        self.last_contributors = 0
        self._transport = Transport(self.config.coordinator, self.config.rank)
        self._instruments = Instruments(
            self.config.rank,
            resolve_metrics_port(metrics_port, os.environ),
            Path(trace_path) if trace_path is not None else None,
            [plan.num_bytes for plan in self._buckets],
        )
        self._transport.on_bucket_event = self._instruments.on_bucket_event
        try:
            self._step = self._join_and_broadcast()
            self._transport.current_step = self._step
        except BaseException:
            self._transport.close(timeout_s=5.0)
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
        if self._transport.take_heal_request():
            # A step boundary: parameters and optimizer state are consistent.
            self._transport.send_heal(self._step, self._state_blob())
        every = self._checkpoint_every
        if (
            every
            and self.rank == 0
            and self._step % every == 0
            and self._step > self._last_checkpoint_step
        ):
            # Here, before the next step's forward, the optimizer has applied
            # the previous step: parameters and optimizer state are consistent.
            self.save_checkpoint(wait=False)
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
        self._transport.abandon_step(step, reason)
        self._backward_active = False
        self._staged.clear()
        self._errors.clear()
        self._step = step + 1
        self._transport.current_step = self._step

    def register_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Include `optimizer`'s state in checkpoints (and restore it when resuming).

        Call it once, right after creating the optimizer.
        """
        self._optimizer = optimizer
        if self._pending_optimizer_state is not None:
            optimizer.load_state_dict(self._pending_optimizer_state)
            self._pending_optimizer_state = None

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
        step = self._step
        if self.rank != 0:
            return step
        self._last_checkpoint_step = step
        self._transport.send_checkpoint(step, self._state_blob())
        if wait:
            saved = self._transport.wait_checkpoint(step, timeout_s or self.config.timeout_s)
            if not saved.durable:
                raise CheckpointFailedError(
                    f"checkpoint of step {step} was not saved: {saved.message}",
                    rank=self.rank,
                    step=step,
                )
        return step

    def _state_blob(self) -> bytes:
        """Module state, optimizer state and step, serialized for checkpoints and healing."""
        state = {
            "module": self.module.state_dict(),
            "optimizer": self._optimizer.state_dict() if self._optimizer is not None else None,
            "step": self._step,
            "world_size": self.world_size,
        }
        buffer = io.BytesIO()
        torch.save(state, buffer)
        return buffer.getvalue()

    def _reconnect(self, cause: GradSyncError) -> int:
        """Reconnect to a restarted coordinator (bounded backoff); return the resumed step.

        Raises:
            CoordinatorUnavailableError: no coordinator within the reconnect timeout, or
                one that cannot resume this job from a checkpoint.
        """
        deadline = time.monotonic() + self._reconnect_timeout_s
        delay = 0.25
        log.warning(
            "rank %d: lost the coordinator (%s); reconnecting for up to %gs",
            self.rank,
            cause,
            self._reconnect_timeout_s,
        )
        self._resumed_from_checkpoint = False
        while True:
            self._transport.close(timeout_s=2.0)
            self._transport = Transport(self.config.coordinator, self.config.rank)
            self._transport.on_bucket_event = self._instruments.on_bucket_event
            remaining = deadline - time.monotonic()
            try:
                start = self._join_and_broadcast(join_timeout_s=max(1.0, remaining))
                break
            except (CoordinatorUnavailableError, SyncTimeoutError) as exc:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise CoordinatorUnavailableError(
                        f"gave up reconnecting to {self.config.coordinator} after "
                        f"{self._reconnect_timeout_s:g}s: {exc}",
                        rank=self.rank,
                    ) from cause
                time.sleep(min(delay, remaining))
                delay = min(delay * 2, 5.0)
        if not self._resumed_from_checkpoint:
            raise CoordinatorUnavailableError(
                f"the restarted coordinator has no checkpoint of job '{self.config.job_id}' "
                f"(it would restart at step {start}, this rank is at step {self._step}); "
                "start it with the same --checkpoint-store to resume",
                rank=self.rank,
            ) from cause
        self._transport.current_step = start
        return start

    def _restore(self, blob: bytes, start_step: int) -> None:
        """Load the checkpoint the job resumes from (optimizer state waits for its optimizer)."""
        state = torch.load(io.BytesIO(blob), weights_only=True)
        self.module.load_state_dict(state["module"])
        self._pending_optimizer_state = state.get("optimizer")
        self._resumed_from_checkpoint = True
        if self._optimizer is not None and self._pending_optimizer_state is not None:
            # Reconnecting mid-run: the optimizer already exists.
            self._optimizer.load_state_dict(self._pending_optimizer_state)
            self._pending_optimizer_state = None
        self._last_checkpoint_step = start_step
        log.warning(
            "rank %d: job '%s' resumed from the checkpoint of step %d",
            self.rank,
            self.config.job_id,
            start_step,
        )

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
        self._transport.close()
        self._instruments.close()

    def __enter__(self) -> DistributedDataParallel:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # ------------------------------------------------------------ joining
    def _plan_buckets(self) -> list[BucketPlan]:
        sizes, dtypes = [], []
        for name, param in self._named_parameters:
            _wire_dtype(name, param)
            trainable = param.requires_grad and param.numel() > 0
            sizes.append(param.numel() * param.element_size() if trainable else 0)
            dtypes.append(param.dtype)
        return assign_buckets(
            sizes, dtypes, self.config.bucket_cap_bytes, self.config.first_bucket_cap_bytes
        )

    def _signature(self) -> pb.ModelSignature:
        return pb.ModelSignature(
            parameters=[_spec(name, p) for name, p in self._named_parameters],
            buffers=[_spec(name, b) for name, b in self._named_buffers],
            buckets=[
                pb.BucketSpec(
                    parameter_indices=list(plan.parameter_indices),
                    dtype=WIRE_DTYPES[plan.dtype],  # type: ignore[index,arg-type]
                    num_elements=plan.num_bytes // dtypes.itemsize(WIRE_DTYPES[plan.dtype]),  # type: ignore[index]
                )
                for plan in self._buckets
            ],
        )

    def _join_and_broadcast(self, join_timeout_s: float | None = None) -> int:
        """Join the job, then make every rank start from rank 0's state (or a checkpoint)."""
        config = self.config
        self._transport.configure_buckets([plan.num_bytes for plan in self._buckets])
        join = pb.Join(
            job_id=config.job_id,
            rank=config.rank,
            world_size=config.world_size,
            signature=self._signature(),
            incarnation=uuid.uuid4().hex,
            client_version=__version__,
        )
        log.info(
            "rank %d: joining job '%s' at %s (world size %d, %d buckets)",
            config.rank,
            config.job_id,
            config.coordinator,
            config.world_size,
            len(self._buckets),
        )
        self._transport.open(join)
        welcome = self._transport.wait_welcome(join_timeout_s or config.join_timeout_s)
        self._checkpoint_every = int(welcome.checkpoint_every_steps)
        if welcome.resume_bytes:
            self._restore(
                self._transport.receive_resume(
                    welcome.resume_bytes, (join_timeout_s or config.join_timeout_s)
                ),
                int(welcome.start_step),
            )
            return int(welcome.start_step)
        tensors = [p for _, p in self._named_parameters] + [b for _, b in self._named_buffers]
        with torch.no_grad():
            if config.rank == 0:
                flat = [
                    t.detach().reshape(-1).view(torch.uint8).cpu() for t in tensors if t.numel()
                ]
                blob = torch.cat(flat) if flat else torch.empty(0, dtype=torch.uint8)
                self._transport.send_state(blob.numpy())
            elif welcome.state_bytes:
                raw = self._transport.receive_state(
                    welcome.state_bytes, (join_timeout_s or config.join_timeout_s)
                )
                offset = 0
                for tensor in tensors:
                    if tensor.numel() == 0:
                        continue
                    size = tensor.numel() * tensor.element_size()
                    source = torch.frombuffer(
                        raw, dtype=tensor.dtype, count=tensor.numel(), offset=offset
                    )
                    tensor.copy_(source.view_as(tensor))
                    offset += size
        log.info(
            "rank %d: job '%s' assembled; starting at step %d",
            config.rank,
            config.job_id,
            welcome.start_step,
        )
        return int(welcome.start_step)

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
        self._transport.submit_bucket(
            self._step,
            bucket_index,
            BucketBuffer(segments),
            WIRE_DTYPES[plan.dtype],  # type: ignore[index]
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
                self.last_contributors = self._transport.wait_step(step, self.config.timeout_s)
            except StepAbortedError as exc:
                self._instruments.step_aborted(exc)
                raise
            except CoordinatorUnavailableError as exc:
                if self._reconnect_timeout_s <= 0:
                    raise
                resumed_at = self._reconnect(exc)
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
            self._transport.current_step = self._step
