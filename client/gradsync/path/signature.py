"""A model as the coordinator sees it: torch dtypes on the wire and the Join signature.

The coordinator never imports torch; it compares ranks by the `ModelSignature`
each sends in Join (names, shapes, wire dtypes, bucket layout), so a mismatch
is refused naming the parameter and both values. The model wrapper (to plan
and upload buckets) and the session (to join) both need this translation,
hence its own module.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from gradsync_proto import dtypes
from gradsync_proto.v1 import gradsync_pb2 as pb

from gradsync.path.bucketing import BucketPlan

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


def wire_dtype(name: str, tensor: torch.Tensor) -> int:
    """The wire dtype of `tensor`.

    Raises:
        ValueError: the dtype cannot travel (complex, float8, ...), naming `name`.
    """
    try:
        return WIRE_DTYPES[tensor.dtype]
    except KeyError:
        raise ValueError(f"'{name}' has unsupported dtype {tensor.dtype}") from None


def bucket_wire_dtype(plan: BucketPlan) -> int:
    """The wire dtype of a bucket planned over torch dtypes."""
    return WIRE_DTYPES[plan.dtype]  # type: ignore[index]  # plans are keyed by torch dtype


def tensor_spec(name: str, tensor: torch.Tensor) -> pb.TensorSpec:
    """One parameter or buffer as Join describes it."""
    return pb.TensorSpec(name=name, shape=list(tensor.shape), dtype=wire_dtype(name, tensor))  # type: ignore[arg-type]


def model_signature(
    named_parameters: Sequence[tuple[str, torch.Tensor]],
    named_buffers: Sequence[tuple[str, torch.Tensor]],
    buckets: Sequence[BucketPlan],
    outer: pb.OuterOptimizer | None = None,
    screen: str = "",
) -> pb.ModelSignature:
    """The signature every rank of a job must agree on.

    With `outer` (low-communication training) the coordinator runs that outer
    optimizer on every bucket but the last (the presence vector, which follows
    the parameters' buckets). `screen`: a per-step job's screen policy.
    """
    return pb.ModelSignature(
        parameters=[tensor_spec(name, p) for name, p in named_parameters],
        buffers=[tensor_spec(name, b) for name, b in named_buffers],
        buckets=[
            pb.BucketSpec(
                parameter_indices=list(plan.parameter_indices),
                dtype=bucket_wire_dtype(plan),  # type: ignore[arg-type]
                num_elements=plan.num_bytes // dtypes.itemsize(bucket_wire_dtype(plan)),
                outer=outer is not None and index < len(buckets) - 1,
            )
            for index, plan in enumerate(buckets)
        ],
        outer=outer,
        screen=screen,
    )


#: Name of the presence vector in the signature: one float32 per parameter, 1.0
#: where this rank produced a gradient since the last synchronized step. It
#: travels as the last bucket of every step; its average says which parameters
#: some rank used (> 0) and which none did (0, their `.grad` is left alone).
#: Listed among the parameters (after the module's), so the coordinator checks
#: and averages it like any bucket and needs no notion of it.
PRESENCE_NAME = "gradsync.presence"


def presence_plan(num_parameters: int) -> BucketPlan:
    """The presence bucket: the presence vector, which follows the module's parameters."""
    return BucketPlan((num_parameters,), torch.float32, 4 * num_parameters)
