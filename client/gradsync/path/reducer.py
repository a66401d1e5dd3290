"""The gradient path of one synchronized step: buckets out, averages into `.grad`.

The model wrapper (`gradsync.ddp`) owns the autograd hooks and the step's
lifecycle; this is what happens to the gradients in between, named after the
component of torch DDP that does the same job. It knows the bucket layout and
which parameters this rank used since the last synchronized step, stages each
full bucket (`gradsync.path.staging`), runs it through the comm hook if one is
registered (`gradsync.hooks`), hands it to the gradient path, and at the end of
backward adds the presence vector, waits for the averages (through a callable
the wrapper gives it, which knows about reconnecting) and writes them back.

Why a presence vector: DDP leaves `.grad` untouched for a parameter that no
rank used, which a rank cannot know alone. One float32 per parameter (1.0 =
used here), averaged like any gradient, answers it: an average of 0 means no
rank used the parameter. It costs 4 bytes per parameter per step, and the
coordinator needs no notion of it (it is the last "parameter" of the
signature, `gradsync.path.signature.PRESENCE_NAME`).

Where it travels: when the last gradient bucket is float32 (and
neither an outer optimizer nor `wire_dtype` is in play), the presence vector
rides at the end of that bucket, so a step costs no message of its own for it:
for a small model whose gradients fit one bucket, one upload and one average
per rank per step instead of two each. That bucket is the last to fill in
backward anyway (it holds the first registered parameters), and it is held
until the end of backward, when every usage mark is known. Otherwise (a
float64 or 16-bit last bucket, DiLoCo, `wire_dtype`) the vector is a bucket
of its own, uploaded after the others.

With `gradient_as_bucket_view=True` each bucket is one persistent flat
tensor that the parameters' `.grad` are views of (`gradsync.path.bucket_views`):
it is uploaded as one segment and is what a comm hook sees, with no copy.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from gradsync.config import ClientConfig
from gradsync.hooks import (
    COMPRESSED_WIRE_DTYPES,
    CommHook,
    GradBucket,
    check_comm_hook,
    check_wire_tensor,
)
from gradsync.instruments import Instruments
from gradsync.path.bucket_views import Allocator, BucketViews, BucketViewStage, allocate
from gradsync.path.bucketing import BucketPlan, assign_buckets
from gradsync.path.buffers import BucketBuffer
from gradsync.path.gradient_path import GradientPath
from gradsync.path.signature import WIRE_DTYPES, bucket_wire_dtype, presence_plan, wire_dtype
from gradsync.path.staging import BucketStage, Stage
from gradsync.quantized_wire import Int8Answer, Int8Wire, WireHook, check_int8_wire


def plan_buckets(
    named_parameters: Sequence[tuple[str, nn.Parameter]],
    bucket_cap_bytes: int,
    first_bucket_cap_bytes: int,
) -> tuple[list[BucketPlan], BucketPlan]:
    """The gradient buckets of a module, and its presence bucket (which comes last).

    See `wire_plans` for the layout the coordinator is told (the presence vector
    riding on the last bucket where it can).

    Raises:
        ValueError: a parameter's dtype cannot travel, naming it.
    """
    sizes, dtypes = [], []
    for name, param in named_parameters:
        wire_dtype(name, param)  # refuse an unsupported dtype before joining
        trainable = param.requires_grad and param.numel() > 0
        sizes.append(param.numel() * param.element_size() if trainable else 0)
        dtypes.append(param.dtype)
    plans = assign_buckets(sizes, dtypes, bucket_cap_bytes, first_bucket_cap_bytes)
    return plans, presence_plan(len(named_parameters))


def presence_can_ride(buckets: Sequence[BucketPlan], separate: bool) -> bool:
    """Whether the presence vector (float32) can travel at the end of the last bucket.

    Not with an outer optimizer (DiLoCo: its buckets hold parameters, the presence
    vector must stay a bucket the coordinator only averages) nor a `wire_dtype`
    (whose 16-bit cast the presence vector keeps out of, as float32): `separate`
    says either; and only when the last bucket is float32 (one bucket, one dtype).
    A comm hook registered later sees the gradients only (`Reducer._launch`).
    """
    return not separate and bool(buckets) and buckets[-1].dtype == torch.float32


def wire_plans(buckets: Sequence[BucketPlan], presence: BucketPlan, ride: bool) -> list[BucketPlan]:
    """The bucket layout of the signature: the presence vector last, alone or riding.

    With `ride` (`presence_can_ride`), the last bucket lists the presence vector's
    signature index after its own parameters; otherwise it is a bucket of its own.
    """
    if not ride:
        return [*buckets, presence]
    last = buckets[-1]
    merged = BucketPlan(
        (*last.parameter_indices, *presence.parameter_indices),
        last.dtype,
        last.num_bytes + presence.num_bytes,
    )
    return [*buckets[:-1], merged]


def plan_layout(
    named_parameters: Sequence[tuple[str, nn.Parameter]],
    config: ClientConfig,
    separate_presence: bool,
) -> tuple[list[BucketPlan], list[BucketPlan], bool]:
    """The gradient buckets, the signature's bucket layout, and whether the presence rides.

    `separate_presence`: keep the presence vector a bucket of its own (see
    `presence_can_ride`).
    """
    buckets, presence = plan_buckets(
        named_parameters, config.bucket_cap_bytes, config.first_bucket_cap_bytes
    )
    rides = presence_can_ride(buckets, separate_presence)
    return buckets, wire_plans(buckets, presence, rides), rides


@dataclass
class _Upload:
    """What `submit_bucket` was given for a bucket, kept to give it again after a restart.

    `recorded`: the buffer records what the transport sent (`BucketBuffer.record_sent`),
    because the averages are written over the upload as they land (the sent
    messages are then the only copy of this rank's contribution); False when
    the averages land elsewhere (`result`) or only once the step is over, so the
    uploaded bytes stay as they were.
    """

    buffer: BucketBuffer
    dtype: int
    result: BucketBuffer | None
    result_dtype: int
    recorded: bool


class _Launched:
    """A bucket handed to the gradient path: its stage, and the comm hook's view of it.

    `answered_in_place`: the averages come back in float32 straight into the
    bucket's flat buffer (`wire_answer_dtype`, or DiLoCo's int8 wire), so there
    is nothing to cast back and the hook's `after_average` must not run: it
    would overwrite them with the narrow upload. `answer`: DiLoCo's int8
    answer, dequantized into the bucket's flat buffer once the step is in.
    """

    def __init__(
        self,
        stage: Stage,
        bucket: GradBucket | None,
        wire: torch.Tensor,
        answered_in_place: bool = False,
        answer: Int8Answer | None = None,
    ) -> None:
        self.stage, self.bucket, self.wire = stage, bucket, wire
        self.answered_in_place = answered_in_place
        self.answer = answer
        self.upload: _Upload | None = None
        #: The presence vector's average, where it lands in a comm hook's wire (the
        #: wire's tail) rather than in the presence tensor itself; None otherwise.
        self.presence_tail: torch.Tensor | None = None


class Reducer:
    """Buckets, usage marks and the comm hook of one wrapper.

    Args:
        named_parameters: the module's parameters, in signature order.
        buckets: the gradient bucket layout (the presence bucket follows them).
        rank: this rank (for error messages).
        world_size: the job's size (for comm hooks).
        instruments: metrics and trace.
        path: returns the current gradient path (a reconnect replaces it).
        wire_hook: the built-in hook chosen by `wire_dtype` (`hooks.hook_for_wire_dtype`),
            registered now; None when the gradients travel in their own dtype.
        answer_in_fp32: with `wire_hook`, ask for the averages of float32 buckets
            in float32 (`wire_answer_dtype`), written straight into the buckets'
            float32 buffers; float64 buckets (which the coordinator answers only in
            the wire dtype) and the presence bucket are unaffected.
        gradient_as_bucket_view: make every `.grad` a view into its bucket's flat
            tensor now (`gradsync.path.bucket_views`; host tensors only: the wrapper
            passes it for CPU modules).
        allocator: where the bucket views' flat tensors come from.
        presence_rides: the presence vector travels at the end of the last bucket
            (`presence_can_ride`), not as a bucket of its own.
    """

    def __init__(
        self,
        named_parameters: Sequence[tuple[str, nn.Parameter]],
        buckets: Sequence[BucketPlan],
        rank: int,
        world_size: int,
        instruments: Instruments,
        path: Callable[[], GradientPath],
        wire_hook: WireHook | None = None,
        answer_in_fp32: bool = False,
        *,
        gradient_as_bucket_view: bool = False,
        allocator: Allocator = allocate,
        presence_rides: bool = False,
    ) -> None:
        self._named = list(named_parameters)
        self.buckets = list(buckets)
        self._presence_rides = presence_rides
        #: The bucket the presence vector rides on (launched at the end of backward only).
        self._rider = len(self.buckets) - 1 if presence_rides else -1
        self._rank, self._world_size = rank, world_size
        self._instruments = instruments
        self._path = path
        self.bucket_of = [-1] * len(self._named)
        for bucket_index, plan in enumerate(self.buckets):
            for index in plan.parameter_indices:
                self.bucket_of[index] = bucket_index
        self.comm_hook: WireHook | None = wire_hook
        #: The weight every chunk carries (a weighted DiLoCo round: the samples); 0 = none.
        self.chunk_weight = 0.0
        self._comm_hook_state: Any = None
        self._hook_from_wire_dtype = wire_hook is not None
        self._answer_in_fp32 = answer_in_fp32 and wire_hook is not None
        #: The buckets' flat tensors and `.grad` views (gradient_as_bucket_view), else None.
        self.views = (
            BucketViews(self._named, self.buckets, allocator) if gradient_as_bucket_view else None
        )
        #: Keep what each bucket uploaded until its step ends, so that a restarted
        #: coordinator can be sent the step in flight again (`resend`) instead of the
        #: step being computed again. Where the path writes averages over the upload
        #: before the step ends (`GradientPath.averages_land_early`: over TCP, not
        #: through a local group), the bytes come back from the encoded messages,
        #: held until the step ends (`BucketBuffer.record_sent`): memory for one
        #: copy of the gradients, and no pass over them. The step path turns it on
        #: when the session reconnects.
        self.keep_for_resend = False
        self.reset()

    def reset(self) -> None:
        """Forget the current step: nothing used, nothing launched (after each sync)."""
        self._used = [False] * len(self._named)
        self._ready = [0] * len(self.buckets)
        self._launched: list[_Launched | None] = [None] * len(self.buckets)
        self._presence = torch.zeros(0)
        self._flushed = False

    def register_comm_hook(self, state: Any, hook: CommHook) -> None:
        """See `DistributedDataParallel.register_comm_hook`."""
        check_comm_hook(hook)
        if self._hook_from_wire_dtype:
            # One hook per bucket: a user hook would replace the 16-bit cast (or be
            # stacked on it in some order), so the combination is refused outright.
            raise RuntimeError(
                f"register_comm_hook({hook!r}) cannot be combined with wire_dtype, which "
                f"already registered {self.comm_hook!r}: pass wire_dtype=None and register "
                "your hook (casting to 16 bits in its before_upload if you want both)"
            )
        if self.comm_hook is not None:
            raise RuntimeError(f"register_comm_hook can only be called once ({self.comm_hook!r})")
        self.comm_hook, self._comm_hook_state = hook, state

    def mark_used(self, index: int) -> None:
        """Parameter `index` got a gradient on this rank (synchronized pass or not)."""
        self._used[index] = True

    def gradient_ready(self, index: int, step: int, overlap: bool) -> None:
        """Count a gradient of a synchronized pass; launch its bucket once full (if overlap)."""
        bucket_index = self.bucket_of[index]
        self._ready[bucket_index] += 1
        bucket_size = len(self.buckets[bucket_index].parameter_indices)
        if overlap and self._ready[bucket_index] == bucket_size and bucket_index != self._rider:
            self._launch(bucket_index, step)

    def launch_rest(self, step: int) -> None:
        """At the end of backward: upload every bucket not launched yet, and the presence.

        Once per step (`finish` calls it unless the step path did, to record what
        it raises like a hook's failure).
        """
        if self._flushed:
            return
        self._flushed = True
        # Every usage mark of this pass is known now: the presence vector is final.
        self._presence = torch.tensor(self._used, dtype=torch.float32)
        for bucket_index, launched in enumerate(self._launched):
            if launched is None:  # the rider, or some parameter got no gradient this pass
                self._launch(bucket_index, step)
        if not self._presence_rides:
            self._submit_presence(step)

    def finish(self, step: int, wait: Callable[[int], int]) -> int:
        """Upload what is left, wait for the averages, write them to `.grad`.

        Args:
            step: the synchronized step.
            wait: waits (bounded) for the averages of `step`; returns the contributors.

        Returns:
            The number of ranks averaged over.
        """
        self.launch_rest(step)
        contributors = wait(step)  # (which may `resend` the step: read the presence after it)
        for launched in self._launched:
            if launched is not None and launched.presence_tail is not None:
                self._presence.copy_(launched.presence_tail)
        # A parameter this rank used was used somewhere: when that is every one (the
        # usual case), the presence average need not be read (a tensor op and a list).
        used_anywhere = self._used if all(self._used) else (self._presence > 0).tolist()
        for launched in self._launched:
            if launched is None:
                continue  # (cannot happen: every bucket was launched above)
            if launched.answer is not None and launched.bucket is not None:
                launched.answer.dequantize_into(launched.bucket.buffer)
            if (
                launched.bucket is not None
                and self.comm_hook is not None
                and not launched.answered_in_place
            ):
                self.comm_hook.after_average(self._comm_hook_state, launched.bucket, launched.wire)
            launched.stage.finish(used_anywhere)
        return contributors

    def resend(self, step: int) -> None:
        """Upload every bucket of `step` again, as it was first uploaded (after a restart).

        The coordinator that held this step's sums is gone and a new one continued
        at this very step; every rank still has its gradients, so nothing needs to
        be computed again. Averages that had landed over an upload are undone
        from what was sent (`keep_for_resend`, `BucketBuffer.restore_sent`).

        Raises:
            RuntimeError: the uploads were not kept (`keep_for_resend` was off).
        """
        for bucket_index, launched in enumerate(self._launched):
            if launched is None:
                continue
            upload = launched.upload
            if upload is None:
                raise RuntimeError(f"bucket {bucket_index} of step {step} was not kept to resend")
            if upload.recorded:
                upload.buffer.restore_sent()
            self._submit(step, bucket_index, upload)
        if not self._presence_rides:
            self._submit_presence(step)

    def _submit_presence(self, step: int) -> None:
        """Upload the presence bucket of `step`; its average lands in `self._presence`."""
        self._presence = torch.tensor(self._used, dtype=torch.float32)
        buffer = BucketBuffer([self._presence.view(torch.uint8).numpy()])
        presence_index = len(self.buckets)
        self._instruments.bucket_ready(step, presence_index, buffer.size)
        self._path().submit_bucket(step, presence_index, buffer, WIRE_DTYPES[torch.float32])

    def _submit(self, step: int, bucket_index: int, upload: _Upload) -> None:
        if upload.result is None:
            self._path().submit_bucket(step, bucket_index, upload.buffer, upload.dtype)
        else:
            self._path().submit_bucket(
                step,
                bucket_index,
                upload.buffer,
                upload.dtype,
                result=upload.result,
                result_dtype=upload.result_dtype,
            )

    def _launch(self, bucket_index: int, step: int) -> None:
        """Stage a bucket (through the comm hook, if any) and hand it to the gradient path."""
        plan = self.buckets[bucket_index]
        hook = self.comm_hook
        parameters = [(i, *self._named[i]) for i in plan.parameter_indices]
        stage: Stage
        if self.views is not None:
            stage = BucketViewStage(parameters, self.views.flats[bucket_index], self.views.views)
        else:
            stage = BucketStage(
                parameters,
                self._used,
                plan.dtype,  # type: ignore[arg-type]  # plans are keyed by torch dtype
                flatten=hook is not None,
            )
        bucket = None
        result: BucketBuffer | None = None
        result_dtype = WIRE_DTYPES[torch.float32]
        answer: Int8Answer | None = None
        scales: dict[int, float] | None = None
        encoded: dict[int, bytes] | None = None
        rides = bucket_index == self._rider
        presence_tail: torch.Tensor | None = None
        if hook is not None and stage.flat is not None:
            bucket = GradBucket(bucket_index, step, stage.flat, stage.names, self._world_size)
            returned = hook.before_upload(self._comm_hook_state, bucket)
            if isinstance(returned, Int8Wire):  # DiLoCo's int8 wire: float32 or int8 answers
                quantized = check_int8_wire(bucket, returned, self._rank)
                wire, scales = quantized.values, quantized.scales
                encoded = quantized.encoded  # the sparse 2-bit wire's chunks
                dtype = WIRE_DTYPES[torch.int8]
                if quantized.int8_answer:  # DiLoCo's compact answer: int8, on this very grid
                    answer = Int8Answer(wire.numel())
                    result, result_dtype = answer.buffer, dtype
            else:
                wire = check_wire_tensor(bucket, returned, self._rank)
                dtype = WIRE_DTYPES[wire.dtype]
            if rides and scales is not None:
                raise ValueError(
                    f"bucket {bucket_index} carries the presence vector, which an int8 wire "
                    "cannot (DiLoCo's int8 wire runs with a presence bucket of its own)"
                )
            uploaded = wire
            if rides:
                # The hook sees the gradients only; the presence vector follows them on the
                # wire in the hook's dtype (0/1 and their averages k/W > 0 stay exact in
                # float16/bfloat16 for any realistic world size).
                uploaded = torch.cat([wire, self._presence.to(wire.dtype)])
                wire, presence_tail = uploaded[: wire.numel()], uploaded[wire.numel() :]
            segments = [uploaded.view(torch.uint8).numpy()]
            in_fp32 = (
                self._answer_in_fp32
                and stage.flat.dtype == torch.float32
                and wire.dtype in COMPRESSED_WIRE_DTYPES
            )
            if answer is None and (scales is not None or in_fp32):
                # The fp32 averages land in the flat buffer the hook compressed from
                # (and the presence vector's in the presence tensor itself).
                result_segments = [stage.flat.view(torch.uint8).numpy()]
                if rides:
                    result_segments.append(self._presence.view(torch.uint8).numpy())
                    presence_tail = None
                result = BucketBuffer(result_segments)
        else:
            wire = torch.empty(0)
            segments = stage.segments()
            if rides:  # the average lands in the presence tensor itself
                segments.append(self._presence.view(torch.uint8).numpy())
            dtype = bucket_wire_dtype(plan)
        launched = _Launched(stage, bucket, wire, result is not None, answer)
        launched.presence_tail = presence_tail
        self._launched[bucket_index] = launched
        # Recorded as sent where an average may land over the upload right after (not
        # through a local group: its members copy the averages out at the step's end).
        record = self.keep_for_resend and result is None and self._path().averages_land_early
        if encoded is not None:  # the chunks carry their payloads, and no header scale
            scales = None
        buffer = BucketBuffer(
            segments, scales, self.chunk_weight, record_sent=record, encoded=encoded
        )
        self._instruments.bucket_ready(step, bucket_index, buffer.wire_bytes)
        upload = _Upload(buffer, dtype, result, result_dtype, record)
        if self.keep_for_resend:
            launched.upload = upload
        self._submit(step, bucket_index, upload)
