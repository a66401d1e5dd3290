"""`DistributedDataParallel(wire_dtype=...)`: the option, and the 16-bit arithmetic end to end.

The option's promises over a fake link: it registers the matching built-in
hook (16-bit uploads, half the bytes), refuses any other dtype before joining,
and refuses a comm hook on top. Then the arithmetic without sockets: each
rank's bucket goes through the built-in hook's `before_upload`, the
coordinator's own `BucketReduction` (in every arrival order), and
`after_average`, and must equal the pure-torch rounding reference bitwise
(`support.wire_reference`); the real processes do the same in
tests/multiprocess/test_wire_fidelity.py.
"""

from __future__ import annotations

import itertools
from typing import Any

import gradsync
import pytest
import torch
from gradsync import hooks
from gradsync.path.signature import WIRE_DTYPES
from gradsync_proto import chunking
from gradsync_server.dataplane.aggregation import BucketReduction
from support import wire_reference
from support.fakelink import LinkFactory
from torch import nn

pytestmark = pytest.mark.unit

SIXTEEN_BIT = [torch.bfloat16, torch.float16]


def wrap(factory: LinkFactory, **kwargs: Any) -> Any:
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    return gradsync.DistributedDataParallel(
        module, coordinator="fake:1", rank=0, world_size=2, link_factory=factory, **kwargs
    )


def step(model: nn.Module) -> None:
    generator = torch.Generator().manual_seed(1)
    x, y = torch.randn(5, 4, generator=generator), torch.randn(5, 2, generator=generator)
    nn.functional.mse_loss(model(x), y).backward()  # type: ignore[no-untyped-call]


@pytest.mark.parametrize("wire_dtype", SIXTEEN_BIT, ids=str)
def test_wire_dtype_uploads_gradients_in_16_bits(wire_dtype: torch.dtype) -> None:
    factory = LinkFactory()
    model = wrap(factory, wire_dtype=wire_dtype)
    assert model._reducer.comm_hook is hooks.WIRE_DTYPE_HOOKS[wire_dtype]
    step(model)
    gradient_uploads = factory.link.uploads[:-1]  # the presence bucket stays float32
    assert {upload[3] for upload in gradient_uploads} == {WIRE_DTYPES[wire_dtype]}
    parameters = sum(p.numel() for p in model.module.parameters())
    assert sum(upload[2].size for upload in gradient_uploads) == parameters * 2
    for param in model.module.parameters():
        assert param.grad is not None and param.grad.dtype == torch.float32


@pytest.mark.parametrize("answer", [None, torch.float32], ids=str)
def test_wire_answer_dtype_float32_leaves_the_unrounded_average_in_grad(
    answer: torch.dtype | None,
) -> None:
    factory = LinkFactory()
    model = wrap(factory, wire_dtype=torch.bfloat16, wire_answer_dtype=answer)
    # An offset bf16 cannot hold: a 16-bit answer would round it, a float32 one must not.
    factory.link.peer_value = 1e-3
    torch.manual_seed(0)
    local = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    step(local)
    step(model)
    gradient_uploads = factory.link.uploads[:-1]
    assert {upload[3] for upload in gradient_uploads} == {WIRE_DTYPES[torch.bfloat16]}
    asked = {result_dtype for _, result_dtype in factory.link.results.values()}
    assert asked == (set() if answer is None else {WIRE_DTYPES[torch.float32]})
    for mine, theirs in zip(model.module.parameters(), local.parameters(), strict=True):
        assert theirs.grad is not None and mine.grad is not None
        average = theirs.grad.to(torch.bfloat16).float() * 0.5 + 1e-3
        expected = average if answer is not None else average.to(torch.bfloat16).float()
        assert torch.equal(mine.grad, expected)


@pytest.mark.parametrize(
    ("wire_dtype", "answer"),
    [(None, torch.float32), (torch.bfloat16, torch.float16), (torch.float16, torch.float64)],
    ids=str,
)
def test_other_wire_answer_dtypes_are_refused_before_joining(
    wire_dtype: torch.dtype | None, answer: torch.dtype
) -> None:
    factory = LinkFactory()
    with pytest.raises(ValueError, match=r"wire_answer_dtype=.* with wire_dtype=") as refused:
        wrap(factory, wire_dtype=wire_dtype, wire_answer_dtype=answer)
    assert str(answer) in str(refused.value) and str(wire_dtype) in str(refused.value)
    assert factory.links == [], "refused before joining"


def test_no_wire_dtype_uploads_full_precision() -> None:
    factory = LinkFactory()
    model = wrap(factory)
    assert model._reducer.comm_hook is None
    step(model)
    assert {upload[3] for upload in factory.link.uploads} == {WIRE_DTYPES[torch.float32]}


@pytest.mark.parametrize(
    "wire_dtype", [torch.float32, torch.float64, torch.int8, "bfloat16"], ids=str
)
def test_other_wire_dtypes_are_refused_before_joining(wire_dtype: Any) -> None:
    factory = LinkFactory()
    with pytest.raises(ValueError, match=r"wire_dtype=.* is not supported: use torch.bfloat16"):
        wrap(factory, wire_dtype=wire_dtype)
    assert factory.links == []  # never connected


def test_a_comm_hook_cannot_be_combined_with_wire_dtype() -> None:
    model = wrap(LinkFactory(), wire_dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="cannot be combined with wire_dtype"):
        model.register_comm_hook(None, hooks.GradientScaling(2.0))


def test_the_cast_hook_leaves_buckets_that_are_not_float32_or_float64_alone() -> None:
    for dtype in (torch.float16, torch.bfloat16, torch.int64):
        bucket = hooks.GradBucket(0, 0, torch.ones(3, dtype=dtype), ["p"], 2)
        assert hooks.bf16_compress_hook.before_upload(None, bucket).dtype == dtype


def _through_hook_and_coordinator(
    per_rank: list[torch.Tensor], wire_dtype: torch.dtype, order: tuple[int, ...]
) -> torch.Tensor:
    """Each rank's bucket through the hook and the coordinator's reduction, ranks in `order`."""
    hook = hooks.WIRE_DTYPE_HOOKS[wire_dtype]
    buckets = [
        hooks.GradBucket(0, 0, gradient.clone(), ["p"], len(per_rank)) for gradient in per_rank
    ]
    wires = [hook.before_upload(None, bucket) for bucket in buckets]
    payloads = [wire.view(torch.uint8).numpy().tobytes() for wire in wires]
    chunk_bytes = 1024  # several chunks, to cross chunk boundaries as the wire does
    reduction = BucketReduction(
        range(len(per_rank)), WIRE_DTYPES[wire_dtype], len(payloads[0]), chunk_bytes
    )
    averaged = bytearray(len(payloads[0]))
    for offset in range(0, len(payloads[0]), chunk_bytes):
        length = chunking.expected_chunk_length(len(payloads[0]), chunk_bytes, offset)
        for rank in order:
            done = reduction.add(rank, offset, payloads[rank][offset : offset + length])
            if done is not None:
                averaged[offset : offset + len(done)] = done
    assert reduction.complete
    average = torch.frombuffer(averaged, dtype=torch.uint8).view(wire_dtype).clone()
    for bucket in buckets:  # every rank writes the same average back
        hook.after_average(None, bucket, average)
        assert torch.equal(bucket.buffer, buckets[0].buffer)
    return buckets[0].buffer


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("wire_dtype", SIXTEEN_BIT, ids=str)
def test_hook_and_coordinator_equal_the_rounding_reference_bitwise_in_any_order(
    wire_dtype: torch.dtype, world_size: int
) -> None:
    gradients = [wire_reference.spread_gradients(rank) for rank in range(world_size)]
    for parameter in range(len(wire_reference.SCALES)):
        per_rank = [gradients[rank][parameter] for rank in range(world_size)]
        expected = wire_reference.gradsync_average(per_rank, wire_dtype)
        for order in itertools.permutations(range(world_size)):
            got = _through_hook_and_coordinator(per_rank, wire_dtype, order)
            assert torch.equal(got.view(torch.int32), expected.view(torch.int32)), (
                f"parameter {parameter} (scale {wire_reference.SCALES[parameter]}), "
                f"arrival order {order}: differs from the rounding reference"
            )
