"""16-bit wire fidelity through a real coordinator: bitwise equal to the rounding reference.

W ranks (real processes, W = 2 and 3, and W = 3 over 3 coordinator shards) each
take one backward pass per wire configuration (bf16, fp16, each answered in 16
bits and, `wire_answer_dtype=torch.float32`, in float32) with gradients spread
over powers of ten (`support.wire_reference`). Every rank's `.grad` must equal,
bitwise, the pure-torch reference that applies gradsync's roundings to the
ranks' fp32 gradients (see `gradsync.hooks`; the float32 answer skips the last
rounding back to 16 bits). Chunks are 4 KiB so that buckets span several chunks
and a float32 answer comes back in more pieces than its upload went out in.
Against the exact average of the fp32 gradients the errors of both answers are
printed beside the error of torch DDP's 16-bit compress hooks on the same
gradients (dividing and summing in 16 bits); the 16-bit answer's must be no
larger than DDP's (gradsync's fp32 accumulation rounds at most as often), and
the float32 answer's no larger than the 16-bit answer's (one rounding fewer). At
W = 2 the two coincide wherever halving is exact; at W = 3 DDP's extra
roundings show.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from support import wire_reference
from support.processes import WORKERS, CoordinatorProcess, run_ranks
from support.shards import wait_for_shards

pytestmark = pytest.mark.timeout(240)

WIRE_WORKER = WORKERS / "wire_worker.py"
WIRE_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}
#: 4 KiB, the smallest chunk a coordinator accepts (--chunk-mb is in MiB).
CHUNK_MB = "0.00390625"


def _check_bitwise(
    ranks: list[dict[str, np.ndarray]], key: str, expected: np.ndarray, what: str
) -> None:
    for rank, saved in enumerate(ranks):
        got = saved[key]
        assert np.array_equal(got.view(np.uint32), expected.view(np.uint32)), (
            f"{what}: rank {rank}'s gradient differs from the rounding reference in "
            f"{int((got != expected).sum())} of {got.size} elements"
        )


@pytest.mark.parametrize(("world_size", "shards"), [(2, 1), (3, 1), (3, 3)])
def test_16_bit_wire_equals_the_rounding_reference_and_beats_ddp_style_rounding(
    world_size: int,
    shards: int,
    tmp_path: Path,
    coordinator_factory: Callable[..., CoordinatorProcess],
) -> None:
    extra = ["--chunk-mb", CHUNK_MB] + (["--shards", str(shards)] if shards > 1 else [])
    address = coordinator_factory(world_size, *extra).address
    if shards > 1:
        wait_for_shards(address, shards, 60)
    ranks = run_ranks(WIRE_WORKER, address, world_size, tmp_path, timeout_s=200)

    lines = []
    for name, wire_dtype in WIRE_DTYPES.items():
        worst_ours = worst_fp32 = worst_ddp = 0.0
        for index, scale in enumerate(wire_reference.SCALES):
            per_rank = [torch.from_numpy(saved[f"local/{index}"]) for saved in ranks]
            what = f"W={world_size} S={shards} {name}, parameter {index} (scale {scale:g})"
            expected = wire_reference.gradsync_average(per_rank, wire_dtype).numpy()
            _check_bitwise(ranks, f"{name}/{index}", expected, what)
            expected_fp32 = wire_reference.gradsync_average(
                per_rank, wire_dtype, answer_in_fp32=True
            ).numpy()
            _check_bitwise(ranks, f"{name}-fp32/{index}", expected_fp32, what + " fp32 answer")
            exact = wire_reference.exact_average(per_rank)
            ours = wire_reference.relative_error(torch.from_numpy(expected), exact)
            fp32 = wire_reference.relative_error(torch.from_numpy(expected_fp32), exact)
            ddp = wire_reference.relative_error(
                wire_reference.ddp_compress_hook_average(per_rank, wire_dtype), exact
            )
            lines.append(
                f"  {name:8} scale {scale:<6g} gradsync {ours:.3e}   fp32 answer {fp32:.3e}"
                f"   DDP-style {ddp:.3e}"
            )
            assert ours <= ddp, (
                f"{what}: gradsync's relative error {ours:.3e} exceeds DDP-style 16-bit "
                f"summation's {ddp:.3e}"
            )
            worst_ours, worst_ddp = max(worst_ours, ours), max(worst_ddp, ddp)
            worst_fp32 = max(worst_fp32, fp32)
        lines.append(
            f"  {name:8} all          gradsync {worst_ours:.3e}   fp32 answer {worst_fp32:.3e}"
            f"   DDP-style {worst_ddp:.3e}"
        )
        assert worst_ours <= worst_ddp, (
            f"W={world_size} {name}: gradsync's max relative error {worst_ours:.3e} exceeds "
            f"DDP-style 16-bit summation's {worst_ddp:.3e}"
        )
        assert worst_fp32 <= worst_ours, (
            f"W={world_size} {name}: the float32 answer's max relative error {worst_fp32:.3e} "
            f"exceeds the 16-bit answer's {worst_ours:.3e}, yet it skips a rounding"
        )
        parameters_bytes = sum(wire_reference.ELEMENTS) * 2
        for saved in ranks:  # 16-bit gradients + the fp32 presence vector, either answer
            for configuration in (name, f"{name}-fp32"):
                sent = int(saved[f"meta/{configuration}/bytes_sent"])
                assert sent == parameters_bytes + 4 * len(wire_reference.SCALES), configuration
    print(
        f"\nW={world_size} S={shards}: max relative error against the exact fp32 average "
        "(largest |error| over the parameter's largest |value|)\n" + "\n".join(lines)
    )
