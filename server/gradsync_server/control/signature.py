"""Validation and cross-rank comparison of model signatures (pure logic).

A signature is what ranks must agree on before averaging: parameter names,
shapes and dtypes, buffers, and the bucket layout. The first rank to join a
job sets the reference; every later join is compared against it, and the
first difference is reported naming both ranks, the tensor and both values.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from gradsync_proto import dtypes
from gradsync_proto.codes import Code
from gradsync_proto.v1 import gradsync_pb2 as pb

from gradsync_server.dataplane import rounds, screening
from gradsync_server.dataplane.outer_answer import answer_dtype_of, answer_dtype_problem
from gradsync_server.errors import RejectedMessage

#: Refuse absurd sizes before allocating anything (1 TiB).
MAX_BUCKET_BYTES = 1 << 40
#: Most tensors (parameters plus buffers) a signature may list.
MAX_TENSORS = 100_000
#: Longest tensor name accepted (names are echoed in messages and logs).
MAX_NAME_CHARS = 1024
#: Most dimensions a tensor may have.
MAX_DIMS = 32


def describe(spec: pb.TensorSpec) -> str:
    """'[10, 4] float32' for error messages."""
    return f"{list(spec.shape)} {dtypes.dtype_name(spec.dtype)}"


def tensor_bytes(spec: pb.TensorSpec) -> int:
    """Size in bytes of a tensor described by `spec` (validated beforehand)."""
    return int(math.prod(spec.shape)) * dtypes.itemsize(spec.dtype)


def bucket_bytes(bucket: pb.BucketSpec) -> int:
    """Size in bytes of a bucket (validated beforehand)."""
    return bucket.num_elements * dtypes.itemsize(bucket.dtype)


def state_bytes(signature: pb.ModelSignature) -> int:
    """Size of the broadcast blob: every parameter, then every buffer."""
    return sum(tensor_bytes(spec) for spec in (*signature.parameters, *signature.buffers))


def is_collectives_only(signature: pb.ModelSignature) -> bool:
    """Whether `signature` is that of a collectives-only session: no parameters, buffers,
    buckets or outer optimizer. A torch.distributed process group (`gradsync.distributed`)
    joins with it: its job runs heartbeats, status and collectives, and no steps."""
    return not (
        signature.parameters
        or signature.buffers
        or signature.buckets
        or signature.HasField("outer")
    )


def validate(rank: int, signature: pb.ModelSignature) -> None:
    """Check that one rank's signature is internally consistent.

    Raises:
        RejectedMessage: INVALID_ARGUMENT naming the rank and the offending entry.
    """

    def refuse(message: str) -> RejectedMessage:
        return RejectedMessage(Code.INVALID_ARGUMENT, f"rank {rank}: {message}")

    if is_collectives_only(signature):
        return  # a process group's job: collectives only, nothing to average or broadcast
    if not signature.parameters:
        raise refuse("the model signature lists no trainable parameters")
    tensors = len(signature.parameters) + len(signature.buffers)
    if tensors > MAX_TENSORS:
        raise refuse(f"the model signature lists {tensors} tensors; at most {MAX_TENSORS}")
    if len(signature.buckets) > len(signature.parameters):
        raise refuse(
            f"the model signature lists {len(signature.buckets)} buckets for "
            f"{len(signature.parameters)} parameters"
        )
    for kind, specs in (("parameter", signature.parameters), ("buffer", signature.buffers)):
        for spec in specs:
            if len(spec.name) > MAX_NAME_CHARS or not spec.name.isprintable():
                raise refuse(
                    f"{kind} name {spec.name[:64]!r} ({len(spec.name)} characters) must be "
                    f"printable and at most {MAX_NAME_CHARS} characters"
                )
            if len(spec.shape) > MAX_DIMS:
                raise refuse(
                    f"{kind} '{spec.name}' has {len(spec.shape)} dimensions; at most {MAX_DIMS}"
                )
            if not dtypes.is_supported_dtype(spec.dtype):
                raise refuse(f"{kind} '{spec.name}' has unsupported dtype {spec.dtype}")
            if any(dim < 0 for dim in spec.shape):
                raise refuse(f"{kind} '{spec.name}' has a negative dimension {list(spec.shape)}")
    owner: dict[int, int] = {}
    for bucket_index, bucket in enumerate(signature.buckets):
        if bucket.dtype not in dtypes.REDUCIBLE_DTYPES:
            raise refuse(
                f"bucket {bucket_index} has dtype {dtypes.dtype_name(bucket.dtype)}; "
                "gradients must be float32, float64, float16 or bfloat16"
            )
        elements = 0
        for index in bucket.parameter_indices:
            if index >= len(signature.parameters):
                raise refuse(
                    f"bucket {bucket_index} lists parameter index {index}, "
                    f"but the model has {len(signature.parameters)} parameters"
                )
            if index in owner:
                raise refuse(
                    f"parameter index {index} is in bucket {owner[index]} and bucket {bucket_index}"
                )
            owner[index] = bucket_index
            spec = signature.parameters[index]
            if spec.dtype != bucket.dtype:
                raise refuse(
                    f"bucket {bucket_index} is {dtypes.dtype_name(bucket.dtype)} but its "
                    f"parameter '{spec.name}' is {describe(spec)}"
                )
            elements += tensor_bytes(spec) // dtypes.itemsize(spec.dtype)
        if elements != bucket.num_elements or elements == 0:
            raise refuse(
                f"bucket {bucket_index} declares {bucket.num_elements} elements, "
                f"its parameters hold {elements} (a bucket must not be empty)"
            )
        if bucket_bytes(bucket) > MAX_BUCKET_BYTES:
            raise refuse(f"bucket {bucket_index} is larger than {MAX_BUCKET_BYTES} bytes")
    if signature.screen not in ("", *screening.POLICIES):
        raise refuse(
            f"screen must be one of {', '.join(screening.POLICIES)}, got {signature.screen!r}"
        )
    if signature.screen and signature.HasField("outer"):
        raise refuse("a DiLoCo job's screen is its outer optimizer's (outer.screen)")
    _validate_outer(signature, refuse)


def _validate_outer(signature: pb.ModelSignature, refuse: Callable[[str], RejectedMessage]) -> None:
    """An outer optimizer (DiLoCo) must be usable, and held only on float32 parameters."""
    outer_buckets = [i for i, b in enumerate(signature.buckets) if b.outer]
    if not signature.HasField("outer"):
        if outer_buckets:
            raise refuse(f"buckets {outer_buckets} are marked outer, but no outer optimizer is set")
        return
    outer = signature.outer
    if not (math.isfinite(outer.lr) and outer.lr > 0):
        raise refuse(f"the outer learning rate must be finite and > 0, got {outer.lr}")
    if not (math.isfinite(outer.momentum) and 0 <= outer.momentum < 1):
        raise refuse(f"the outer momentum must be in [0, 1), got {outer.momentum}")
    if outer.nesterov and outer.momentum == 0:
        raise refuse("Nesterov outer momentum needs a momentum > 0")
    if not outer_buckets:
        raise refuse("an outer optimizer is set, but no bucket is marked outer")
    problem = rounds.policy_problem(outer)
    if problem is None and outer.screen not in ("", *screening.POLICIES):
        problem = f"screen must be one of {', '.join(screening.POLICIES)}, got {outer.screen!r}"
    if problem is None:
        problem = answer_dtype_problem(outer)
    if problem is not None:
        raise refuse(problem)
    for index in outer_buckets:
        if signature.buckets[index].dtype != pb.DTYPE_FLOAT32:
            raise refuse(
                f"bucket {index} is {dtypes.dtype_name(signature.buckets[index].dtype)}: the "
                "coordinator holds global parameters in float32, so outer buckets must be float32"
            )


def first_difference(
    reference_rank: int,
    reference: pb.ModelSignature,
    rank: int,
    candidate: pb.ModelSignature,
) -> str | None:
    """Describe the first way `candidate` differs from `reference`, or None."""
    for kind, ours, theirs in (
        ("parameters", reference.parameters, candidate.parameters),
        ("buffers", reference.buffers, candidate.buffers),
    ):
        if len(ours) != len(theirs):
            return f"rank {rank} has {len(theirs)} {kind}, rank {reference_rank} has {len(ours)}"
        for position, (expected, got) in enumerate(zip(ours, theirs, strict=True)):
            if expected.name != got.name:
                return (
                    f"{kind[:-1]} #{position} is named '{got.name}' on rank {rank} "
                    f"but '{expected.name}' on rank {reference_rank}"
                )
            if list(expected.shape) != list(got.shape) or expected.dtype != got.dtype:
                return (
                    f"{kind[:-1]} '{got.name}' is {describe(got)} on rank {rank} "
                    f"but {describe(expected)} on rank {reference_rank}"
                )
    if len(reference.buckets) != len(candidate.buckets):
        return (
            f"rank {rank} has {len(candidate.buckets)} buckets, rank {reference_rank} has "
            f"{len(reference.buckets)} (do all ranks use the same bucket_cap_mb?)"
        )
    if reference.HasField("outer") != candidate.HasField("outer") or (
        reference.outer != candidate.outer
    ):
        return (
            f"rank {rank} has outer optimizer {_outer_words(candidate)}, rank {reference_rank} "
            f"{_outer_words(reference)} (every rank must pass the same outer settings)"
        )
    if (reference.screen or "report") != (candidate.screen or "report"):
        return (
            f"rank {rank} asks for screen {candidate.screen or 'report'!r}, rank "
            f"{reference_rank} for {reference.screen or 'report'!r} (every rank must pass "
            "the same screen=)"
        )
    for bucket_index, (expected_bucket, got_bucket) in enumerate(
        zip(reference.buckets, candidate.buckets, strict=True)
    ):
        if list(expected_bucket.parameter_indices) != list(got_bucket.parameter_indices):
            return (
                f"bucket {bucket_index} holds parameters {list(got_bucket.parameter_indices)} "
                f"on rank {rank} but {list(expected_bucket.parameter_indices)} on rank "
                f"{reference_rank} (do all ranks use the same bucket_cap_mb?)"
            )
    return None


def _outer_words(signature: pb.ModelSignature) -> str:
    """An outer optimizer for messages ("none", or its settings)."""
    if not signature.HasField("outer"):
        return "none"
    outer = signature.outer
    words = f"lr {outer.lr:g}, momentum {outer.momentum:g}, nesterov {outer.nesterov}"
    if outer.min_contributors or outer.weighted:
        words += (
            f", min_contributors {outer.min_contributors}, round_deadline_s "
            f"{'auto' if outer.round_deadline_auto else format(outer.round_deadline_s, 'g')}"
            f", merge_late {outer.merge_late}, max_staleness "
            f"{outer.max_staleness}, weighted {outer.weighted}"
        )
    words += f", answer_dtype {dtypes.dtype_name(answer_dtype_of(outer))}"
    words += f", screen {outer.screen or 'report'!r}"
    return f"({words})"
