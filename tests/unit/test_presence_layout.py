"""Where the presence vector travels (issue 27): at the end of the last bucket, or alone.

A step of a model whose last bucket is float32 costs no message for the presence
vector: it rides at the end of that bucket, so a one-bucket model uploads once per
step. A float64 last bucket (one bucket, one dtype) and DiLoCo's outer optimizer keep
it a bucket of its own. DDP's rules for unused parameters hold either way.
"""

from __future__ import annotations

import gradsync
import pytest
import torch
from gradsync.path.bucketing import BucketPlan
from gradsync.path.reducer import presence_can_ride, wire_plans
from gradsync.path.signature import PRESENCE_NAME
from support.fakelink import LinkFactory
from torch import nn

pytestmark = pytest.mark.unit


class TwoHeads(nn.Module):
    """A trunk and two heads; `forward(x, head)` uses one head only."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.trunk = nn.Linear(4, 4, dtype=dtype)
        self.heads = nn.ModuleList(nn.Linear(4, 2, dtype=dtype) for _ in range(2))

    def forward(self, x: torch.Tensor, head: int) -> torch.Tensor:
        out: torch.Tensor = self.heads[head](self.trunk(x))
        return out


def wrap(module: nn.Module, factory: LinkFactory) -> gradsync.DistributedDataParallel:
    return gradsync.DistributedDataParallel(
        module, coordinator="fake:1", rank=0, world_size=2, link_factory=factory
    )


def test_the_layout_lets_the_presence_ride_only_on_a_float32_last_bucket() -> None:
    float32 = [BucketPlan((1, 0), torch.float32, 8)]
    float64 = [BucketPlan((1,), torch.float32, 4), BucketPlan((0,), torch.float64, 8)]
    presence = BucketPlan((2,), torch.float32, 8)
    assert presence_can_ride(float32, separate=False)
    assert not presence_can_ride(float32, separate=True)  # DiLoCo, wire_dtype
    assert not presence_can_ride(float64, separate=False)
    (merged,) = wire_plans(float32, presence, ride=True)
    assert merged == BucketPlan((1, 0, 2), torch.float32, 16)
    assert wire_plans(float64, presence, ride=False) == [*float64, presence]


def test_a_one_bucket_model_uploads_once_per_step_with_the_presence_at_its_end() -> None:
    factory = LinkFactory()
    torch.manual_seed(0)
    module = nn.Linear(8, 8)
    model = wrap(module, factory)
    (join,) = factory.links[0].joins
    (bucket,) = join.signature.buckets
    assert join.signature.parameters[bucket.parameter_indices[-1]].name == PRESENCE_NAME
    for step in range(2):
        model(torch.randn(3, 8)).sum().backward()
        link = factory.links[0]
        assert [(s, b) for s, b, _, _ in link.uploads] == [(s, 0) for s in range(step + 1)]
    assert factory.links[0].presence == [[1.0, 1.0]] * 2
    reference = nn.Linear(8, 8)
    reference.load_state_dict(module.state_dict())
    reference(torch.randn(3, 8)).sum().backward()
    for param in module.parameters():
        assert param.grad is not None  # averaged (0.5 x this rank's, by the fake)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_a_head_no_rank_used_keeps_grad_none_whichever_way_the_presence_travels(
    dtype: torch.dtype,
) -> None:
    factory = LinkFactory()
    torch.manual_seed(0)
    module = TwoHeads(dtype)
    model = wrap(module, factory)
    link = factory.links[0]
    x = torch.randn(3, 4, dtype=dtype)
    model(x, head=0).sum().backward()
    local = TwoHeads(dtype)
    local.load_state_dict(module.state_dict())
    local(x, head=0).sum().backward()
    # float32: one bucket and the presence in it; float64: a presence bucket of its own.
    assert len(link.uploads) == (1 if dtype == torch.float32 else 2)
    (presence,) = link.presence
    names = [name for name, _ in module.named_parameters()]
    assert presence == [0.0 if name.startswith("heads.1") else 1.0 for name in names]
    for (name, param), (_, expected) in zip(
        module.named_parameters(), local.named_parameters(), strict=True
    ):
        if name.startswith("heads.1"):
            assert param.grad is None, name  # no rank used it: untouched, as DDP
        else:
            assert expected.grad is not None
            torch.testing.assert_close(param.grad, expected.grad * 0.5)


def test_a_head_only_a_peer_used_gets_the_average_when_the_presence_rides() -> None:
    factory = LinkFactory()
    factory.prepare = lambda link: setattr(link, "peer_presence", [1.0] * 6)
    torch.manual_seed(0)
    module = TwoHeads(torch.float32)
    model = wrap(module, factory)
    model(torch.randn(3, 4), head=0).sum().backward()
    for name, param in module.named_parameters():
        assert param.grad is not None, name  # the peer used it: it gets the average
        if name.startswith("heads.1"):
            assert torch.count_nonzero(param.grad) == 0  # of zeros, from the fake's peer
