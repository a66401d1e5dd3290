"""End to end over real gRPC on loopback: a coordinator process and worker processes."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from support import scenarios
from support.processes import run_workers

# Small chunks (16 KiB) so that buckets span several chunks on the wire.
SMALL_CHUNKS = ("--chunk-mb", "0.015625")


def relative_error(got: np.ndarray, expected: np.ndarray) -> float:
    expected64 = expected.astype(np.float64)
    return float(np.linalg.norm(got.astype(np.float64) - expected64) / np.linalg.norm(expected64))


@pytest.mark.timeout(180)
@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_training_matches_single_process(
    world_size: int, coordinator_factory, tmp_path: Path
) -> None:
    coordinator = coordinator_factory(world_size, *SMALL_CHUNKS)
    steps = 4
    outputs = run_workers(
        coordinator.address, world_size, "parity", tmp_path, "--steps", str(steps)
    )
    rank0_init = scenarios.MixedModel(seed=0)
    reference = scenarios.reference_training(world_size, steps, init_seed=0)
    assert int(outputs[0]["num_buckets"]) >= 3, "the test model should span several buckets"
    for rank, output in enumerate(outputs):
        # Differently seeded ranks start from rank 0's weights and buffers.
        for name, param in rank0_init.named_parameters():
            np.testing.assert_array_equal(output[f"initial/{name}"], param.detach().numpy())
        assert int(output["initial/calls"]) == 0, f"rank {rank} did not receive rank 0's buffer"
        for name, param in reference.named_parameters():
            got = output[f"final/{name}"]
            expected = param.detach().numpy()
            assert relative_error(got, expected) <= 1e-6, (rank, name)
            # All ranks hold bitwise-identical parameters.
            np.testing.assert_array_equal(got, outputs[0][f"final/{name}"])
        # The run must actually have moved the weights.
        assert not np.array_equal(output["final/out.weight"], output["initial/out.weight"])


@pytest.mark.timeout(120)
def test_no_sync_accumulation_equals_big_batch_gradient(
    coordinator_factory, tmp_path: Path
) -> None:
    world_size, micro_batches = 2, 3
    coordinator = coordinator_factory(world_size, *SMALL_CHUNKS)
    outputs = run_workers(
        coordinator.address, world_size, "no_sync", tmp_path, "--micro-batches", str(micro_batches)
    )
    expected = scenarios.reference_accumulated_gradients(world_size, micro_batches)
    for output in outputs:
        assert int(output["step"]) == 1, "only the last backward may synchronize"
        for name, grad in expected.items():
            assert relative_error(output[f"grad/{name}"], grad.numpy()) <= 1e-6, name


@pytest.mark.timeout(120)
def test_unused_parameter_does_not_hang(coordinator_factory, tmp_path: Path) -> None:
    world_size = 3
    coordinator = coordinator_factory(world_size, *SMALL_CHUNKS)
    outputs = run_workers(coordinator.address, world_size, "unused", tmp_path)
    # Only rank 0 used `extra`: every rank ends with rank 0's gradient / world_size.
    model = scenarios.MixedModel(seed=0)
    x, y = scenarios.rank_batch(0, world_size, 0)
    scenarios.loss_fn(model(x, use_extra=True), y).backward()
    assert model.extra.weight.grad is not None
    expected_extra = model.extra.weight.grad.numpy() / world_size
    for output in outputs:
        assert int(output["contributors"]) == world_size
        assert relative_error(output["grad/extra.weight"], expected_extra) <= 1e-6
        np.testing.assert_array_equal(output["grad/extra.weight"], outputs[0]["grad/extra.weight"])
        np.testing.assert_array_equal(
            output["grad/hidden.weight"], outputs[0]["grad/hidden.weight"]
        )
        assert np.any(output["grad/hidden.weight"] != 0)
