"""gradsync's SyncBatchNorm against torch's BatchNorm on the concatenated global batch.

W ranks run as threads over `tests.support.fakegroup.ThreadedGroup`, which
computes the coordinator's collectives in process; each rank normalizes its
slice of a global batch (slices of different sizes, as uneven last batches
are), and the outputs, input gradients, summed weight/bias gradients and
running statistics must match one BatchNorm over the whole batch.
"""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from gradsync.syncbn import SyncBatchNorm, attach, convert_sync_batchnorm
from support.fakegroup import ThreadedGroup
from torch import nn

pytestmark = pytest.mark.unit

RTOL = 1e-5


def close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    scale = expected.abs().max().clamp_min(1e-6)
    difference = (actual - expected).abs().max() / scale
    assert difference <= RTOL, f"relative difference {difference:.3g} > {RTOL}"


def compare(
    shape: tuple[int, ...],
    splits: list[int],
    reference: nn.modules.batchnorm._BatchNorm,
    steps: int = 2,
) -> None:
    """Train `steps` forward/backward passes on W ranks and on the reference; compare."""
    world_size = len(splits)
    group = ThreadedGroup(world_size)
    layers = [convert_sync_batchnorm(copy.deepcopy(reference)) for _ in range(world_size)]
    for rank, layer in enumerate(layers):
        assert isinstance(layer, SyncBatchNorm)
        attach(layer, group.collectives(rank))
    generator = torch.Generator().manual_seed(0)
    for _ in range(steps):
        x = torch.randn(shape, generator=generator) * 3 + 1.5
        upstream = torch.randn(shape, generator=generator)
        expected_in = x.clone().requires_grad_(True)
        expected = reference(expected_in)
        (expected * upstream).sum().backward()
        for layer in layers:
            layer.zero_grad()
        pieces = list(x.split(splits))
        grads = list(upstream.split(splits))

        def train(
            rank: int, pieces: list[torch.Tensor] = pieces, grads: list[torch.Tensor] = grads
        ) -> tuple[torch.Tensor, torch.Tensor]:
            mine = pieces[rank].clone().requires_grad_(True)
            out = layers[rank](mine)
            (out * grads[rank]).sum().backward()
            assert mine.grad is not None
            return out.detach(), mine.grad

        results = group.run(train)
        close(torch.cat([out for out, _ in results]), expected.detach())
        assert expected_in.grad is not None
        close(torch.cat([grad for _, grad in results]), expected_in.grad)
        if reference.affine:
            assert reference.weight.grad is not None and reference.bias.grad is not None
            # Local sums; the wrapper's gradient averaging adds them up across ranks.
            close(sum(layer.weight.grad for layer in layers), reference.weight.grad)  # type: ignore[misc]
            close(sum(layer.bias.grad for layer in layers), reference.bias.grad)  # type: ignore[misc]
            reference.zero_grad()
        if reference.track_running_stats:
            for layer in layers:
                assert layer.running_mean is not None and layer.running_var is not None
                close(layer.running_mean, reference.running_mean)  # type: ignore[arg-type]
                close(layer.running_var, reference.running_var)  # type: ignore[arg-type]
                assert layer.num_batches_tracked == reference.num_batches_tracked


@pytest.mark.parametrize(
    ("shape", "reference"),
    [
        ((12, 4, 5, 3), nn.BatchNorm2d(4)),
        ((12, 6), nn.BatchNorm1d(6)),
        ((12, 3, 7), nn.BatchNorm1d(3, momentum=0.3)),
        ((12, 2, 3, 2, 2), nn.BatchNorm3d(2)),
    ],
)
def test_three_ranks_match_batchnorm_on_the_global_batch(
    shape: tuple[int, ...], reference: nn.modules.batchnorm._BatchNorm
) -> None:
    with torch.no_grad():  # non-trivial affine parameters
        reference.weight.uniform_(0.5, 2.0)
        reference.bias.uniform_(-1.0, 1.0)
    compare(shape, [3, 4, 5], reference)


def test_cumulative_average_and_no_affine_match() -> None:
    compare((10, 3, 4), [6, 4], nn.BatchNorm1d(3, momentum=None, affine=False), steps=3)


def test_without_running_stats_batch_statistics_are_global() -> None:
    compare((9, 5, 2, 2), [2, 3, 4], nn.BatchNorm2d(5, track_running_stats=False))


def test_a_rank_with_an_empty_slice_still_takes_part() -> None:
    compare((8, 3, 2), [0, 8], nn.BatchNorm1d(3))


def test_one_value_per_channel_in_the_global_batch_is_refused_on_every_rank() -> None:
    group = ThreadedGroup(2)
    layers = [SyncBatchNorm(3) for _ in range(2)]
    for rank, layer in enumerate(layers):
        attach(layer, group.collectives(rank))
    pieces = [torch.randn(1, 3), torch.randn(0, 3)]
    with pytest.raises(ValueError, match="more than 1 value per channel"):
        group.run(lambda rank: layers[rank](pieces[rank]))


class NoCollectives:
    """Fails the test if a layer communicates."""

    def all_reduce(self, *args: object) -> None:
        raise AssertionError("eval mode must not communicate")


def test_eval_mode_uses_running_stats_without_communicating() -> None:
    reference = nn.BatchNorm2d(3)
    with torch.no_grad():
        reference.running_mean.uniform_(-1, 1)  # type: ignore[union-attr]
        reference.running_var.uniform_(0.5, 2)  # type: ignore[union-attr]
    layer = convert_sync_batchnorm(copy.deepcopy(reference)).eval()
    layer.collectives = NoCollectives()  # type: ignore[assignment]
    x = torch.randn(4, 3, 2, 2)
    close(layer(x), reference.eval()(x))


def test_training_without_being_attached_raises_instead_of_normalizing_locally() -> None:
    with pytest.raises(RuntimeError, match="not attached"):
        SyncBatchNorm(3)(torch.randn(4, 3))


def test_convert_replaces_nested_batch_norms_and_keeps_their_tensors() -> None:
    model = nn.Sequential(
        nn.Conv2d(1, 4, 3),
        nn.BatchNorm2d(4),
        nn.Sequential(nn.Linear(4, 4), nn.SyncBatchNorm(4, momentum=0.2)),
    ).eval()
    weight, running_mean = model[1].weight, model[1].running_mean
    converted = convert_sync_batchnorm(model)
    assert converted is model
    first, second = model[1], model[2][1]
    assert isinstance(first, SyncBatchNorm) and isinstance(second, SyncBatchNorm)
    assert first.weight is weight and first.running_mean is running_mean
    assert second.momentum == 0.2 and not first.training
    assert isinstance(model[0], nn.Conv2d)
    assert isinstance(convert_sync_batchnorm(nn.BatchNorm1d(2)), SyncBatchNorm)


def test_attach_counts_layers_warns_about_torch_syncbn_and_copies_drop_the_link(
    caplog: pytest.LogCaptureFixture,
) -> None:
    model = nn.Sequential(SyncBatchNorm(2), nn.SyncBatchNorm(2), SyncBatchNorm(2))
    collectives = ThreadedGroup(1).collectives(0)
    with caplog.at_level(logging.WARNING, logger="gradsync.client"):
        assert attach(model, collectives) == 2
    assert "torch.nn.SyncBatchNorm" in caplog.text and "'1'" in caplog.text
    assert model[0].collectives is collectives
    clone = copy.deepcopy(model)
    assert clone[0].collectives is None and model[0].collectives is collectives
