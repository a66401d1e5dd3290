"""The coordinator's fold touches each byte as few times as it can, without changing a bit.

A misaligned payload is copied once (`examine`) and that copy becomes the
chunk's accumulator; a read-only aligned one is copied exactly once; the
divide writes a float16 reply directly. Every shortcut is checked against
the operations it replaces, bit for bit.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
import pytest
from gradsync_proto.v1 import gradsync_pb2 as pb
from gradsync_server.dataplane.accumulators import (
    average_bytes,
    from_accumulator,
    scaled_accumulator,
    to_accumulator,
)
from gradsync_server.dataplane.aggregation import BucketReduction, Magnitude, classify, examine

F32, F64, F16, BF16 = pb.DTYPE_FLOAT32, pb.DTYPE_FLOAT64, pb.DTYPE_FLOAT16, pb.DTYPE_BFLOAT16
ELEMENTS = 1000


def misaligned(raw: bytes) -> memoryview:
    """`raw` as a read-only view one byte into a message, as a chunk after its header."""
    return memoryview(b"h" + raw)[1:]


def values_of(dtype: int, seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    decades = 3 if dtype == F16 else 6  # float16 tops out at 65504
    values = rng.standard_normal(ELEMENTS) * 10.0 ** rng.integers(-decades, decades, ELEMENTS)
    if dtype == BF16:
        return (values.astype(np.float32).view(np.uint32) >> 16).astype("<u2").tobytes()
    wire: dict[int, str] = {F32: "<f4", F64: "<f8", F16: "<f2"}
    return values.astype(wire[dtype]).tobytes()


def test_a_misaligned_first_contribution_is_summed_in_the_copy_examine_made() -> None:
    first, second = values_of(F32, 1), values_of(F32, 2)
    reduction = BucketReduction([0, 1], F32, len(first), len(first))
    payload, magnitude = examine(misaligned(first), F32)
    assert magnitude is Magnitude.TAME
    assert reduction.add(0, 0, payload, magnitude) is None
    averaged = reduction.add(1, 0, *examine(misaligned(second), F32))
    assert averaged is not None
    # The float32 average is a view of the accumulator: the buffer examine copied into.
    assert np.shares_memory(np.frombuffer(averaged, np.uint8), np.frombuffer(payload, np.uint8))
    expected = np.frombuffer(first, "<f4") + np.frombuffer(second, "<f4")
    expected /= 2
    assert bytes(averaged) == expected.tobytes()


def test_a_read_only_aligned_first_contribution_is_copied_once_and_left_alone() -> None:
    first, second = values_of(F32, 3), values_of(F32, 4)
    reduction = BucketReduction([0, 1], F32, len(first), len(first))
    payload, _ = examine(first, F32)
    assert payload is first  # aligned: nothing to copy yet
    reduction.add(0, 0, payload)
    averaged = reduction.add(1, 0, second)
    assert averaged is not None
    assert not np.shares_memory(np.frombuffer(averaged, np.uint8), np.frombuffer(first, np.uint8))
    assert payload == values_of(F32, 3)  # the message's bytes are not summed into


@pytest.mark.parametrize("dtype", [F32, F64, F16, BF16])
@pytest.mark.parametrize("weighted", [False, True])
def test_misaligned_and_aligned_payloads_average_to_the_same_bits(
    dtype: int, weighted: bool
) -> None:
    raws = [values_of(dtype, seed) for seed in range(3)]
    results = []
    for shape in (bytes, misaligned):
        reduction = BucketReduction(range(3), dtype, len(raws[0]), len(raws[0]))
        averaged = None
        for rank in (2, 0, 1):  # rank 2 parks until 0 and 1 are in
            sample_weight = 0.5 + rank if weighted else None
            averaged = reduction.add(rank, 0, shape(raws[rank]), sample_weight=sample_weight)
        assert averaged is not None and reduction.buffered_bytes == 0
        results.append(bytes(averaged))
    assert results[0] == results[1]


def test_parked_misaligned_copies_count_in_buffered_bytes() -> None:
    raws = [values_of(F32, seed) for seed in range(3)]
    reduction = BucketReduction(range(3), F32, len(raws[0]), len(raws[0]))
    assert reduction.add(2, 0, misaligned(raws[2])) is None
    assert reduction.add(1, 0, misaligned(raws[1])) is None
    assert reduction.buffered_bytes == 2 * len(raws[0])
    assert reduction.add(0, 0, misaligned(raws[0])) is not None
    assert reduction.buffered_bytes == 0


def test_examine_copies_every_bit_nan_payloads_included() -> None:
    bits = np.array([0x7FC00001, 0xFFBADBAD, 0x3F800000, 0x7F800000], "<u4")
    payload, magnitude = examine(misaligned(bits.tobytes()), F32)
    assert magnitude is Magnitude.NONFINITE
    assert bytes(payload) == bits.tobytes()
    assert np.frombuffer(payload, np.uint8).ctypes.data % 4 == 0


SPECIAL = np.array(
    [0.0, -0.0, 1.0, 3.0, 1e-8, 6e-8, 3e-5, 65504.0, 65520.0, 2e5, 3.4e38, np.inf, -np.inf, np.nan],
    np.float32,
)


@pytest.mark.parametrize("dtype", [F32, F16, BF16])
@pytest.mark.parametrize("divisor", [1, 3, 7, np.float32(0.3), np.float32(2.7), np.float64(0.3)])
def test_average_bytes_is_divide_then_convert_bit_for_bit(
    dtype: int, divisor: float | np.floating
) -> None:
    rng = np.random.default_rng(5)
    spread = rng.standard_normal(4096) * 10.0 ** rng.integers(-10, 10, 4096)
    accumulator = np.concatenate([SPECIAL, -SPECIAL, spread.astype(np.float32)])
    with np.errstate(over="ignore", invalid="ignore"):
        expected = accumulator.copy()
        expected /= divisor
        reference = bytes(from_accumulator(expected, dtype))
        assert bytes(average_bytes(accumulator.copy(), divisor, dtype)) == reference


@pytest.mark.parametrize("dtype", [F32, F64, F16, BF16])
@pytest.mark.parametrize("owned", [False, True])
def test_scaled_accumulator_is_copy_then_multiply_bit_for_bit(dtype: int, owned: bool) -> None:
    raw = values_of(dtype, 6)
    expected = to_accumulator(raw, dtype)
    expected *= expected.dtype.type(0.37)
    payload = memoryview(bytearray(raw)) if owned else raw
    assert scaled_accumulator(payload, dtype, 0.37).tobytes() == expected.tobytes()


def test_bfloat16_rounding_of_an_average_matches_from_accumulator_for_every_upper_half() -> None:
    upper = np.arange(1 << 16, dtype=np.uint32) << 16  # every sign, exponent, mantissa; NaNs too
    lows = np.array([0, 1, 0x7FFF, 0x8000, 0x8001, 0xFFFF], np.uint32)  # ties, and the carries
    accumulator = (upper[:, None] | lows[None, :]).ravel().view(np.float32)
    with np.errstate(all="ignore"):
        for divisor in (1, 3):
            expected = accumulator.copy()
            expected /= divisor
            reference = bytes(from_accumulator(expected, BF16))
            assert bytes(average_bytes(accumulator.copy(), divisor, BF16)) == reference


def test_bfloat16_widens_every_value_into_the_upper_half() -> None:
    bits = np.arange(1 << 16, dtype=np.uint32).astype("<u2")
    widened = to_accumulator(bits.tobytes(), BF16)
    assert widened.dtype == np.float32
    assert widened.view(np.uint32).tobytes() == (bits.astype(np.uint32) << 16).tobytes()


@pytest.mark.parametrize("dtype", [F16, BF16])
def test_sixteen_bit_classify_agrees_with_the_masked_exponent_maximum(dtype: int) -> None:
    mask = np.uint16(0x7C00 if dtype == F16 else 0x7F80)

    def reference(bits: npt.NDArray[np.uint16]) -> Magnitude:  # the masked maximum, as it was
        top = int((bits & mask).max())
        if top == mask:
            return Magnitude.NONFINITE
        if dtype == BF16 and top > (127 + 63) << 7:
            return Magnitude.LARGE
        return Magnitude.TAME

    every = np.arange(1 << 16, dtype=np.uint32).astype("<u2")
    rng = np.random.default_rng(7)
    payloads = [every[i : i + 1] for i in range(len(every))]  # each value alone
    payloads += [rng.choice(every, size) for size in (2, 3, 17) for _ in range(800)]
    for bits in payloads:
        assert classify(bits.tobytes(), dtype) is reference(bits), bits
