"""The coordinator's outer optimizer (`gradsync_server.dataplane.outer`), as pure logic.

Checked against torch.optim.SGD on the same averaged pseudo-gradients, chunk by
chunk and range by range (a shard holds one range of every bucket); an aborted
step changes nothing; the signature checks refuse unusable outer settings.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gradsync_proto import chunking
from gradsync_proto.v1 import gradsync_pb2 as pb
from gradsync_server.control import signature as signatures
from gradsync_server.dataplane.outer import OuterState
from gradsync_server.errors import RejectedMessage

ELEMENTS = 10


def floats(values: np.ndarray) -> memoryview:
    return values.astype("<f4").data.cast("B")


def buckets() -> list[pb.BucketSpec]:
    return [
        pb.BucketSpec(
            parameter_indices=[0], dtype=pb.DTYPE_FLOAT32, num_elements=ELEMENTS, outer=True
        ),
        pb.BucketSpec(parameter_indices=[1], dtype=pb.DTYPE_FLOAT32, num_elements=2),
    ]


@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize(("shard_count", "shard_index"), [(1, 0), (3, 1)])
def test_outer_steps_equal_torch_sgd_on_every_range(
    nesterov: bool, shard_count: int, shard_index: int
) -> None:
    outer = pb.OuterOptimizer(lr=0.7, momentum=0.9, nesterov=nesterov)
    state = OuterState(outer, buckets(), shard_count, shard_index)
    assert state.holds(0) and not state.holds(1)
    lo, hi = chunking.shard_ranges(ELEMENTS, shard_count)[shard_index]
    rng = np.random.default_rng(3)
    initial = rng.standard_normal(ELEMENTS).astype(np.float32)
    reference = torch.tensor(initial[lo:hi], requires_grad=True)
    sgd = torch.optim.SGD([reference], lr=0.7, momentum=0.9, nesterov=nesterov)
    # The seed: the answer is the average itself (the parameters), in two chunks.
    middle = lo + (hi - lo) // 2
    for start, stop in ((lo, middle), (middle, hi)):
        answer = state.answer(0, start * 4, pb.DTYPE_FLOAT32, floats(initial[start:stop]))
        np.testing.assert_array_equal(np.frombuffer(answer, "<f4"), initial[start:stop])
    assert not state.seeded
    state.commit()
    assert state.seeded and state.rounds == 0
    for _ in range(4):
        pseudo = rng.standard_normal(ELEMENTS).astype(np.float32)
        answers = [
            np.frombuffer(
                state.answer(0, start * 4, pb.DTYPE_FLOAT32, floats(pseudo[start:stop])), "<f4"
            ).copy()
            for start, stop in ((lo, middle), (middle, hi))
        ]
        state.commit()
        reference.grad = torch.tensor(pseudo[lo:hi])
        sgd.step()
        np.testing.assert_allclose(np.concatenate(answers), reference.detach().numpy(), atol=1e-6)
    assert state.rounds == 4 and state.held_bytes() == 2 * 4 * (hi - lo)


def test_a_discarded_step_leaves_parameters_and_momentum_as_they_were() -> None:
    state = OuterState(pb.OuterOptimizer(lr=0.5, momentum=0.9, nesterov=True), buckets(), 1, 0)
    ones = np.ones(ELEMENTS, dtype=np.float32)
    state.answer(0, 0, pb.DTYPE_FLOAT32, floats(ones))
    state.commit()
    first = np.frombuffer(state.answer(0, 0, pb.DTYPE_FLOAT32, floats(ones)), "<f4").copy()
    state.discard()  # the step was aborted
    again = np.frombuffer(state.answer(0, 0, pb.DTYPE_FLOAT32, floats(ones)), "<f4").copy()
    np.testing.assert_array_equal(first, again)
    assert state.rounds == 0


def test_a_16_bit_wire_offset_is_read_in_its_own_elements() -> None:
    state = OuterState(pb.OuterOptimizer(lr=1.0), buckets(), 1, 0)
    seed = np.arange(ELEMENTS, dtype=np.float32)
    state.answer(0, 0, pb.DTYPE_FLOAT32, floats(seed))
    state.commit()
    # Elements 6.. of a bfloat16 upload start at byte 12; the answer is in float32.
    answer = state.answer(0, 12, pb.DTYPE_BFLOAT16, floats(np.ones(4, dtype=np.float32)))
    np.testing.assert_array_equal(np.frombuffer(answer, "<f4"), seed[6:] - 1)


def test_without_an_outer_optimizer_nothing_is_held() -> None:
    state = OuterState()
    assert not state.holds(0) and state.held_bytes() == 0
    state.commit()
    state.discard()


def signature(**outer: object) -> pb.ModelSignature:
    specs = [pb.TensorSpec(name="w", shape=[ELEMENTS], dtype=pb.DTYPE_FLOAT32)]
    bucket = pb.BucketSpec(parameter_indices=[0], dtype=pb.DTYPE_FLOAT32, num_elements=ELEMENTS)
    bucket.outer = True
    return pb.ModelSignature(parameters=specs, buckets=[bucket], outer=pb.OuterOptimizer(**outer))


@pytest.mark.parametrize(
    ("outer", "words"),
    [
        ({"lr": 0.0}, "outer learning rate must be finite and > 0"),
        ({"lr": float("nan")}, "outer learning rate"),
        ({"lr": 0.7, "momentum": 1.0}, "outer momentum must be in [0, 1)"),
        ({"lr": 0.7, "nesterov": True}, "Nesterov outer momentum needs a momentum > 0"),
    ],
)
def test_unusable_outer_settings_are_refused_naming_them(
    outer: dict[str, object], words: str
) -> None:
    with pytest.raises(RejectedMessage, match=words.replace("[", r"\[").replace(")", r"\)")):
        signatures.validate(1, signature(**outer))


def test_ranks_with_different_outer_settings_are_told_apart() -> None:
    ours, theirs = signature(lr=0.7, momentum=0.9, nesterov=True), signature(lr=0.5)
    difference = signatures.first_difference(0, ours, 1, theirs)
    assert difference is not None
    assert "lr 0.5" in difference and "lr 0.7" in difference and "outer" in difference
    assert (
        signatures.first_difference(0, ours, 1, signature(lr=0.7, momentum=0.9, nesterov=True))
        is None
    )


def test_outer_buckets_must_be_float32_and_need_an_outer_optimizer() -> None:
    unmarked = signature(lr=0.7)
    unmarked.ClearField("outer")
    with pytest.raises(RejectedMessage, match="marked outer, but no outer optimizer"):
        signatures.validate(0, unmarked)


@pytest.mark.parametrize("fragments", [1, 2, 3, 5])
def test_fragments_are_runs_of_about_equal_bytes_in_order_none_empty(fragments: int) -> None:
    from gradsync.diloco import _split

    params = [torch.zeros(n) for n in (300, 10, 10, 200, 100, 40, 500, 1)]
    groups = _split(params, fragments)
    assert len(groups) == fragments and all(groups)
    assert [id(p) for group in groups for p in group] == [id(p) for p in params]  # in order
    sizes = [sum(p.numel() for p in group) for group in groups]
    assert max(sizes) <= sum(sizes) / fragments + 500  # no run beyond its share by a tensor
