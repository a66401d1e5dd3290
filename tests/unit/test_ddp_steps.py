"""The model wrapper's step logic over a fake link: no sockets, no threads, no coordinator.

`DistributedDataParallel` reaches the network only through the
`gradsync.control.link.CoordinatorLink` protocol, so these tests hand it `FakeLink`,
which records what the wrapper submits and answers the way a coordinator
would (averages, aborts, a lost stream). They pin down what the wrapper
itself decides: when each bucket is handed off, where averages land, which
error surfaces from backward(), and which errors start a reconnect.
"""

from __future__ import annotations

import copy
import io
from collections.abc import Iterator
from typing import Any

import gradsync
import pytest
import torch
from gradsync.control.link import CoordinatorLink
from gradsync_proto.v1 import gradsync_pb2 as pb
from support.fakelink import FakeLink, LinkFactory
from torch import nn

pytestmark = pytest.mark.unit

#: Caps so small that every parameter gets a bucket of its own.
ONE_PARAMETER_PER_BUCKET: dict[str, Any] = {"bucket_cap_mb": 1e-6, "first_bucket_mb": 1e-6}


def chain() -> nn.Sequential:
    """Three layers without biases: autograd reaches them strictly last to first."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(4, 8, bias=False), nn.Tanh(), nn.Linear(8, 8, bias=False), nn.Tanh(),
        nn.Linear(8, 2, bias=False),
    )  # fmt: skip


def wrap(
    module: nn.Module, factory: LinkFactory, rank: int = 0, world_size: int = 2, **kwargs: Any
) -> gradsync.DistributedDataParallel:
    return gradsync.DistributedDataParallel(
        module,
        coordinator="fake:1",
        rank=rank,
        world_size=world_size,
        link_factory=factory,
        **kwargs,
    )


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return torch.randn(5, 4, generator=generator), torch.randn(5, 2, generator=generator)


def backward(model: nn.Module) -> None:
    x, y = batch()
    nn.functional.mse_loss(model(x), y).backward()  # type: ignore[no-untyped-call]


@pytest.fixture
def factory() -> Iterator[LinkFactory]:
    yield LinkFactory()


def test_buckets_are_handed_off_in_reverse_order_while_backward_still_runs(
    factory: LinkFactory,
) -> None:
    module = chain()
    model = wrap(module, factory, **ONE_PARAMETER_PER_BUCKET)
    first_layer = module[0].weight
    assert [plan.parameter_indices for plan in model.bucket_plans] == [(2,), (1,), (0,)]
    first_layer_had_grad: list[bool] = []
    factory.link.on_submit = lambda _: first_layer_had_grad.append(first_layer.grad is not None)

    backward(model)

    assert [(step, bucket) for step, bucket, _ in factory.link.submitted] == [
        (0, 0),
        (0, 1),
        (0, 2),
    ]
    # Bucket 0 left before autograd reached the first layer: upload overlaps backward.
    assert first_layer_had_grad == [False, False, True]
    assert factory.link.waited_steps == [0]


def test_without_overlap_every_bucket_waits_for_the_end_of_backward(
    factory: LinkFactory,
) -> None:
    module = chain()
    model = wrap(module, factory, overlap=False, **ONE_PARAMETER_PER_BUCKET)
    first_layer = module[0].weight
    first_layer_had_grad: list[bool] = []
    factory.link.on_submit = lambda _: first_layer_had_grad.append(first_layer.grad is not None)

    backward(model)

    assert first_layer_had_grad == [True, True, True]


def test_a_bucket_leaves_only_once_its_last_gradient_landed(factory: LinkFactory) -> None:
    # One bucket for the two last layers, one for the first layer.
    module = chain()
    last_two_bytes = (8 * 2 + 8 * 8) * 4
    model = wrap(module, factory, first_bucket_mb=last_two_bytes / (1 << 20), bucket_cap_mb=1e-6)
    assert [plan.parameter_indices for plan in model.bucket_plans] == [(2, 1), (0,)]
    middle_had_grad: list[bool] = []
    factory.link.on_submit = lambda _: middle_had_grad.append(module[2].weight.grad is not None)

    backward(model)

    assert [bucket for _, bucket, _ in factory.link.submitted] == [0, 1]
    assert middle_had_grad == [True, True]


def test_averages_are_in_param_grad_when_backward_returns(factory: LinkFactory) -> None:
    module = chain()
    reference = copy.deepcopy(module)
    model = wrap(module, factory, **ONE_PARAMETER_PER_BUCKET)

    backward(model)
    backward(reference)

    for (name, param), expected in zip(
        module.named_parameters(), reference.parameters(), strict=True
    ):
        assert param.grad is not None and expected.grad is not None
        torch.testing.assert_close(param.grad, expected.grad * 0.5, msg=name)
    assert model.last_contributors == 2
    assert model.step == 1
    assert factory.link.current_step == 1


class TwoHeads(nn.Module):
    """A used head and a head that this rank never runs."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.used = nn.Linear(4, 2)
        self.unused = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        output: torch.Tensor = self.used(x)
        return output


def test_a_parameter_no_rank_used_keeps_grad_none_and_the_presence_says_so(
    factory: LinkFactory,
) -> None:
    module = TwoHeads()
    model = wrap(module, factory, **ONE_PARAMETER_PER_BUCKET)

    backward(model)

    # Every bucket still travels (the coordinator expects each one), zeros for the unused.
    assert len(factory.link.submitted) == len(model.bucket_plans) == 4
    assert factory.link.presence == [[1.0, 1.0, 0.0, 0.0]]
    assert module.unused.weight.grad is None and module.unused.bias.grad is None
    assert module.used.weight.grad is not None


def test_a_grad_accumulated_under_no_sync_is_left_untouched_when_no_rank_used_it(
    factory: LinkFactory,
) -> None:
    module = TwoHeads()
    model = wrap(module, factory, **ONE_PARAMETER_PER_BUCKET)
    module.unused.weight.grad = torch.full_like(module.unused.weight, 3.0)
    before = module.unused.weight.grad.clone()
    stored = module.unused.weight.grad

    backward(model)

    # Uploaded (the peer might have used it) from a copy, then not written back.
    assert module.unused.weight.grad is stored
    assert torch.equal(module.unused.weight.grad, before)
    assert factory.link.presence == [[1.0, 1.0, 0.0, 0.0]]


def test_a_parameter_only_a_peer_used_gets_the_average_of_zeros_and_its_gradient(
    factory: LinkFactory,
) -> None:
    module = TwoHeads()
    model = wrap(module, factory, **ONE_PARAMETER_PER_BUCKET)
    factory.link.peer_presence = [1.0, 1.0, 1.0, 1.0]
    factory.link.peer_value = 0.25  # the peer's gradient, halved

    backward(model)

    grad = module.unused.weight.grad
    assert grad is not None and grad.shape == module.unused.weight.shape
    assert torch.equal(grad, torch.full_like(grad, 0.25))  # our zeros + the peer's share
    assert module.unused.bias.grad is not None


def test_a_parameter_used_only_under_no_sync_counts_as_used(factory: LinkFactory) -> None:
    module = TwoHeads()
    model = wrap(module, factory, **ONE_PARAMETER_PER_BUCKET)
    x, y = batch()
    with model.no_sync():
        nn.functional.mse_loss(module.unused(x), y).backward()  # type: ignore[no-untyped-call]
    accumulated = module.unused.weight.grad
    assert accumulated is not None
    expected = accumulated.clone()

    backward(model)

    assert factory.link.presence == [[1.0, 1.0, 1.0, 1.0]]
    assert module.unused.weight.grad is not None
    torch.testing.assert_close(module.unused.weight.grad, expected * 0.5)
    # The marks are per synchronized step: the next step starts from nothing used.
    backward(model)
    assert factory.link.presence[1] == [1.0, 1.0, 0.0, 0.0]


def test_no_sync_uploads_nothing_and_the_next_step_averages_the_accumulated_gradients(
    factory: LinkFactory,
) -> None:
    module = chain()
    reference = copy.deepcopy(module)
    model = wrap(module, factory, **ONE_PARAMETER_PER_BUCKET)

    with model.no_sync():
        backward(model)
    assert factory.link.submitted == []
    assert model.step == 0
    backward(model)
    backward(reference)
    backward(reference)

    assert len(factory.link.submitted) == 3
    for param, expected in zip(module.parameters(), reference.parameters(), strict=True):
        assert param.grad is not None and expected.grad is not None
        torch.testing.assert_close(param.grad, expected.grad * 0.5)


def test_an_error_recorded_by_the_link_surfaces_from_backward_with_its_context(
    factory: LinkFactory,
) -> None:
    model = wrap(chain(), factory, **ONE_PARAMETER_PER_BUCKET)
    factory.link.fail_with = gradsync.PeerLostError(
        "rank 1 disconnected", rank=0, step=0, bucket_index=1
    )

    with pytest.raises(gradsync.PeerLostError, match=r"\[rank 0, step 0, bucket 1\]"):
        backward(model)

    # The step is over for this rank (the coordinator abandoned it everywhere).
    assert model.step == 1
    backward(model)
    assert factory.link.waited_steps == [0, 1]


def test_a_gradient_the_hook_cannot_upload_fails_backward_naming_rank_and_step(
    factory: LinkFactory,
) -> None:
    module = nn.Embedding(10, 3, sparse=True)
    model = wrap(module, factory, rank=1)

    with pytest.raises(gradsync.GradSyncError, match=r"\[rank 1, step 0\].*sparse gradient"):
        model(torch.tensor([1, 2])).sum().backward()
    assert factory.link.submitted == []


@pytest.mark.parametrize(
    "error",
    [
        gradsync.DeclaredDeadError("declared dead after 5s without a heartbeat", rank=0),
        gradsync.CheckpointFailedError("checkpoint of step 3 failed", rank=0),
        gradsync.JoinRefusedError("refused", rank=0),
        gradsync.ResourceExhaustedError("outbox full", rank=0),
    ],
    ids=lambda error: type(error).__name__,
)
def test_only_a_lost_coordinator_starts_a_reconnect(
    factory: LinkFactory, error: gradsync.GradSyncError
) -> None:
    model = wrap(chain(), factory, reconnect_timeout_s=30)
    factory.link.fail_with = error

    with pytest.raises(type(error)) as raised:
        backward(model)

    assert raised.value is error
    assert len(factory.links) == 1 and not factory.link.closed


def resume_blob(module: nn.Module, step: int) -> bytes:
    buffer = io.BytesIO()
    state = {"module": module.state_dict(), "optimizer": None, "step": step, "world_size": 2}
    torch.save(state, buffer)
    return buffer.getvalue()


def test_a_lost_coordinator_is_reconnected_and_the_job_resumes_from_its_checkpoint() -> None:
    saved = chain()
    with torch.no_grad():
        for param in saved.parameters():
            param.fill_(0.25)
    blob = resume_blob(saved, step=7)
    factory = LinkFactory(
        pb.Welcome(start_step=0), pb.Welcome(start_step=7, resume_bytes=len(blob))
    )
    factory.prepare = lambda link: setattr(link, "resume_blob", blob)
    module = chain()
    model = wrap(module, factory, reconnect_timeout_s=30)
    factory.link.fail_with = gradsync.CoordinatorUnavailableError("stream broke", rank=0)

    with pytest.raises(gradsync.CoordinatorRestartedError, match="step 7") as raised:
        backward(model)

    assert isinstance(raised.value.__cause__, gradsync.CoordinatorUnavailableError)
    assert len(factory.links) == 2 and factory.links[0].closed
    assert model.step == 7 and factory.link.current_step == 7
    assert all(torch.all(p == 0.25) for p in module.parameters())
    backward(model)
    assert factory.link.waited_steps == [7]


def test_a_lost_shard_reconnects_to_the_leader_and_names_the_shard() -> None:
    # A shard's loss is a lost coordinator: the same reconnect path, which closes
    # the old link (and with it every shard stream) and opens a new one.
    blob = resume_blob(chain(), step=4)
    factory = LinkFactory(
        pb.Welcome(start_step=0), pb.Welcome(start_step=4, resume_bytes=len(blob))
    )
    factory.prepare = lambda link: setattr(link, "resume_blob", blob)
    model = wrap(chain(), factory, reconnect_timeout_s=30)
    factory.link.fail_with = gradsync.ShardUnavailableError(
        "shard 2 at 10.9.0.5:50051 was lost", rank=0, shard_index=2, shard_address="10.9.0.5:50051"
    )

    with pytest.raises(gradsync.CoordinatorRestartedError, match=r"shard 2 at 10\.9\.0\.5:50051"):
        backward(model)

    assert len(factory.links) == 2 and factory.links[0].closed
    assert model.step == 4


def test_a_lost_coordinator_is_not_reconnected_when_reconnecting_is_off(
    factory: LinkFactory,
) -> None:
    model = wrap(chain(), factory, reconnect_timeout_s=0)
    factory.link.fail_with = gradsync.CoordinatorUnavailableError("stream broke", rank=0)

    with pytest.raises(gradsync.CoordinatorUnavailableError):
        backward(model)
    assert len(factory.links) == 1


def test_rank_0_broadcasts_its_state_and_other_ranks_start_from_it() -> None:
    sender_factory = LinkFactory()
    sender = chain()
    wrap(sender, sender_factory)
    (state,) = sender_factory.link.sent_state

    receiver_factory = LinkFactory(pb.Welcome(start_step=0, state_bytes=len(state)))
    receiver_factory.prepare = lambda link: setattr(link, "state_for_us", state)
    receiver = nn.Sequential(*[copy.deepcopy(layer) for layer in chain()])
    with torch.no_grad():
        for param in receiver.parameters():
            param.zero_()
    wrap(receiver, receiver_factory, rank=1)

    for mine, theirs in zip(receiver.parameters(), sender.parameters(), strict=True):
        torch.testing.assert_close(mine, theirs)
    (join,) = receiver_factory.link.joins
    assert (join.rank, join.world_size, join.job_id) == (1, 2, "default")
    # The presence vector travels as the last "parameter" of the signature, at the end
    # of the last (float32) bucket: no bucket of its own.
    assert [spec.name for spec in join.signature.parameters] == [
        "0.weight",
        "2.weight",
        "4.weight",
        "gradsync.presence",
    ]
    assert list(join.signature.buckets[-1].parameter_indices)[-1] == 3
    parameters = sum(p.numel() for p in sender.parameters())
    assert sum(bucket.num_elements for bucket in join.signature.buckets) == parameters + 3


def test_rank_0_checkpoints_at_step_boundaries_and_reports_a_failed_one() -> None:
    factory = LinkFactory(pb.Welcome(start_step=0, checkpoint_every_steps=2))
    model = wrap(chain(), factory)
    for _ in range(3):
        backward(model)
    assert factory.link.checkpoints == [0, 2]

    factory.link.checkpoint_durable = False
    with pytest.raises(gradsync.CheckpointFailedError, match=r"step 3.*read-only"):
        model.save_checkpoint()


def test_a_heal_request_is_answered_at_the_next_step_boundary(
    factory: LinkFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The state itself through the link: no joiner would come for a direct offer here.
    monkeypatch.setenv("GRADSYNC_HEAL_CHANNEL", "0")
    model = wrap(chain(), factory, rank=1)
    backward(model)
    factory.link.heal_requested = True
    backward(model)
    assert factory.link.heals == [1]


def test_an_interrupted_backward_is_abandoned_by_the_next_forward(factory: LinkFactory) -> None:
    module = chain()
    model = wrap(module, factory, **ONE_PARAMETER_PER_BUCKET)

    def fail(grad: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("simulated out of memory")

    first_layer = module[0]
    assert isinstance(first_layer, nn.Linear)
    handle = first_layer.weight.register_hook(fail)  # type: ignore[no-untyped-call]
    with pytest.raises(RuntimeError, match="simulated out of memory"):
        backward(model)
    handle.remove()
    backward(model)

    assert [step for step, _ in factory.link.abandoned] == [0]
    assert factory.link.waited_steps == [1]
    assert model.step == 2


def test_use_after_close_raises_closed_error(factory: LinkFactory) -> None:
    model = wrap(chain(), factory)
    model.close()
    model.close()  # idempotent

    assert factory.link.closed
    with pytest.raises(gradsync.ClosedError, match="after close"):
        backward(model)


def test_the_fake_link_satisfies_the_protocol() -> None:
    # Keeps this fake honest when the protocol grows (mypy checks the annotation).
    link: CoordinatorLink = FakeLink("fake:1", 0)
    assert isinstance(link.current_step, int)
