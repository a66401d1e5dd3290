"""DiLoCo across sites, the parts that need no coordinator: the settings' checks, what a
rank of a site synchronizes (on a real one-rank gloo group, FSDP2 or plain), the job
names and layout names, and where fragments are cut."""

from __future__ import annotations

import datetime
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from gradsync import DiLoCo
from gradsync.diloco import _split
from gradsync.diloco_sites import SiteLayout
from torch import nn


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 2))


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"replica": 0, "replicas": 2}, "need replica_group"),
        ({"replica_group": object(), "replicas": 2}, "replica=None"),
        ({"replica_group": object(), "replica": 2, "replicas": 2}, "replica=2, replicas=2"),
    ],
)
def test_replica_settings_are_checked_before_joining(kwargs: dict[str, object], words: str) -> None:
    model = _model()
    with pytest.raises(ValueError, match=words):
        DiLoCo(
            model, torch.optim.SGD(model.parameters(), lr=0.1), coordinator="127.0.0.1:1", **kwargs
        )


@pytest.fixture
def site_group(tmp_path: Path) -> Iterator[object]:
    """A real one-rank gloo world (a site of one rank)."""
    dist.init_process_group(
        "gloo",
        init_method=f"file://{tmp_path / 'store'}",
        rank=0,
        world_size=1,
        timeout=datetime.timedelta(seconds=30),
    )
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def test_a_replicated_site_syncs_whole_parameters_in_the_job_itself(site_group: object) -> None:
    model = _model()
    site = SiteLayout(site_group, 1, 3, list(model.named_parameters()))
    assert not site.sharded and site.uploads
    assert site.job_id("run") == "run"
    assert site.shadow_names(site.names) is None
    assert all(a is b for a, b in zip(site.params, model.parameters(), strict=True))
    assert site.describe() == "site 1 of 3, rank 0 of 1 (replicated inside)"


def test_an_fsdp2_site_syncs_its_local_shards_in_a_job_per_shard_index(
    site_group: object,
) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = _model()
    fully_shard(model, mesh=init_device_mesh("cpu", (1,)))
    site = SiteLayout(site_group, 0, 2, list(model.named_parameters()))
    assert site.sharded
    assert site.job_id("run") == "run.site-rank-0"
    assert site.shadow_names(site.names) == [
        "0:weight[site rank 0 of 1]",
        "0:bias[site rank 0 of 1]",
        "2:weight[site rank 0 of 1]",
        "2:bias[site rank 0 of 1]",
    ]
    # The local shards are views of the model's storage: writing them writes the model.
    with torch.no_grad():
        site.params[0].fill_(3.0)
    assert float(model[0].weight.full_tensor().detach().min()) == 3.0  # type: ignore[operator]
    assert site.full_bytes == [4 * p.numel() for p in _model().parameters()]


def test_a_model_mixing_sharded_and_replicated_parameters_is_refused(site_group: object) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = _model()
    fully_shard(model[0], mesh=init_device_mesh("cpu", (1,)))
    with pytest.raises(
        ValueError, match=r"mixes sharded .*\['2.weight', '2.bias'\] are not sharded"
    ):
        SiteLayout(site_group, 0, 2, list(model.named_parameters()))


def test_fragments_are_cut_on_the_sizes_given() -> None:
    params = [torch.zeros(n) for n in (1, 1, 1, 1)]
    # By their own sizes: two and two; by the whole parameters' sizes: one and three.
    assert [len(g) for g in _split(params, 2)] == [2, 2]
    assert [len(g) for g in _split(params, 2, [90, 4, 3, 3])] == [1, 3]
