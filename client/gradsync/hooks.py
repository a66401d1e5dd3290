"""Communication hooks: see (and reshape) every gradient bucket on its way to the coordinator.

In the spirit of torch DDP's `register_comm_hook(state, hook)`: a hook is a
small object whose two methods run for every bucket of every synchronized
step, on every rank alike. `before_upload(state, bucket)` runs when the
bucket's gradients are complete and returns the 1-D tensor that goes on the
wire: the bucket as is, scaled, or cast to a 16-bit float type the
coordinator accepts for a float32/float64 bucket (it accumulates in float32
and answers in the same 16-bit type, or in float32: see below).
`after_average(state, bucket, averaged)`
runs once the average is back and writes the bucket's final gradients into
`bucket.buffer`, undoing what `before_upload` did (cast back, scale back).

Why two methods and not DDP's single `hook(state, bucket) -> Future`: the
upload and the wait for the average run on different threads here (the
network runs on the transport's event loop, the average is awaited at the end
of backward), and a future-returning hook would have to block or chain on
that loop. Splitting the hook at the network keeps it pure and synchronous:
it never sees a socket, and it is unit-tested as two plain functions.

The 16-bit wire formats are the built-in hooks `fp16_compress_hook` and
`bf16_compress_hook`, which `DistributedDataParallel(wire_dtype=...)`
registers (`hook_for_wire_dtype`); other compressions plug in the same way.
`GradientScaling` is a tiny pure-Python example that scales before upload and
back after, counting the buckets it has seen.

Roundings on the 16-bit wire, in order (a float32 bucket; a float64 one is the
same with float64 at both ends), and nowhere else:

1. client: each fp32 gradient is rounded to the 16-bit type, to nearest, ties
   to even (torch's `Tensor.to`); values beyond float16's range become inf,
   values below its normal range lose bits as subnormals (bf16 has float32's
   range, so only its 8-bit mantissa rounds);
2. coordinator: each 16-bit value is widened to fp32 (exact), the ranks'
   values are summed in fp32 in ascending rank order whatever the arrival
   order (each addition rounds in fp32), the sum is divided by the divisor
   (the number of contributions, or the world size under `join()`) in fp32
   (one rounding), and the average is rounded to the 16-bit type, to nearest,
   ties to even (`gradsync_server.dataplane.accumulators.from_accumulator`);
3. client: the 16-bit average is widened into the fp32 `.grad` (exact).

So the result is the correctly rounded 16-bit value of a (nearly exact) fp32
average of the 16-bit inputs: two 16-bit roundings per element, one on each
side. torch DDP's `default_hooks.bf16_compress_hook` / `fp16_compress_hook`
instead divide each rank's 16-bit gradient by the world size in 16 bits
(rounding again, and underflowing small fp16 values) and let the all-reduce
sum in 16 bits (rounding after every addition), so at W > 2 it rounds more:
`tests/multiprocess/test_wire_fidelity.py` measures both (and the float32
answer below) on the same gradients.

With `DistributedDataParallel(wire_answer_dtype=torch.float32)` (float32
buckets only; every chunk asks for it in `reply_dtype`) the last rounding of
step 2 is skipped: the coordinator sends the fp32 average, divided and not
rounded, and the client writes it straight into the bucket's fp32 buffer (the
one the hook compressed from), so `after_average` is not called: there is
nothing to cast, and copying the 16-bit upload back would destroy the answer.
One 16-bit rounding per element remains, of the inputs. The answer is twice
the upload's bytes (3/4 of a float32 wire's traffic in all) and comes back on
the chunk grid of a float32 bucket. A float64 bucket is answered in 16 bits
either way: the float32 answer is offered only where it lands in the bucket's
buffer as is, with no cast left on the client.

DiLoCo's int8 wire (`gradsync.quantized_wire`, not offered here) rounds twice
per element, both in fp32 and both reproduced bit for bit at both ends: x /
scale to an integer, ties to even (the scale, max|x| / 127 of the element's
chunk, is itself one rounding), then q * scale when the coordinator
dequantizes; the sum and the division are as in step 2, and the answer is
fp32. The rank's error feedback subtracts exactly that q * scale.

Registering a hook costs one copy per bucket (the bucket is flattened into a
contiguous tensor for the hook to see), except with
`gradient_as_bucket_view=True`, where `.grad` are views into that tensor
already (`gradsync.path.bucket_views`); without a hook, buckets are uploaded
straight from `param.grad` (see `gradsync.path.buffers`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

#: The dtypes a floating bucket may travel in besides its own.
COMPRESSED_WIRE_DTYPES = (torch.float16, torch.bfloat16)


@dataclass
class GradBucket:
    """One bucket of one rank's gradients, as a communication hook sees it.

    Attributes:
        index: the bucket's index in the job's bucket layout.
        step: the synchronized step.
        buffer: the bucket's gradients, flattened (1-D, contiguous, on the
            host, in the bucket's dtype). `after_average` must leave the
            final averaged gradients here.
        parameter_names: the names of the bucket's parameters, in buffer order.
        world_size: the number of ranks in the job.
    """

    index: int
    step: int
    buffer: torch.Tensor
    parameter_names: list[str]
    world_size: int

    def is_last(self, num_buckets: int) -> bool:
        """True for the last gradient bucket of a step (as DDP's `GradBucket.is_last`)."""
        return self.index == num_buckets - 1


class CommHook(Protocol):
    """What `DistributedDataParallel.register_comm_hook` accepts."""

    def before_upload(self, state: Any, bucket: GradBucket) -> torch.Tensor:
        """Return the 1-D tensor to upload for `bucket`.

        Its dtype must be the bucket's, or float16/bfloat16 for a float32 or
        float64 bucket; its length must be the bucket's. It runs on the thread
        running backward (inside an autograd hook): it must be quick and must
        not block.
        """
        ...

    def after_average(self, state: Any, bucket: GradBucket, averaged: torch.Tensor) -> None:
        """Write the final gradients of `bucket` into `bucket.buffer`.

        `averaged` is the average over the ranks of what `before_upload`
        returned, in the same dtype.
        """


class CastCompression:
    """Upload a float32/float64 bucket in a 16-bit float type; cast the average back.

    Other buckets (integers, or already 16-bit parameters) travel as they are:
    the coordinator accepts a 16-bit wire only for float32/float64 buckets, and
    a mixed-precision model should not fail because one bucket is already small.
    """

    def __init__(self, wire_dtype: torch.dtype) -> None:
        self.wire_dtype = wire_dtype

    def before_upload(self, state: Any, bucket: GradBucket) -> torch.Tensor:
        if bucket.buffer.dtype not in (torch.float32, torch.float64):
            return bucket.buffer
        return bucket.buffer.to(self.wire_dtype)

    def after_average(self, state: Any, bucket: GradBucket, averaged: torch.Tensor) -> None:
        bucket.buffer.copy_(averaged)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.wire_dtype})"


#: Payloads in float16 on the wire (half the bytes); the coordinator sums in
#: float32 and answers in float16. As torch DDP's `default_hooks.fp16_compress_hook`
#: (which sums in float16 and so rounds more at W > 2). Values beyond float16's
#: range (65504) overflow to inf: scale the loss (GradScaler) or use bf16.
fp16_compress_hook: CommHook = CastCompression(torch.float16)

#: Payloads in bfloat16 (float32's range, 8 bits of mantissa), summed in float32.
bf16_compress_hook: CommHook = CastCompression(torch.bfloat16)


#: `DistributedDataParallel(wire_dtype=...)`: the built-in hook for each 16-bit wire.
WIRE_DTYPE_HOOKS: dict[torch.dtype, CommHook] = {
    torch.float16: fp16_compress_hook,
    torch.bfloat16: bf16_compress_hook,
}


def answers_in_fp32(wire_dtype: object, wire_answer_dtype: object) -> bool:
    """Whether `DistributedDataParallel(wire_answer_dtype=...)` asks for float32 averages.

    Args:
        wire_dtype: as given to the wrapper (checked by `hook_for_wire_dtype`).
        wire_answer_dtype: None (the average comes back in `wire_dtype`) or torch.float32.

    Raises:
        ValueError: any other value, or float32 without a 16-bit `wire_dtype`
            (a full-precision wire answers in full precision already), naming both.
    """
    if wire_answer_dtype is None:
        return False
    if wire_answer_dtype is not torch.float32 or wire_dtype not in WIRE_DTYPE_HOOKS:
        raise ValueError(
            f"wire_answer_dtype={wire_answer_dtype!r} with wire_dtype={wire_dtype!r} is not "
            "supported: wire_answer_dtype=torch.float32 needs wire_dtype=torch.bfloat16 or "
            "torch.float16; None answers in the wire dtype"
        )
    return True


def hook_for_wire_dtype(wire_dtype: object) -> CommHook | None:
    """The built-in hook that puts gradients on the wire in `wire_dtype`.

    Args:
        wire_dtype: torch.bfloat16, torch.float16, or None (full precision: no hook).

    Returns:
        `bf16_compress_hook`, `fp16_compress_hook`, or None.

    Raises:
        ValueError: any other value, naming it and the accepted ones. float32 is
            refused rather than read as "no compression" so that a typo for a
            16-bit type cannot silently double the bytes on the wire.
    """
    if wire_dtype is None:
        return None
    hook = WIRE_DTYPE_HOOKS.get(wire_dtype) if isinstance(wire_dtype, torch.dtype) else None
    if hook is None:
        # int8 (a scale per chunk) is DiLoCo's wire: its rounding error is fed back
        # across rounds, which a gradient average every step in 8 bits would lack.
        int8 = (
            "; torch.int8 is the wire of gradsync.DiLoCo(wire_dtype=torch.int8) only"
            if wire_dtype is torch.int8
            else ""
        )
        raise ValueError(
            f"wire_dtype={wire_dtype!r} is not supported: use torch.bfloat16, torch.float16, "
            f"or None for full precision{int8}"
        )
    return hook


@dataclass
class GradientScaling:
    """Example hook: multiply each bucket by `factor` before upload, divide after.

    With a power-of-two factor both multiplications are exact, so training is
    unchanged: it shows the hook mechanics (and counts buckets, a place to log).
    `state` is ignored; a real hook might keep its settings there, as DDP's do.
    """

    factor: float = 1.0
    buckets_seen: int = field(default=0)

    def before_upload(self, state: Any, bucket: GradBucket) -> torch.Tensor:
        self.buckets_seen += 1
        return bucket.buffer * self.factor

    def after_average(self, state: Any, bucket: GradBucket, averaged: torch.Tensor) -> None:
        bucket.buffer.copy_(averaged / self.factor)


def check_comm_hook(hook: object) -> None:
    """Raise TypeError unless `hook` has `before_upload` and `after_average` methods."""
    for method in ("before_upload", "after_average"):
        if not callable(getattr(hook, method, None)):
            raise TypeError(
                f"{hook!r} is not a comm hook: it has no {method}() method (a hook needs "
                "before_upload(state, bucket) and after_average(state, bucket, averaged))"
            )


def check_wire_tensor(bucket: GradBucket, wire: object, rank: int) -> torch.Tensor:
    """Check what a hook returned for `bucket`; return it as a contiguous host tensor.

    Raises:
        TypeError: not a tensor.
        ValueError: wrong length or a dtype the coordinator does not accept for
            the bucket, naming rank, step, bucket and both values.
    """
    where = f"rank {rank}, step {bucket.step}, bucket {bucket.index}"
    if not isinstance(wire, torch.Tensor):
        raise TypeError(
            f"[{where}] the comm hook returned {type(wire).__name__}, expected a torch.Tensor"
        )
    own = bucket.buffer.dtype
    allowed = own == wire.dtype or (
        own in (torch.float32, torch.float64) and wire.dtype in COMPRESSED_WIRE_DTYPES
    )
    if not allowed:
        raise ValueError(
            f"[{where}] the comm hook returned {wire.dtype} for a {own} bucket; "
            f"allowed: {own}" + (", torch.float16, torch.bfloat16" if own.is_floating_point else "")
        )
    if wire.numel() != bucket.buffer.numel():
        raise ValueError(
            f"[{where}] the comm hook returned {wire.numel()} elements, "
            f"the bucket holds {bucket.buffer.numel()}"
        )
    return wire.detach().reshape(-1).to("cpu").contiguous()
