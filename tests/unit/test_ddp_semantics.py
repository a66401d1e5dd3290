"""torch DDP's semantics in the wrapper, over a fake link: buffers, arguments, devices, hooks.

Each test pins down one promise of the drop-in: rank 0's buffers before every
forward (not after a no_sync pass), DDP's keyword arguments accepted with one
warning for those without effect, modules on devices gradsync cannot serve
refused before joining, comm hooks that change what goes on the wire, the
periodic step log, and join() telling the coordinator when inputs run out.
"""

from __future__ import annotations

import logging
import warnings
from typing import Any, cast

import gradsync
import pytest
import torch
from gradsync import compat, hooks
from gradsync_proto.v1 import gradsync_pb2 as pb
from support.fakelink import LinkFactory
from torch import nn

pytestmark = pytest.mark.unit

ONE_PARAMETER_PER_BUCKET: dict[str, Any] = {"bucket_cap_mb": 1e-6, "first_bucket_mb": 1e-6}


def wrap(module: nn.Module, factory: LinkFactory, rank: int = 0, **kwargs: Any) -> Any:
    return gradsync.DistributedDataParallel(
        module, coordinator="fake:1", rank=rank, world_size=2, link_factory=factory, **kwargs
    )


def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))


def with_norm() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3))


def step(model: nn.Module) -> None:
    generator = torch.Generator().manual_seed(1)
    x, y = torch.randn(5, 4, generator=generator), torch.randn(5, 2, generator=generator)
    nn.functional.mse_loss(model(x)[:, :2], y).backward()  # type: ignore[no-untyped-call]


def rank0_buffers(module: nn.Module) -> bytes:
    """What rank 0's buffers look like packed (running mean 1, var 2, 7 batches)."""
    blob = [
        torch.full((3,), 1.0).view(torch.uint8),
        torch.full((3,), 2.0).view(torch.uint8),
        torch.tensor([7]).view(torch.uint8),
    ]
    return torch.cat(blob).numpy().tobytes()


# ------------------------------------------------------------------ buffers
def test_rank_0s_buffers_are_broadcast_before_every_synchronized_forward() -> None:
    factory = LinkFactory()
    module = with_norm()
    model = wrap(module, factory, rank=1)
    factory.link.broadcast_result = rank0_buffers(module)

    step(model)

    ((op, _, payload, root),) = factory.link.collectives
    assert (op, root) == (pb.COLLECTIVE_OP_BROADCAST, 0)
    # Rank 1 uploads its own buffers too (fresh: mean 0, var 1, 0 batches), so that the
    # coordinator can hand out a stand-in's if rank 0 is lost (elastic policy).
    fresh = [torch.zeros(3).view(torch.uint8), torch.ones(3).view(torch.uint8)]
    assert payload == torch.cat([*fresh, torch.tensor([0]).view(torch.uint8)]).numpy().tobytes()
    # The forward ran on rank 0's statistics, then updated them with this batch.
    assert int(module[1].num_batches_tracked) == 8
    step(model)
    assert len(factory.link.collectives) == 2


def test_a_forward_after_a_no_sync_pass_does_not_broadcast_buffers_as_ddp() -> None:
    factory = LinkFactory()
    model = wrap(with_norm(), factory)
    with model.no_sync():
        step(model)  # broadcasts (the first forward)
        step(model)  # follows a no_sync forward: no broadcast
    step(model)  # still follows a no_sync forward
    step(model)  # follows a synchronized forward: broadcast
    assert len(factory.link.collectives) == 2


def test_broadcast_buffers_false_turns_it_off_and_buffer_free_models_never_broadcast() -> None:
    factory = LinkFactory()
    step(wrap(with_norm(), factory, broadcast_buffers=False))
    assert factory.link.collectives == []
    factory = LinkFactory()
    step(wrap(mlp(), factory))
    assert factory.link.collectives == []


# ------------------------------------------------------------------ constructor
def test_ddp_arguments_are_accepted_and_the_inapplicable_ones_warned_about_once() -> None:
    factory = LinkFactory()
    with pytest.warns(UserWarning) as caught:
        wrap(
            mlp(),
            factory,
            find_unused_parameters=True,
            static_graph=True,
            gradient_as_bucket_view=True,
            mixed_precision=object(),
            process_group=object(),
            dim=1,
        )
    (warning,) = caught
    message = str(warning.message)
    assert "mixed_precision" in message and "process_group" in message and "dim" in message
    assert "gradient_as_bucket_view" not in message
    assert "find_unused_parameters" not in message and "static_graph" not in message


def test_ddp_positional_order_and_honoured_arguments_draw_no_warning() -> None:
    factory = LinkFactory()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model = gradsync.DistributedDataParallel(
            mlp(),
            None,  # device_ids, DDP's second positional argument
            None,  # output_device
            0,  # dim
            False,  # broadcast_buffers
            True,  # init_sync
            None,  # process_group
            5,  # bucket_cap_mb
            coordinator="fake:1",
            rank=0,
            world_size=2,
            link_factory=factory,
        )
    assert model.broadcast_buffers is False
    assert model.config.bucket_cap_bytes == 5 << 20


def test_device_ids_for_a_cpu_module_is_refused_as_ddp_does() -> None:
    with pytest.raises(ValueError, match=r"device_ids=\[0\].*CUDA module"):
        wrap(mlp(), LinkFactory(), device_ids=[0])


# ------------------------------------------------------------------ devices
def test_a_module_on_the_meta_device_is_refused_before_joining() -> None:
    factory = LinkFactory()
    module = nn.Linear(3, 2, device="meta")
    with pytest.raises(ValueError, match=r"'weight' is on device 'meta'"):
        wrap(module, factory)
    assert factory.links == []  # refused before any connection


class _OnDevice:
    def __init__(self, device: str) -> None:
        self.device = torch.device(device)


def test_cuda_without_cuda_and_mixed_devices_are_refused_naming_both() -> None:
    cuda = cast(torch.Tensor, _OnDevice("cuda:0"))
    cpu = cast(torch.Tensor, _OnDevice("cpu"))
    with pytest.raises(ValueError, match="'w' is on 'cuda:0' but CUDA is not available"):
        compat.module_device([("w", cuda)], cuda_available=False)
    with pytest.raises(ValueError, match="'b' is on 'cpu' but 'w' is on 'cuda:0'"):
        compat.module_device([("w", cuda), ("b", cpu)], cuda_available=True)
    assert compat.module_device([("w", cuda)], cuda_available=True) == torch.device("cuda:0")


def test_non_contiguous_gradients_are_staged_and_copied_back() -> None:
    factory = LinkFactory()
    module = mlp()
    model = wrap(module, factory, **ONE_PARAMETER_PER_BUCKET)
    weight = module[0].weight

    def transpose_layout(grad: torch.Tensor) -> torch.Tensor:
        return grad.t().contiguous().t()  # same values, column-major strides

    weight.register_hook(transpose_layout)  # type: ignore[no-untyped-call]
    step(model)
    reference = mlp()
    step(reference)
    assert weight.grad is not None and reference[0].weight.grad is not None
    torch.testing.assert_close(weight.grad, reference[0].weight.grad * 0.5)


# ------------------------------------------------------------------ comm hooks
@pytest.mark.parametrize(
    ("hook", "wire", "dtype"),
    [
        (hooks.fp16_compress_hook, pb.DTYPE_FLOAT16, torch.float16),
        (hooks.bf16_compress_hook, pb.DTYPE_BFLOAT16, torch.bfloat16),
    ],
    ids=["fp16", "bf16"],
)
def test_a_16_bit_compression_hook_halves_the_bytes_and_stays_within_its_precision(
    hook: hooks.CommHook, wire: int, dtype: torch.dtype
) -> None:
    factory = LinkFactory()
    module = mlp()
    model = wrap(module, factory)
    model.register_comm_hook(None, hook)

    step(model)
    reference = mlp()
    step(reference)

    # The presence vector rides at the end of the last bucket, in the hook's dtype
    # (0 and 1 are exact in 16 bits): no upload of its own.
    assert {upload[3] for upload in factory.link.uploads} == {wire}
    parameter_bytes = sum(p.numel() for p in module.parameters()) * 2
    assert sum(upload[2].size for upload in factory.link.uploads) == parameter_bytes + 4 * 2
    assert model.bytes_sent == parameter_bytes + 4 * 2
    assert factory.link.presence == [[1.0] * 4]
    tolerance = torch.finfo(dtype).eps
    for param, expected in zip(module.parameters(), reference.parameters(), strict=True):
        assert param.grad is not None and expected.grad is not None
        assert param.grad.dtype == torch.float32
        torch.testing.assert_close(param.grad, expected.grad * 0.5, rtol=tolerance, atol=1e-4)


def test_the_scaling_example_hook_sees_every_bucket_and_changes_nothing() -> None:
    factory = LinkFactory()
    module = mlp()
    model = wrap(module, factory, **ONE_PARAMETER_PER_BUCKET)
    scaling = hooks.GradientScaling(factor=1024.0)
    model.register_comm_hook(None, scaling)

    step(model)
    reference = mlp()
    step(reference)

    assert scaling.buckets_seen == len(model.bucket_plans) == 4
    for param, expected in zip(module.parameters(), reference.parameters(), strict=True):
        assert param.grad is not None and expected.grad is not None
        assert torch.equal(param.grad, expected.grad * 0.5)


def test_a_hook_is_registered_once_before_the_first_backward() -> None:
    factory = LinkFactory()
    model = wrap(mlp(), factory)
    with pytest.raises(TypeError, match="not a comm hook"):
        model.register_comm_hook(None, object())
    model.register_comm_hook(None, hooks.fp16_compress_hook)
    with pytest.raises(RuntimeError, match="only be called once"):
        model.register_comm_hook(None, hooks.bf16_compress_hook)
    late = wrap(mlp(), LinkFactory())
    step(late)
    with pytest.raises(RuntimeError, match="before the first backward"):
        late.register_comm_hook(None, hooks.fp16_compress_hook)


class _ToInt8:
    def before_upload(self, state: Any, bucket: hooks.GradBucket) -> torch.Tensor:
        return bucket.buffer.to(torch.int8)

    def after_average(self, state: Any, bucket: hooks.GradBucket, averaged: torch.Tensor) -> None:
        raise AssertionError("never reached")


def test_a_hook_returning_an_unacceptable_wire_dtype_fails_backward_naming_the_bucket() -> None:
    factory = LinkFactory()
    model = wrap(mlp(), factory, rank=1)
    model.register_comm_hook(None, _ToInt8())
    with pytest.raises(gradsync.GradSyncError, match=r"rank 1, step 0, bucket 0.*torch.int8"):
        step(model)
    assert factory.link.submitted == []


# ------------------------------------------------------------------ step log, join
def test_rank_0_logs_step_timing_every_n_steps(caplog: pytest.LogCaptureFixture) -> None:
    factory = LinkFactory()
    model = wrap(mlp(), factory, log_every_steps=2)
    with caplog.at_level(logging.INFO, logger="gradsync.client"):
        for _ in range(5):
            step(model)
    lines = [r.getMessage() for r in caplog.records if "ms/step" in r.getMessage()]
    # Step 0 opens the first window; steps 1-2 and 3-4 are logged.
    assert len(lines) == 2
    assert lines[0].startswith("rank 0: steps 1-2: ")
    assert "exposed sync" in lines[0] and "MB up/step" in lines[0]
    assert lines[0].endswith("slowest rank unknown")  # no StepReport from the coordinator


def test_the_step_log_names_the_slowest_rank_the_coordinator_reports(
    caplog: pytest.LogCaptureFixture,
) -> None:
    factory = LinkFactory()
    model = wrap(mlp(), factory, log_every_steps=1)
    with caplog.at_level(logging.INFO, logger="gradsync.client"):
        step(model)
        factory.link.report = pb.StepReport(step=0, slowest_rank=2, slowest_lag_s=0.0125)
        step(model)
        factory.link.report = pb.StepReport(step=1, slowest_rank=-1)
        step(model)
    lines = [r.getMessage() for r in caplog.records if "ms/step" in r.getMessage()]
    assert lines[0].endswith("slowest rank 2 (+12.5 ms per bucket)")
    assert lines[1].endswith("no rank lagging")


def test_other_ranks_do_not_log_step_timing(caplog: pytest.LogCaptureFixture) -> None:
    model = wrap(mlp(), LinkFactory(), rank=1, log_every_steps=1)
    with caplog.at_level(logging.INFO, logger="gradsync.client"):
        for _ in range(3):
            step(model)
    assert not [r for r in caplog.records if "ms/step" in r.getMessage()]


def test_join_reports_running_out_of_inputs_and_adopts_the_jobs_step() -> None:
    factory = LinkFactory()
    module = mlp()
    model = wrap(module, factory, rank=1)
    factory.link.join_progress = [
        pb.JoinProgress(joined_ranks=[1], next_step=2),
        pb.JoinProgress(all_joined=True, last_joiner=0, next_step=3, next_collective=5),
    ]
    theirs = [torch.full_like(t, 0.5) for t in [*module.parameters(), *module.buffers()]]
    factory.link.broadcast_result = b"".join(t.numpy().tobytes() for t in theirs)

    with model.join():
        step(model)

    assert factory.link.out_of_inputs == [1]
    assert model.step == 3 and factory.link.current_step == 3
    assert all(torch.equal(p, torch.full_like(p, 0.5)) for p in module.parameters())
    assert factory.link.collective_sequence == 6  # numbering moved to next_collective
