"""`gradsync.DistributedDataParallel`: torch DDP's semantics, averaged through a coordinator.

One synchronized backward pass: each parameter's post-accumulate-grad hook
marks it used on this rank (also under `no_sync`); when a bucket's last
gradient lands, the bucket is staged (`gradsync.path.staging`), passed through the
comm hook if any (`gradsync.hooks`) and handed to the link, which uploads it
while autograd computes earlier layers. The end-of-backward callback uploads
the rest with the "presence" vector (which parameters this rank used; see
`gradsync.path.reducer`), waits (bounded) for every average, and moves them
into `.grad` by DDP's rules: a parameter no rank used keeps its `.grad`
untouched (None stays None), so optimizers skip it exactly as under DDP.

Before a forward pass rank 0's buffers are broadcast (`broadcast_buffers`,
as DDP) through the coordinator's collectives (`gradsync.collectives`), which
the wrapper also offers to user code and which `join()` (`gradsync.uneven`)
and synchronized BatchNorm (`gradsync.syncbn`) use. Hooks never block on the
network and never raise: failures surface from `backward()` as
`GradSyncError`s. That step path is `gradsync.control.step_path`; joining, the initial
broadcast, checkpoints and reconnecting live in `gradsync.control.session`; the
network sits behind `gradsync.control.link`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import functools
import logging
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from gradsync_proto.net.channels import ChannelSecurity
from gradsync_proto.v1 import gradsync_pb2 as pb
from torch import nn

from gradsync import compat, defaults, hooks, syncbn, uneven
from gradsync.collectives import Collectives
from gradsync.config import ClientConfig
from gradsync.control.link import LinkFactory
from gradsync.control.session import Session
from gradsync.control.step_path import StepPath
from gradsync.control.transport import Transport
from gradsync.diloco_settings import check_screen
from gradsync.errors import ClosedError, CoordinatorUnavailableError
from gradsync.hooks import CommHook
from gradsync.instruments import Instruments
from gradsync.local.hierarchy import check_hierarchical, requested_hierarchical
from gradsync.metrics import ENV_METRICS_HOST, resolve_metrics_port
from gradsync.path.bucketing import BucketPlan
from gradsync.path.reducer import Reducer, plan_layout
from gradsync.path.signature import PRESENCE_NAME, model_signature
from gradsync.path.step_results import RoundReport
from gradsync.quantized_wire import WireHook

log = logging.getLogger("gradsync.client")


class _State(enum.Enum):
    OPEN = "open"
    CLOSED = "closed"


@dataclasses.dataclass(frozen=True)
class OuterRounds:
    """What makes a wrapper the carrier of `gradsync.DiLoCo`'s rounds (`gradsync.diloco_fragment`).

    A round is one synchronized backward pass whose gradients are pseudo-gradients
    and whose averages come back as the coordinator's global parameters. Such a
    wrapper sends the presence vector as a bucket of its own, serves no metrics
    endpoint (DiLoCo serves its own), and rejoins a restarted coordinator that has
    no checkpoint (the ranks hold the global parameters and seed it again).

    Attributes:
        optimizer: the outer optimizer the coordinator runs (part of the job's signature).
        comm_hook: the hook every bucket goes through, in place of the cast
            `wire_dtype` would register (None: `wire_dtype`'s, or none).
    """

    optimizer: pb.OuterOptimizer
    comm_hook: WireHook | None = None


class DistributedDataParallel(nn.Module):
    """Wrap `module` so that `backward()` leaves averaged gradients in `param.grad`.

    A drop-in for `torch.nn.parallel.DistributedDataParallel`: every DDP argument
    is accepted, in DDP's order, so migrating is a one-line change (rank, world
    size and coordinator come from torchrun's $RANK / $WORLD_SIZE and
    $GRADSYNC_COORDINATOR). Honoured: `bucket_cap_mb`, `broadcast_buffers` /
    `forward_sync_buffers`, `init_sync=True`, `device_ids=[i]` and
    `output_device` (single-GPU module), and `find_unused_parameters`,
    `static_graph`, `check_reduction` (unused parameters are always handled).
    `gradient_as_bucket_view=True` makes each `.grad` a view into its bucket's
    flat tensor, uploaded and averaged in place, as DDP's (`gradsync.path.bucket_views`;
    CPU modules: a CUDA module's gradients are staged as usual).
    The others (`dim`, `process_group`, `mixed_precision`, `device_mesh`, ...)
    draw one warning listing them; see `gradsync.compat` for the table.

    Keyword-only, gradsync's own:
        coordinator, rank, world_size: default $GRADSYNC_COORDINATOR, $RANK, $WORLD_SIZE.
        job_id: name shared by the job's ranks; default $GRADSYNC_JOB_ID or "default".
        first_bucket_mb: cap of the first bucket (MiB), small so uploads start early.
        timeout_s: bound on every wait for the other ranks (averages, collectives).
        join_timeout_s: bound on the wait for every rank to join and for rank 0's state.
        metrics_port: Prometheus metrics on this port plus $LOCAL_RANK
            (default $GRADSYNC_METRICS_PORT; 0 = a free port; unset = off).
        metrics_host: interface the metrics endpoint binds (default
            $GRADSYNC_METRICS_HOST, else 127.0.0.1: a scraper on another host needs
            "0.0.0.0" or this host's address).
        tls_ca: PEM file of the CA that issued the coordinator's (and its shards')
            certificate: connect over TLS (default $GRADSYNC_TLS_CA; unset = plaintext).
        tls_cert, tls_key: this worker's certificate and key, for a coordinator that
            requires client certificates (mTLS) (default $GRADSYNC_TLS_CERT / _KEY).
        token: the shared secret the coordinator was started with (default
            $GRADSYNC_TOKEN, or the file named by $GRADSYNC_TOKEN_FILE). A wrong or
            missing token raises AuthenticationError; a failed TLS handshake raises
            TransportSecurityError (neither is retried).
        trace_path: write a Chrome trace-event file of every step there.
        reconnect_timeout_s: keep reconnecting to a lost coordinator this long (0 = never).
        overlap: upload each bucket as soon as its gradients are ready (default).
        wire_dtype: torch.bfloat16 or torch.float16 to send gradients and receive the
            average in 16 bits (half the bytes; the coordinator still sums in fp32; the
            roundings are listed in `gradsync.hooks`); None (default) = full precision.
        wire_answer_dtype: torch.float32 to receive the average of float32 buckets in
            float32 (the coordinator's fp32 average, not rounded back to 16 bits; twice
            the bytes down) with a 16-bit `wire_dtype`; None (default) = in `wire_dtype`.
        log_every_steps: with INFO logging, rank 0 logs step time, exposed sync time
            and bytes every this many steps (0 = never).
        hierarchical: None (default) = $GRADSYNC_HIERARCHICAL ("auto", "1" or "0"; unset:
            "auto"). "auto" or True: send this host's id (`gradsync_proto.host`)
            so that the coordinator may group the ranks of one host, which then sum their
            gradients in shared memory and upload one sum (`gradsync.local.hierarchy`); False:
            every rank uploads its own. Needs float32/float64 buckets and no comm hook or
            wire_dtype: "auto" then stays flat, True raises ValueError.
        local_rank, local_world_size: this worker's place among its host's workers and
            their number (default $LOCAL_RANK / $LOCAL_WORLD_SIZE, as torchrun sets them);
            the coordinator refuses a job whose host groups do not match LOCAL_WORLD_SIZE.
        link_factory: builds the link from (address, rank); default gRPC (with the TLS and
            token settings above). Tests pass a fake.
        outer_rounds: `gradsync.DiLoCo`'s (`OuterRounds`); None (default) for training.
        screen: how the coordinator screens every rank's gradients per bucket chunk and
            step (the same on every rank; `docs/trust.md`): "report" (default: a rank
            whose gradient norm is far from the others' or holds NaN/Inf is named,
            and merged), "clip", "exclude", "trimmed_mean" or "median" (each holds the
            step's contributions of a chunk until all arrived, and needs flat ranks:
            with hierarchical "auto" this rank stays flat, True raises ValueError).
            A rank the screen flags logs a warning naming what was wrong (at most
            every 10 s). DiLoCo passes its own (`gradsync.DiLoCo(screen=)`).

    Devices: parameters and buffers share one device, the CPU or a CUDA device
    (gradients are staged through pinned host memory and copied back); any
    other module is refused before joining. Construction blocks until all
    ranks have joined, then copies rank 0's parameters and buffers to every rank.

    Raises:
        ValueError: invalid or missing settings (an unsupported `wire_dtype` or
            `wire_answer_dtype`), or a module gradsync cannot serve.
        GradSyncError: joining failed (coordinator unreachable, join refused, ...).
    """

    def __init__(
        self,
        module: nn.Module,
        device_ids: Sequence[int | torch.device] | None = None,
        output_device: int | torch.device | None = None,
        dim: int = 0,
        broadcast_buffers: bool | None = None,
        init_sync: bool = True,
        process_group: object = None,
        bucket_cap_mb: float | None = None,
        find_unused_parameters: bool = False,
        check_reduction: bool = False,
        gradient_as_bucket_view: bool = False,
        static_graph: bool = False,
        delay_all_reduce_named_params: object = None,
        param_to_hook_all_reduce: object = None,
        mixed_precision: object = None,
        device_mesh: object = None,
        skip_all_reduce_unused_params: bool = False,
        bucket_cap_mb_list: object = None,
        batched_grad_copy: bool = False,
        forward_sync_buffers: bool | None = None,
        *,
        coordinator: str | None = None,
        rank: int | None = None,
        world_size: int | None = None,
        job_id: str | None = None,
        first_bucket_mb: float = defaults.FIRST_BUCKET_MB,
        timeout_s: float = defaults.TIMEOUT_S,
        join_timeout_s: float = defaults.JOIN_TIMEOUT_S,
        overlap: bool = True,
        metrics_port: int | None = None,
        trace_path: str | Path | None = None,
        reconnect_timeout_s: float = defaults.RECONNECT_TIMEOUT_S,
        log_every_steps: int = defaults.STEP_LOG_EVERY_STEPS,
        link_factory: LinkFactory | None = None,
        wire_dtype: torch.dtype | None = None,
        wire_answer_dtype: torch.dtype | None = None,
        metrics_host: str | None = None,
        tls_ca: str | None = None,
        tls_cert: str | None = None,
        tls_key: str | None = None,
        token: str | None = None,
        hierarchical: bool | str | None = None,
        local_rank: int | None = None,
        local_world_size: int | None = None,
        outer_rounds: OuterRounds | None = None,
        screen: str = "report",
    ) -> None:
        super().__init__()
        self.module = module
        self.config = ClientConfig.resolve(
            coordinator,
            rank,
            world_size,
            job_id,
            defaults.BUCKET_CAP_MB if bucket_cap_mb is None else bucket_cap_mb,
            first_bucket_mb,
            timeout_s,
            join_timeout_s,
            local_rank=local_rank,
            local_world_size=local_world_size,
        )
        # Files and env read now (not at import), so a bad path fails before joining.
        security = ChannelSecurity.resolve(tls_ca, tls_cert, tls_key, token)
        compat.warn_ignored(compat.ignored_arguments(locals()))
        wire_hook: WireHook | None = hooks.hook_for_wire_dtype(wire_dtype)  # refused before joining
        holds = check_screen(screen) != "report" and outer_rounds is None  # a screen that holds
        outer = outer_rounds.optimizer if outer_rounds is not None else None
        if outer_rounds is not None and outer_rounds.comm_hook is not None:
            wire_hook = outer_rounds.comm_hook
        answer_in_fp32 = hooks.answers_in_fp32(wire_dtype, wire_answer_dtype)
        named = list(module.named_parameters())
        if not any(p.requires_grad for _, p in named):
            raise ValueError("the module has no parameters that require gradients")
        named_buffers = list(module.named_buffers())
        self.device = compat.module_device(named + named_buffers)
        self._input_device = compat.input_device(device_ids, self.device)
        sync = forward_sync_buffers if forward_sync_buffers is not None else broadcast_buffers
        self.broadcast_buffers = True if sync is None else sync
        # The presence vector rides on the last bucket where it can (no message of its
        # own), but not under a screen that holds: a chunk is judged whole, and presence
        # values beside a small gradient would hide how far off that gradient is.
        buckets, plans, presence_rides = plan_layout(
            named,
            self.config,
            separate_presence=outer is not None or wire_hook is not None or holds,
        )
        requested = requested_hierarchical(hierarchical)
        if holds and requested not in ("auto", False):
            raise ValueError(
                f"screen={screen!r} screens each rank's own gradients: it needs "
                f"hierarchical=False or 'auto', got {requested!r} (a local group uploads "
                "its ranks' sum)"
            )
        self.config = dataclasses.replace(
            self.config,
            hierarchical=not holds
            and check_hierarchical(
                requested,
                [plan.dtype for plan in buckets],  # type: ignore[misc]  # torch dtypes
                wire_dtype,
            ),
        )
        self._state = _State.OPEN
        self._require_sync = True
        # As DDP: buffers are broadcast before a forward pass that follows a
        # synchronized one (or the first), not after a no_sync or no-grad pass.
        self._require_forward_param_sync = True
        self._in_join = False
        self._hooks: list[Any] = []
        presence = torch.zeros(len(named), dtype=torch.float32)
        bucket_bytes = [plan.num_bytes for plan in plans]
        self._instruments = Instruments(
            self.config.rank,
            None if outer else resolve_metrics_port(metrics_port, os.environ),  # DiLoCo's own
            Path(trace_path) if trace_path is not None else None,
            bucket_bytes,
            log_every_steps,
            metrics_host=metrics_host or os.environ.get(ENV_METRICS_HOST) or None,
        )
        try:
            self._session = Session(
                self.config,
                module,
                [p for _, p in named] + [presence] + [b for _, b in named_buffers],
                model_signature(
                    [*named, (PRESENCE_NAME, presence)],
                    named_buffers,
                    plans,
                    outer,
                    screen if outer is None else "",
                ),
                bucket_bytes,
                link_factory or functools.partial(Transport, security=security),
                self._instruments.on_bucket_event,
                reconnect_timeout_s,
            )
            self._session.resume_without_checkpoint = outer is not None
            start_step = self._session.start()
        except BaseException:
            self._instruments.close()
            raise
        self._reducer = Reducer(
            named,
            buckets,
            self.rank,
            self.world_size,
            self._instruments,
            lambda: self._session.path,
            wire_hook,
            answer_in_fp32,
            # Views are host memory: a CUDA module keeps staging through pinned buffers.
            gradient_as_bucket_view=gradient_as_bucket_view and self.device.type == "cpu",
            presence_rides=presence_rides,
        )
        self._steps = StepPath(self._reducer, self._instruments, self._session, overlap, start_step)
        self._steps.warn_screened = outer is None  # DiLoCo warns per round itself
        #: The coordinator's collectives for this job (`gradsync.collectives`).
        self.collectives = Collectives(
            lambda: self._session.link, self.rank, self.world_size, self.config.timeout_s
        )
        syncbn.attach(module, self.collectives)
        for index, (_, param) in enumerate(named):
            if param.requires_grad:
                hook = functools.partial(self._on_gradient_ready, index)
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
        return self._steps.step

    @step.setter
    def step(self, value: int) -> None:
        # `join()` moves every rank to the job's next step when uneven inputs end.
        self._steps.step = int(value)
        self._session.link.current_step = self._steps.step

    @property
    def last_contributors(self) -> int:
        """The number of ranks the last synchronized step was averaged over."""
        return self._steps.last_contributors

    @property
    def bucket_plans(self) -> list[BucketPlan]:
        """The gradient bucket layout (indices into `module.named_parameters()`)."""
        return list(self._reducer.buckets)

    @property
    def bytes_sent(self) -> int:
        """Gradient bytes uploaded so far, as sent (a 16-bit comm hook halves them)."""
        return self._instruments.bytes_sent

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Broadcast rank 0's buffers when due, then run the wrapped module's forward."""
        self._pre_forward()
        if self._input_device is not None:
            args = compat.to_device(args, self._input_device)
            kwargs = compat.to_device(kwargs, self._input_device)
        output = self.module(*args, **kwargs)
        self._require_forward_param_sync = torch.is_grad_enabled() and self._require_sync
        return output

    @compat.untraced  # network I/O: never traced
    def _pre_forward(self) -> None:
        self.step_boundary()
        if not (self.broadcast_buffers and self._require_forward_param_sync):
            return
        buffers = [b for b in self.module.buffers() if b.numel()]
        while buffers:
            try:
                self._broadcast_buffers(buffers)
                return
            except CoordinatorUnavailableError as exc:
                resumed_at, restarted = self._session.recover(exc, self._steps.step, "a forward")
                if restarted is None:
                    continue  # the job went on here with this rank's state: broadcast again
                self._steps.step = resumed_at
                raise restarted from exc

    def _broadcast_buffers(self, buffers: list[torch.Tensor]) -> None:
        src = 0
        if self._in_join:  # DDP's choice: the highest rank that still has inputs
            src = int(self.collectives.all_reduce(torch.tensor([self.rank]), "max").item())
        # All buffers travel packed in one blob: one round trip per forward pass.
        # Every rank sends its own, so the broadcast completes if rank `src` is lost.
        self.collectives.broadcast_tensors(buffers, src, every_rank_sends=True)

    def step_boundary(self) -> None:
        """Keep the boundary between two steps that `forward()` keeps before the buffers.

        A backward pass an exception interrupted is abandoned; the previous step
        is applied: a rank waiting to rejoin is handed this rank's state, and
        rank 0 checkpoints when one is due. `gradsync.DiLoCo` calls it before
        each round (its wrapper has no forward pass).

        Raises:
            ClosedError: the wrapper is closed.
        """
        if self._state is _State.CLOSED:
            raise ClosedError("DistributedDataParallel used after close()", rank=self.rank)
        if self._steps.backward_active:
            self.abandon_step("its backward pass was interrupted by an exception")
        self._session.at_step_boundary(self._steps.step)

    @property
    def welcome(self) -> pb.Welcome | None:
        """The coordinator's Welcome on the current connection (a reconnect replaces it):
        its chunk grid and, for DiLoCo, the state of its outer optimizer."""
        return self._session.welcome

    def round_report(self) -> RoundReport:
        """What the answers of the last synchronized step said beyond the averages
        (a DiLoCo round's contributors, late merges, the step to continue at)."""
        return self._session.path.round_report()

    @property
    def chunk_weight(self) -> float:
        """The weight every uploaded chunk carries (a weighted DiLoCo round: the rank's
        samples); 0 (default) = unweighted. Set before the step's backward pass."""
        return self._reducer.chunk_weight

    @chunk_weight.setter
    def chunk_weight(self, weight: float) -> None:
        self._reducer.chunk_weight = weight

    def register_comm_hook(self, state: Any, hook: CommHook) -> None:
        """Have `hook` see every gradient bucket before upload and after the average.

        As DDP's: `state` is passed to every call; register before the first
        backward, once, and on every rank alike (the coordinator refuses ranks
        that send one bucket in different dtypes). See `gradsync.hooks` for the
        protocol and the built-ins (`fp16_compress_hook`, `bf16_compress_hook`).

        Raises:
            RuntimeError: a hook is already registered (also by `wire_dtype`), or a
                step already ran.
            TypeError: `hook` lacks `before_upload` / `after_average`.
        """
        if self._steps.synced_steps or self._steps.backward_active:
            raise RuntimeError("register_comm_hook must be called before the first backward")
        if self._session.local_group is not None:
            raise RuntimeError(
                "register_comm_hook cannot be used while this rank sums its gradients in a "
                "local group (hierarchical aggregation, full precision only): pass "
                "hierarchical=False to DistributedDataParallel"
            )
        self._reducer.register_comm_hook(state, hook)

    @contextlib.contextmanager
    def join(
        self,
        divide_by_initial_world_size: bool = True,
        enable: bool = True,
        throw_on_early_termination: bool = False,
    ) -> Iterator[None]:
        """Uneven inputs, as DDP's `join()`: `with model.join(): for batch in loader: ...`.

        A rank that runs out of data tells the coordinator and waits (bounded)
        while the others finish their steps, gradients still divided by the
        world size; then every rank adopts the last rank's parameters and
        buffers. See `gradsync.uneven` (which raises ValueError for the
        options it does not support). Not with a local group (hierarchical
        aggregation): RuntimeError, pass hierarchical=False.
        """
        if enable and self._session.local_group is not None:
            # A local leader that runs out of inputs could no longer carry its
            # followers' gradients to the coordinator.
            raise RuntimeError(
                "join() (uneven inputs) cannot be used while this rank sums its gradients "
                "in a local group (hierarchical aggregation): pass hierarchical=False to "
                "DistributedDataParallel"
            )
        # Inside join() the buffers' source is the highest rank still training
        # (rank 0 may have run out of inputs), as DDP decides it.
        self._in_join = enable
        try:
            with uneven.join_context(
                self,
                enable=enable,
                divide_by_initial_world_size=divide_by_initial_world_size,
                throw_on_early_termination=throw_on_early_termination,
            ):
                yield
        finally:
            self._in_join = False

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """Reduce `tensor` in place over the ranks (op: sum, avg, min, max); return it."""
        return self.collectives.all_reduce(tensor, op)

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Overwrite `tensor` in place with rank `src`'s; return it."""
        return self.collectives.broadcast(tensor, src)

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's `tensor` (equal shapes), in rank order."""
        return self.collectives.all_gather(tensor)

    def barrier(self) -> None:
        """Return once every rank has reached its barrier (bounded by timeout_s)."""
        self.collectives.barrier()

    def abandon_step(self, reason: str = "abandoned by the training loop") -> None:
        """Give up on a synchronized step whose backward pass did not finish.

        An exception inside `backward()` skips the end-of-backward callback and
        leaves the step half uploaded. The coordinator is told to abort the step
        for every rank (they get StepAbortedError and skip it), and this rank
        moves on. The next `forward()` does this automatically.
        """
        if not self._steps.backward_active:
            return
        self._steps.abandon(reason)

    def register_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Include `optimizer`'s state in checkpoints (and restore it when resuming)."""
        self._session.register_optimizer(optimizer)

    def save_checkpoint(self, wait: bool = True, timeout_s: float | None = None) -> int:
        """Upload a checkpoint of rank 0's state through the coordinator (rank 0 only).

        Returns:
            The checkpoint's step.

        Raises:
            CheckpointFailedError: with wait=True, the store could not save it.
            SyncTimeoutError: no answer within the timeout.
        """
        return self._session.save_checkpoint(
            self._steps.step, wait, timeout_s or self.config.timeout_s
        )

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Skip synchronization inside the block; gradients accumulate locally (as DDP)."""
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
        syncbn.attach(self.module, None)
        self._session.close()
        self._instruments.close()

    def __enter__(self) -> DistributedDataParallel:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # ------------------------------------------------------------- step path
    def _on_gradient_ready(self, index: int, _: torch.Tensor) -> None:
        """Autograd hook body (see `StepPath.gradient_ready`); a closed wrapper ignores it."""
        if self._state is _State.CLOSED:
            return
        self._steps.gradient_ready(index, self._require_sync)
