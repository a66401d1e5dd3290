"""One fragment of a `gradsync.DiLoCo` model: the parameters it syncs and how it syncs them.

A round uploads the fragment's pseudo-gradients as one synchronized backward
pass of a `DistributedDataParallel` wrapped around a *shadow* module: copies
of the fragment's parameters that only rounds touch. The user's model is
never wrapped, so its own backward passes stay local, and a round can be in
flight on a background thread while the inner loop goes on (Streaming
DiLoCo's overlap): nothing the round reads or writes is shared with the
inner steps. The answer, the coordinator's new global parameters, lands in
the shadow's `.grad`; `apply` merges it into the model.

With a compact answer (`answer_dtype` int8 or bfloat16) what lands in `.grad`
after every round but the seed is the change of the global parameters,
dequantized in float32 (int8: `gradsync.quantized_wire.Int8Answer`; bfloat16: the cast
hook widens it exactly), and `wait` adds it to the global parameters the rank
holds, with one float32 add, as the coordinator adds it to its public copy
(`gradsync_server.dataplane.outer_answer`): every rank and the coordinator's
public copy stay bitwise the same, within one quantization step of the exact
global parameters, and pseudo-gradients are taken against that copy.

Each fragment is its own job on the coordinator (`<job>.fragment<i>` when
there are several), with its own outer optimizer state.

A round may close without this rank (a DiLoCo job with `min_contributors`):
its upload is then late, the coordinator answers it with the current global
parameters and the step to continue at (`RoundReport.next_step`), and the
wrapper jumps there, so the rank holds the global model and joins the open
round. `last_report` says how each round went (contributors, late merges).

A restarted coordinator either restored its outer state from its store
(`Welcome.outer_replay`: the global parameters, the momentum, the round) or
holds none. Restored, it replays the last round it committed: every rank
takes part in that step in float32, a rank whose round it was takes the
answer it missed, a rank that had it already checks that the answer is what
it holds and then repeats its own round (`_replay`). Without a stored state
every rank still holds the latest global parameters, so the round seeds it
with them and is repeated (the outer momentum starts from zero). Either way
nothing is recomputed and no rank rolls back.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import torch
from gradsync_proto.v1 import gradsync_pb2 as pb
from torch import nn

from gradsync.ddp import DistributedDataParallel, OuterRounds
from gradsync.errors import CoordinatorRestartedError, GradSyncError, SyncTimeoutError
from gradsync.hooks import CastCompression, GradBucket
from gradsync.path.step_results import RoundReport
from gradsync.quantized_wire import ChunkGrid, Int8Quantization
from gradsync.sparse_wire import SparseQuantization, SparseWire

__all__ = ["Fragment"]

log = logging.getLogger("gradsync.client")

#: How many coordinator restarts one round rides out before it fails.
RESTARTS_PER_ROUND = 3


class _SeedableCast(CastCompression):
    """The comm hook of a 16-bit DiLoCo wire: the seed round travels in float32.

    The seed is the global parameters themselves, which must reach the
    coordinator exactly; pseudo-gradients are rounded to `wire_dtype` (their
    error is fed back by the fragment). Answers are float32 either way.
    """

    def __init__(self, wire_dtype: torch.dtype) -> None:
        super().__init__(wire_dtype)
        self.seeding = True

    def before_upload(self, state: Any, bucket: GradBucket) -> torch.Tensor:
        if self.seeding or bucket.buffer.dtype != torch.float32:
            return bucket.buffer
        return super().before_upload(state, bucket)


class _Shadow(nn.Module):
    """Copies of some parameters, registered in order (what a fragment's rounds carry),
    under `names` if given (no dots), else by position."""

    def __init__(self, params: Sequence[torch.Tensor], names: Sequence[str] | None) -> None:
        super().__init__()
        copies = [nn.Parameter(p.detach().clone(), requires_grad=True) for p in params]
        self.copies: nn.ParameterList | nn.ParameterDict = (
            nn.ParameterList(copies)
            if names is None
            else nn.ParameterDict(OrderedDict(zip(names, copies, strict=True)))  # (a dict: sorted)
        )

    def ordered(self) -> list[nn.Parameter]:
        copies = self.copies
        return list(copies.values() if isinstance(copies, nn.ParameterDict) else copies)


class Fragment:
    """The rounds of some of a model's parameters (see the module docstring).

    Args:
        params: the model's parameters this fragment synchronizes (all share the
            rounds; construction makes them rank 0's).
        outer: the outer optimizer the coordinator runs for them.
        wire_dtype: pseudo-gradients on the wire (None = float32).
        error_feedback: keep each round's rounding error for the next round.
        job_id: the coordinator job of this fragment (None = the default job).
        options: the rest of `DistributedDataParallel`'s arguments.
        answer_dtype: None (the global parameters in float32), torch.int8 (with an int8
            wire) or torch.bfloat16 (with a bfloat16 wire): the answers are then changes.
        names: the names the parameters carry in the job's signature (None: by position).
        sparse: the sparse 2-bit wire's settings (then `wire_dtype` and `answer_dtype`
            are torch.int8, `gradsync.sparse_wire.sparse_settings`); None = dense.
    """

    #: Bytes the last round uploaded (as sent) and received (the answers, which fill
    #: every bucket in float32, or compact: the transport checks each answer's size),
    #: and its `time.perf_counter()` start and end (the trace's clock).
    last_round_bytes = 0
    last_round_received = 0
    last_round_started = last_round_finished = 0.0
    #: What the coordinator said of the last round (contributors, late merges, ...).
    last_report = RoundReport()

    def __init__(
        self,
        params: Sequence[torch.Tensor],
        outer: pb.OuterOptimizer,
        wire_dtype: torch.dtype | None,
        error_feedback: bool,
        job_id: str | None,
        options: dict[str, Any],
        answer_dtype: torch.dtype | None = None,
        names: Sequence[str] | None = None,
        sparse: SparseWire | None = None,
    ) -> None:
        self.params = list(params)
        self._shadow = _Shadow(self.params, names)
        int8 = wire_dtype is torch.int8
        #: Answers after the seed are changes of the global parameters, not themselves.
        self.compact_answer = answer_dtype is not None
        self._answer_is_change = False  # this round's (the seed's: the parameters)
        self._hook: _SeedableCast | Int8Quantization | None = None
        if sparse is not None:  # int8 chunks, each its top-k in 2 bits (a SparseWire)
            self._hook = SparseQuantization(
                lambda: ChunkGrid.of(self.ddp.welcome), error_feedback, sparse.density
            )
        elif int8:  # the cut is the transport's, known once joined: read at every bucket
            self._hook = Int8Quantization(
                lambda: ChunkGrid.of(self.ddp.welcome),
                error_feedback,
                int8_answer=answer_dtype is torch.int8,
            )
        elif wire_dtype is not None:
            self._hook = _SeedableCast(wire_dtype)
        self.ddp = DistributedDataParallel(
            self._shadow,
            job_id=job_id,
            broadcast_buffers=False,
            # The wrapper refuses int8 (not a per-step wire): DiLoCo installs its own hook.
            wire_dtype=None if int8 else wire_dtype,
            # A 16-bit wire's answers come back in float32, or as 16-bit changes (compact).
            wire_answer_dtype=(
                None if wire_dtype is None or int8 or self.compact_answer else torch.float32
            ),
            # In place of the built-in cast `wire_dtype` picks: one that lets the seed
            # through in fp32. Its state lives in the ranks: a coordinator restarted
            # without a checkpoint is seeded again with it (`_run`, after a restart).
            outer_rounds=OuterRounds(outer, self._hook),
            **options,
        )
        self._copies = self._shadow.ordered()
        # A 16-bit wire's error, per parameter (int8 keeps its own per bucket, in the hook).
        per_parameter = error_feedback and wire_dtype is not None and not int8
        self._residuals = [torch.zeros_like(p) for p in self.params] if per_parameter else None
        # Rank 0's parameters, broadcast into the shadow at construction: everyone's start.
        with torch.no_grad():
            for p, copy in zip(self.params, self._copies, strict=True):
                p.copy_(copy)
        self.global_params = [p.detach().clone() for p in self.params]
        self._thread: threading.Thread | None = None
        self._failure: BaseException | None = None
        #: Weighted rounds: the weight this rank's chunks carry (its samples; 1 at the seed).
        self.weighted = outer.weighted
        welcome = self.ddp.welcome
        # A rank joining a running job was healed with rank 0's shadow, which holds the
        # global parameters; the coordinator holds them already: nothing to seed. A
        # coordinator that restored its outer state from its store hands them out.
        if welcome is not None and welcome.outer_repeat:
            self.ddp.close()
            raise GradSyncError(
                "joined a restarted coordinator that is resuming a round in flight (its shards "
                "saved different steps); only the ranks that ran that round can finish it: "
                "restart the coordinator with --fresh-start or a new job id",
                rank=self.ddp.rank,
            )
        if welcome is not None and welcome.outer_replay:
            self._adopt_restored()
        elif welcome is None or not welcome.outer_seeded:
            self.start(seed=True)
            self.wait()

    @property
    def in_flight(self) -> bool:
        """True while a round's answer has not been applied."""
        return self._thread is not None

    def start(self, seed: bool = False, weight: float = 1.0) -> None:
        """Upload the pseudo-gradients now (the parameters, to seed); return at once.

        The round runs on a thread of its own; `wait` (or `apply`) collects it.

        Args:
            weight: a weighted job's weight of this rank in the round (its samples
                since its last round; > 0). Ignored unweighted.
        """
        if self._thread is not None:
            raise RuntimeError("a round of this fragment is already in flight")
        self.ddp.chunk_weight = weight if self.weighted else 0.0
        # The step boundary DDP keeps before a forward pass: a rank waiting to rejoin is
        # handed the shadow (the global parameters) here, and rank 0 checkpoints.
        self.ddp.step_boundary()
        with torch.no_grad():
            if seed:
                uploads = [p.detach().clone() for p in self.params]
            else:
                uploads = [g - p for g, p in zip(self.global_params, self.params, strict=True)]
                if self._residuals is not None and isinstance(self._hook, _SeedableCast):
                    wire = self._hook.wire_dtype
                    for upload, residual in zip(uploads, self._residuals, strict=True):
                        upload += residual
                        residual.copy_(upload - upload.to(wire).to(upload.dtype))
        if self._hook is not None:
            self._hook.seeding = seed
        self._answer_is_change = self.compact_answer and not seed
        self._failure = None
        self._thread = threading.Thread(
            target=self._run, args=(uploads,), name="gradsync-diloco-round", daemon=True
        )
        self._thread.start()

    @property
    def last_round_s(self) -> float:
        """Seconds of the last round, upload start to answer."""
        return self.last_round_finished - self.last_round_started

    def _run(self, uploads: list[torch.Tensor]) -> None:
        started, sent = time.perf_counter(), self.ddp.bytes_sent
        round_step = self.ddp.step
        try:
            for attempt in range(1, RESTARTS_PER_ROUND + 2):
                try:
                    self._exchange(uploads)
                    break
                except CoordinatorRestartedError as exc:
                    if attempt > RESTARTS_PER_ROUND:
                        raise
                    welcome = self.ddp.welcome
                    if welcome is not None and welcome.outer_replay:
                        if self._replay(round_step, exc):
                            break
                        continue
                    if welcome is not None and welcome.outer_repeat:
                        self._check_repeat(round_step, exc)
                        continue
                    log.warning(
                        "rank %d: %s; the coordinator holds no outer state: seeding it again "
                        "with the global parameters and repeating the round (no inner step is "
                        "lost; the outer momentum restarts from zero)",
                        self.ddp.rank,
                        exc,
                    )
                    # A restarted coordinator knows no global parameters: every rank holds
                    # the latest ones (bitwise the same), so they seed it, in float32. A
                    # rank that did not lose it would find it seeded (cannot happen today).
                    if welcome is None or not welcome.outer_seeded:
                        self._exchange_seeding()
        except BaseException as exc:  # raised where the round is collected
            self._failure = exc
        self.last_round_bytes = self.ddp.bytes_sent - sent
        self.last_round_received = self._answer_bytes()
        self.last_round_started, self.last_round_finished = started, time.perf_counter()

    def _answer_bytes(self) -> int:
        """Payload bytes of a round's answers: the parameters in float32, or the changes
        (bfloat16; int8 and a float32 scale per chunk of the upload's grid; sparse: as
        they arrived)."""
        elements = int(sum(c.numel() for c in self._copies))
        if not self._answer_is_change:
            return 4 * elements
        if isinstance(self._hook, SparseQuantization):  # as many as arrived
            return self.last_report.payload_bytes
        if not isinstance(self._hook, Int8Quantization):
            return 2 * elements  # bfloat16
        grid = ChunkGrid.of(self.ddp.welcome)
        chunks = sum(
            len(grid.spans(int(sum(self._copies[i].numel() for i in plan.parameter_indices))))
            for plan in self.ddp.bucket_plans
        )
        return elements + 4 * chunks

    def _exchange(self, uploads: list[torch.Tensor]) -> None:
        """One synchronized backward pass whose gradients are the uploads: the
        wrapper's hooks fire, buckets go out as they fill, and the answers land in
        the shadow's `.grad` before it returns. A late round moves the wrapper on to
        the coordinator's open step."""
        for copy in self._copies:
            copy.grad = None
        torch.autograd.backward(self._copies, grad_tensors=uploads)
        self.last_report = self.ddp.round_report()
        if self.last_report.screened:
            log.warning(
                "rank %d: the coordinator's screen flagged this rank's pseudo-gradient in "
                "round %d: %s",
                self.ddp.rank,
                self.ddp.step - 1,
                self.last_report.screened,
            )
        if self.last_report.next_step:
            log.info(
                "rank %d: round %d closed without this rank; its contribution was late, it "
                "holds the global parameters and continues at round %d",
                self.ddp.rank,
                self.ddp.step - 1,
                self.last_report.next_step,
            )
            self.ddp.step = self.last_report.next_step

    def _replay(self, round_step: int, cause: CoordinatorRestartedError) -> bool:
        """Take part in the restored coordinator's replay of its last committed step.

        Returns True if that step was this rank's round (its answer, which this rank
        missed or never got, is now in the shadow's `.grad`), False if this rank had
        that answer already (checked bitwise) and must repeat its own round next.

        Raises:
            GradSyncError: the restored step is neither this rank's round nor the one
                before it (a save was lost: resuming would need recomputation), or the
                replayed answer differs from the global parameters this rank holds.
        """
        replayed = self.ddp.step  # the restarted coordinator resumed the job there
        rank = self.ddp.rank
        if round_step not in (replayed, replayed + 1):
            raise GradSyncError(
                f"the restarted coordinator restored its outer state of step {replayed}, but "
                f"this rank's round is step {round_step}: it cannot resume without recomputing "
                "(was an outer-state save lost? see the coordinator's log)",
                rank=rank,
                step=round_step,
            ) from cause
        log.warning(
            "rank %d: %s; the coordinator restored its outer state of step %d: %s",
            rank,
            cause,
            replayed,
            "taking that round's answer"
            if round_step == replayed
            else f"checking it, then repeating round step {round_step} (no inner step is lost)",
        )
        self._exchange_seeding()
        if round_step == replayed:
            return True
        for index, (copy, held) in enumerate(zip(self._copies, self.global_params, strict=True)):
            if copy.grad is None or not torch.equal(copy.grad, held):
                raise GradSyncError(
                    f"the restarted coordinator's replay of step {replayed} answered other "
                    f"global parameters than this rank holds since that step (parameter "
                    f"{index} of this fragment differs)",
                    rank=rank,
                    step=replayed,
                ) from cause
        return False

    def _check_repeat(self, round_step: int, cause: CoordinatorRestartedError) -> None:
        """The restored shards saved two consecutive steps: none released the newer one's
        answer, so this rank's round is that step, which it uploads again as it was.

        Raises:
            GradSyncError: this rank's round is another step (it cannot be resumed).
        """
        resumed = self.ddp.step
        if round_step != resumed:
            raise GradSyncError(
                f"the restarted coordinator resumed step {resumed} to be uploaded again, but "
                f"this rank's round is step {round_step}",
                rank=self.ddp.rank,
                step=round_step,
            ) from cause
        log.warning(
            "rank %d: %s; the coordinator restored its outer state: uploading round step %d "
            "again (no inner step is lost)",
            self.ddp.rank,
            cause,
            round_step,
        )

    def _adopt_restored(self) -> None:
        """A fresh rank joined a coordinator that restored its outer state: take it over."""
        self.ddp.step_boundary()
        self._exchange_seeding()
        with torch.no_grad():
            pairs = zip(self.params, self._copies, self.global_params, strict=True)
            for p, copy, global_p in pairs:
                assert copy.grad is not None
                global_p.copy_(copy.grad)
                copy.copy_(copy.grad)
                p.copy_(copy.grad)
        log.warning(
            "rank %d: the coordinator restored its outer state: starting from its global "
            "parameters (step %d)",
            self.ddp.rank,
            self.ddp.step - 1,
        )

    def _exchange_seeding(self) -> None:
        """One exchange of the global parameters in float32 (what a seed or a replay sends)."""
        if self._hook is not None:
            self._hook.seeding = True
        try:
            self._exchange([g.clone() for g in self.global_params])
        finally:
            if self._hook is not None:
                self._hook.seeding = False

    def wait(self) -> list[torch.Tensor]:
        """Wait (bounded) for the round in flight; return the new global parameters.

        Raises:
            GradSyncError: the round failed (as a backward pass of DDP would raise).
        """
        thread = self._thread
        if thread is None:
            raise RuntimeError("no round of this fragment is in flight")
        thread.join(timeout=self.ddp.config.timeout_s + 30.0)
        if thread.is_alive():
            raise SyncTimeoutError(
                f"an outer round did not finish within {self.ddp.config.timeout_s:g}s",
                rank=self.ddp.rank,
                step=self.ddp.step,
            )
        self._thread = None
        if self._failure is not None:
            raise self._failure
        with torch.no_grad():
            for copy, global_p in zip(self._copies, self.global_params, strict=True):
                assert copy.grad is not None
                if self._answer_is_change:
                    # public += change: one float32 add (alpha 1, so even a fused
                    # multiply-add kernel rounds once), the coordinator's own operation.
                    global_p.add_(copy.grad)
                else:
                    global_p.copy_(copy.grad)
                # The shadow holds them too: what a rank joining later is healed with.
                copy.copy_(global_p)
        return self.global_params

    def apply(self, mixing: float = 1.0) -> None:
        """Collect the round in flight and merge the global parameters into the model.

        `mixing` = 1 replaces the fragment's parameters with the global ones; below 1
        (a round that overlapped inner steps) keeps that share of their local progress:
        p = mixing * global + (1 - mixing) * p.
        """
        global_params = self.wait()
        with torch.no_grad():
            for p, global_p in zip(self.params, global_params, strict=True):
                if mixing == 1.0:
                    p.copy_(global_p)
                else:
                    p.mul_(1.0 - mixing).add_(global_p, alpha=mixing)

    def close(self) -> None:
        """Leave the fragment's job (after its round in flight, if any, ended)."""
        if self._thread is not None:
            self._thread.join(timeout=self.ddp.config.timeout_s + 30.0)
            self._thread = None
        self.ddp.close()
