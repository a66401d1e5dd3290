"""16-bit wire fidelity through a real coordinator: bitwise equal to the rounding reference.

W ranks (real processes, W = 2 and 3) each take one backward pass per wire
dtype (bf16, fp16) with gradients spread over powers of ten
(`support.wire_reference`). Every rank's `.grad` must equal, bitwise, the
pure-torch reference that applies gradsync's roundings to the ranks' fp32
gradients (see `gradsync.hooks`). Against the exact average of the fp32
gradients its error is printed beside the error of torch DDP's 16-bit compress
hooks on the same gradients (dividing and summing in 16 bits), and must be no
larger: gradsync's fp32 accumulation rounds at most as often. At W = 2 the two
coincide wherever halving is exact; at W = 3 DDP's extra roundings show.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from support import wire_reference
from support.processes import WORKERS, CoordinatorProcess, run_ranks

pytestmark = pytest.mark.timeout(180)

WIRE_WORKER = WORKERS / "wire_worker.py"
WIRE_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}


@pytest.mark.parametrize("world_size", [2, 3])
def test_16_bit_wire_equals_the_rounding_reference_and_beats_ddp_style_rounding(
    world_size: int, tmp_path: Path, coordinator_factory: Callable[..., CoordinatorProcess]
) -> None:
    address = coordinator_factory(world_size).address
    ranks = run_ranks(WIRE_WORKER, address, world_size, tmp_path, timeout_s=150)

    lines = []
    for name, wire_dtype in WIRE_DTYPES.items():
        worst_ours = worst_ddp = 0.0
        for index, scale in enumerate(wire_reference.SCALES):
            per_rank = [torch.from_numpy(saved[f"local/{index}"]) for saved in ranks]
            expected = wire_reference.gradsync_average(per_rank, wire_dtype).numpy()
            for rank, saved in enumerate(ranks):
                got = saved[f"{name}/{index}"]
                assert np.array_equal(got.view(np.uint32), expected.view(np.uint32)), (
                    f"W={world_size} {name}: rank {rank}'s gradient of parameter {index} "
                    f"(scale {scale:g}) differs from the rounding reference in "
                    f"{int((got != expected).sum())} of {got.size} elements"
                )
            exact = wire_reference.exact_average(per_rank)
            ours = wire_reference.relative_error(torch.from_numpy(expected), exact)
            ddp = wire_reference.relative_error(
                wire_reference.ddp_compress_hook_average(per_rank, wire_dtype), exact
            )
            lines.append(f"  {name:8} scale {scale:<6g} gradsync {ours:.3e}   DDP-style {ddp:.3e}")
            assert ours <= ddp, (
                f"W={world_size} {name}, parameter {index} (scale {scale:g}): gradsync's "
                f"relative error {ours:.3e} exceeds DDP-style 16-bit summation's {ddp:.3e}"
            )
            worst_ours, worst_ddp = max(worst_ours, ours), max(worst_ddp, ddp)
        lines.append(
            f"  {name:8} all          gradsync {worst_ours:.3e}   DDP-style {worst_ddp:.3e}"
        )
        assert worst_ours <= worst_ddp, (
            f"W={world_size} {name}: gradsync's max relative error {worst_ours:.3e} exceeds "
            f"DDP-style 16-bit summation's {worst_ddp:.3e}"
        )
        parameters_bytes = sum(wire_reference.ELEMENTS) * 2
        for saved in ranks:  # 16-bit gradients + the fp32 presence vector
            sent = int(saved[f"meta/{name}/bytes_sent"])
            assert sent == parameters_bytes + 4 * len(wire_reference.SCALES)
    print(
        f"\nW={world_size}: max relative error against the exact fp32 average "
        "(largest |error| over the parameter's largest |value|)\n" + "\n".join(lines)
    )
