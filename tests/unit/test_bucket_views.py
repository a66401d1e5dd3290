"""`gradient_as_bucket_view=True` over a fake link: `.grad` are views into a flat bucket.

The fake link averages with a silent peer (averages = half this rank's
upload, plus what a test says the peer added), so each test can tell where
the averages landed. The promises pinned down: views laid out in bucket
order, each bucket uploaded from its flat tensor as one segment and averaged
into it, DDP's rules for `.grad` (fresh gradients re-pointed at the view,
None kept for a parameter no rank used, the average for one another rank
used, a `.grad` no rank used averaged as DDP does), `zero_grad` both ways,
`no_sync` accumulation, and comm hooks seeing the flat tensor.
"""

from __future__ import annotations

import copy
from typing import Any

import gradsync
import numpy as np
import pytest
import torch
from gradsync import compat, hooks
from gradsync.path import bucket_views
from gradsync.path.reducer import plan_buckets
from support.fakelink import LinkFactory
from torch import nn

pytestmark = pytest.mark.unit

#: Two buckets for `mlp()`: [last layer] then [first layer] (reverse order, 40 bytes cap).
SMALL_BUCKETS: dict[str, Any] = {"bucket_cap_mb": 40 / 2**20, "first_bucket_mb": 40 / 2**20}


class TwoHeads(nn.Module):
    """A trunk and two heads; `forward(x, use_other)` runs the second head or not."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.trunk = nn.Linear(4, 3)
        self.head = nn.Linear(3, 2)
        self.other = nn.Linear(3, 2)

    def forward(self, x: torch.Tensor, use_other: bool = False) -> torch.Tensor:
        h = torch.tanh(self.trunk(x))
        y: torch.Tensor = self.head(h)
        return y + self.other(h) if use_other else y


def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2))


def wrap(module: nn.Module, factory: LinkFactory, **kwargs: Any) -> Any:
    return gradsync.DistributedDataParallel(
        module,
        coordinator="fake:1",
        rank=0,
        world_size=2,
        link_factory=factory,
        gradient_as_bucket_view=kwargs.pop("gradient_as_bucket_view", True),
        **kwargs,
    )


def backward(model: nn.Module, seed: int = 1, *extra: Any) -> None:
    generator = torch.Generator().manual_seed(seed)
    x, y = torch.randn(5, 4, generator=generator), torch.randn(5, 2, generator=generator)
    nn.functional.mse_loss(model(x, *extra), y).backward()  # type: ignore[no-untyped-call]


def local_grads(module: nn.Module, *passes: int) -> list[torch.Tensor]:
    """The gradients one process computes for `passes` (seeds), accumulated, per parameter."""
    reference = copy.deepcopy(module)
    for seed in passes:
        backward(reference, seed)
    return [p.grad.clone() for p in reference.parameters()]  # type: ignore[union-attr]


def assert_views_in_bucket_order(model: Any, module: nn.Module) -> None:
    params = list(module.parameters())
    flats = model._reducer.views.flats
    for plan, flat in zip(model.bucket_plans, flats, strict=True):
        offset = 0
        for index in plan.parameter_indices:
            grad = params[index].grad
            assert grad is not None
            assert grad.data_ptr() == flat.data_ptr() + offset * flat.element_size()
            assert grad.shape == params[index].shape and grad.is_contiguous()
            offset += params[index].numel()
        assert offset == flat.numel()


def assert_views_in_bucket_order_of(model: Any, layers: list[nn.Linear]) -> None:
    flat = model._reducer.views.flats[0]
    for layer in layers:
        for param in (layer.weight, layer.bias):
            assert param.grad is not None
            assert param.grad.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()


# ------------------------------------------------------------------ allocation
def test_allocate_gives_a_zeroed_flat_tensor_and_refuses_a_partial_element() -> None:
    flat = bucket_views.allocate(24, torch.float64)
    assert flat.dtype == torch.float64 and flat.shape == (3,) and not flat.any()
    with pytest.raises(ValueError, match=r"6 bytes is not a whole number of torch\.float32"):
        bucket_views.allocate(6, torch.float32)


def test_every_bucket_is_allocated_through_the_allocator() -> None:
    module = mlp()
    calls: list[tuple[int, torch.dtype]] = []

    def recording(num_bytes: int, dtype: torch.dtype) -> torch.Tensor:
        calls.append((num_bytes, dtype))
        return bucket_views.allocate(num_bytes, dtype)

    named = list(module.named_parameters())
    plans, _ = plan_buckets(named, 40, 40)
    views = bucket_views.BucketViews(named, plans, recording)
    assert len(plans) == 2
    assert calls == [(plan.num_bytes, torch.float32) for plan in plans]
    assert sorted(views.views) == [0, 1, 2, 3]


def test_the_option_is_honoured_and_no_longer_warned_about() -> None:
    assert compat.ignored_arguments({"gradient_as_bucket_view": True}) == []


# ------------------------------------------------------------------ layout and upload
def test_grads_are_views_in_bucket_order_uploaded_and_averaged_in_place() -> None:
    factory = LinkFactory()
    module = mlp()
    expected = local_grads(module, 1)
    model = wrap(module, factory, **SMALL_BUCKETS)
    assert len(model.bucket_plans) == 2

    backward(model)

    assert_views_in_bucket_order(model, module)
    for (_, bucket_index, buffer), flat in zip(
        factory.link.submitted, model._reducer.views.flats, strict=True
    ):
        # The flat tensor's own memory: no gather before, no scatter after (the last
        # bucket carries the presence vector after it, a segment of its own).
        segment, *presence = buffer.segments
        assert len(presence) == (1 if bucket_index == 1 else 0)
        assert np.shares_memory(segment, flat.view(torch.uint8).numpy())
        assert bucket_index in (0, 1)
    for param, local in zip(module.parameters(), expected, strict=True):
        assert torch.equal(param.grad, local * 0.5)  # type: ignore[arg-type]


def test_bucket_views_train_exactly_as_the_default_mode() -> None:
    averaged = []
    for as_view in (False, True):
        factory = LinkFactory()
        module = mlp()
        model = wrap(module, factory, gradient_as_bucket_view=as_view, **SMALL_BUCKETS)
        optimizer = torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9)
        for step in range(3):
            optimizer.zero_grad(set_to_none=step % 2 == 0)
            backward(model, step)
            optimizer.step()
        averaged.append([p.detach().clone() for p in module.parameters()])
    for plain, view in zip(*averaged, strict=True):
        assert torch.equal(plain, view)


def test_existing_grads_are_moved_into_the_views_when_wrapping() -> None:
    module = mlp()
    first = module[0].weight
    assert isinstance(first, torch.Tensor)
    first.grad = torch.full_like(first, 2.0)
    model = wrap(module, LinkFactory(), **SMALL_BUCKETS)
    view = model._reducer.views.views[0]
    assert first.grad is not None and bucket_views.is_view_of(first.grad, view)
    assert torch.equal(first.grad, torch.full_like(first, 2.0))
    assert module[0].bias.grad is None


# ------------------------------------------------------------------ zero_grad and no_sync
def test_a_fresh_grad_after_set_to_none_is_copied_into_the_view_and_re_pointed() -> None:
    module = mlp()
    model = wrap(module, LinkFactory(), **SMALL_BUCKETS)
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    backward(model)
    pointers = [p.grad.data_ptr() for p in module.parameters()]  # type: ignore[union-attr]

    optimizer.zero_grad(set_to_none=True)
    assert all(p.grad is None for p in module.parameters())
    backward(model, 2)

    assert [p.grad.data_ptr() for p in module.parameters()] == pointers  # type: ignore[union-attr]
    assert_views_in_bucket_order(model, module)
    for param, local in zip(module.parameters(), local_grads(mlp(), 2), strict=True):
        assert torch.equal(param.grad, local * 0.5)  # type: ignore[arg-type]


def test_zero_grad_without_set_to_none_zeroes_the_views_and_backward_accumulates_in_them() -> None:
    module = mlp()
    model = wrap(module, LinkFactory(), **SMALL_BUCKETS)
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    backward(model)
    grads = [p.grad for p in module.parameters()]

    optimizer.zero_grad(set_to_none=False)
    assert not any(flat.any() for flat in model._reducer.views.flats)
    backward(model, 2)

    for param, grad, local in zip(module.parameters(), grads, local_grads(mlp(), 2), strict=True):
        assert param.grad is grad  # the very same view object, accumulated in place
        assert torch.equal(param.grad, local * 0.5)  # type: ignore[arg-type]


def test_no_sync_accumulates_outside_the_views_and_the_synchronized_pass_moves_it_in() -> None:
    module = mlp()
    expected = local_grads(module, 1, 2, 3)
    model = wrap(module, LinkFactory(), **SMALL_BUCKETS)
    with model.no_sync():
        backward(model, 1)
        backward(model, 2)
        # As DDP: nothing is copied or re-pointed while synchronization is off.
        assert model._reducer.views.flats[0].any().item() is False
    backward(model, 3)

    assert_views_in_bucket_order(model, module)
    for param, local in zip(module.parameters(), expected, strict=True):
        torch.testing.assert_close(param.grad, local * 0.5, rtol=0, atol=1e-7)


# ------------------------------------------------------------------ unused parameters
def test_a_parameter_no_rank_used_keeps_grad_none() -> None:
    factory = LinkFactory()
    module = TwoHeads()
    model = wrap(module, factory)

    backward(model)

    assert module.other.weight.grad is None and module.other.bias.grad is None
    assert factory.link.presence == [[1.0, 1.0, 1.0, 1.0, 0.0, 0.0]]
    assert_views_in_bucket_order_of(model, [module.trunk, module.head])


def test_a_parameter_only_a_peer_used_gets_its_view_holding_the_average() -> None:
    factory = LinkFactory()
    module = TwoHeads()
    model = wrap(module, factory)
    factory.link.peer_presence = [1.0] * 6
    factory.link.peer_value = 0.25

    backward(model)

    grad = module.other.weight.grad
    assert grad is not None
    assert bucket_views.is_view_of(grad, model._reducer.views.views[4])
    assert torch.equal(grad, torch.full_like(grad, 0.25))  # our zeros + the peer's share


def test_a_grad_no_rank_used_is_averaged_in_its_view_as_torch_ddp_does() -> None:
    # Measured on torch DDP (gloo, find_unused_parameters=True): with bucket views a
    # parameter no rank used but that has a .grad gets the ranks' average of it.
    factory = LinkFactory()
    module = TwoHeads()
    model = wrap(module, factory)
    module.other.weight.grad = torch.full_like(module.other.weight, 3.0)

    backward(model)

    grad = module.other.weight.grad
    assert grad is not None and bucket_views.is_view_of(grad, model._reducer.views.views[4])
    assert torch.equal(grad, torch.full_like(grad, 1.5))  # 3 and the silent peer's 0
    assert module.other.bias.grad is None


# ------------------------------------------------------------------ comm hooks
def test_a_comm_hook_sees_the_flat_tensor_and_its_result_lands_in_the_views() -> None:
    module = mlp()
    expected = local_grads(module, 1)
    model = wrap(module, LinkFactory(), **SMALL_BUCKETS)
    seen: list[int] = []

    class Recording(hooks.GradientScaling):
        def before_upload(self, state: Any, bucket: hooks.GradBucket) -> torch.Tensor:
            seen.append(bucket.buffer.data_ptr())
            return super().before_upload(state, bucket)

    model.register_comm_hook(None, Recording(factor=4.0))
    backward(model)

    assert seen == [flat.data_ptr() for flat in model._reducer.views.flats]
    assert_views_in_bucket_order(model, module)
    for param, local in zip(module.parameters(), expected, strict=True):
        assert torch.equal(param.grad, local * 0.5)  # type: ignore[arg-type]


@pytest.mark.parametrize("answer", [None, torch.float32])
def test_a_16_bit_wire_with_bucket_views_leaves_its_averages_in_the_views(
    answer: torch.dtype | None,
) -> None:
    factory = LinkFactory()
    module = mlp()
    expected = local_grads(module, 1)
    model = wrap(
        module, factory, wire_dtype=torch.bfloat16, wire_answer_dtype=answer, **SMALL_BUCKETS
    )

    backward(model)

    assert_views_in_bucket_order(model, module)
    for param, local in zip(module.parameters(), expected, strict=True):
        averaged = local.to(torch.bfloat16).float() * 0.5
        if answer is None:
            averaged = averaged.to(torch.bfloat16).float()
        assert torch.equal(param.grad, averaged)  # type: ignore[arg-type]
    assert all(dtype != 0 for *_, dtype in factory.link.uploads)


def test_buckets_of_two_dtypes_get_a_flat_tensor_each() -> None:
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2).to(torch.bfloat16))

    class Cast(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = module

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            result: torch.Tensor = self.inner[1](self.inner[0](x).bfloat16())
            return result.float()

    model = wrap(Cast(), LinkFactory())
    backward(model)
    flats = model._reducer.views.flats
    assert sorted(str(flat.dtype) for flat in flats) == ["torch.bfloat16", "torch.float32"]
    for param in module.parameters():
        assert param.grad is not None
        assert any(
            param.grad.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()
            for flat in flats
        )


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_cuda_module_keeps_staging_through_host_memory() -> None:
    module = mlp().cuda()
    expected = local_grads(module, 1)
    model = wrap(module, LinkFactory(), **SMALL_BUCKETS)
    backward(model)
    assert model._reducer.views is None  # views would be host memory
    for param, local in zip(module.parameters(), expected, strict=True):
        assert param.grad is not None and param.grad.is_cuda
        torch.testing.assert_close(param.grad, local * 0.5)
