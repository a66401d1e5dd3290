"""Pure-torch references for 16-bit wire averages: gradsync's roundings and DDP's.

`gradsync_average` spells out, one torch operation per rounding, what the
16-bit wire does (see `gradsync.hooks`): round each rank's fp32 gradient to the
16-bit type, widen to fp32, sum in fp32 in rank order, divide by the world size
in fp32, round to the 16-bit type (not with a float32 answer,
`wire_answer_dtype`), widen into fp32. The distributed result must equal it
bitwise. `ddp_compress_hook_average` emulates torch DDP's
`default_hooks._compress_hook` (behind `bf16_compress_hook` and
`fp16_compress_hook`) on the same gradients without gloo: round to 16 bits,
divide by the world size in 16 bits, all-reduce SUM in 16 bits (every addition
rounded to 16 bits; gloo's ring adds in another order per chunk, with as many
roundings). `spread_gradients` makes gradients whose scale differs by powers of
ten from one parameter to the next, as real models' layers do.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

#: The scale of each test parameter's gradients: 1e-6 (below float16's normal
#: range, 6.1e-5) up to 10, as embeddings, deep and output layers differ.
SCALES = (1e-6, 1e-4, 1e-3, 1e-2, 1.0, 10.0)
#: Elements per test parameter (each its own bucket with a small bucket cap).
ELEMENTS = (4096, 3000, 5000, 2048, 6000, 1000)


def spread_gradients(rank: int) -> list[torch.Tensor]:
    """Rank `rank`'s fp32 gradients: randn scaled by SCALES, seeded by rank and parameter."""
    gradients = []
    for index, (scale, elements) in enumerate(zip(SCALES, ELEMENTS, strict=True)):
        generator = torch.Generator().manual_seed(1000 * rank + index)
        gradients.append(torch.randn(elements, generator=generator) * scale)
    return gradients


def gradsync_average(
    per_rank: Sequence[torch.Tensor], wire_dtype: torch.dtype, answer_in_fp32: bool = False
) -> torch.Tensor:
    """The fp32 gradient a 16-bit wire leaves in `.grad`, rounding by rounding.

    `answer_in_fp32`: the average comes back as the coordinator's fp32 value
    (`wire_answer_dtype=torch.float32`), without the last rounding to 16 bits.
    """
    widened = [gradient.to(wire_dtype).to(torch.float32) for gradient in per_rank]
    total = widened[0].clone()
    for value in widened[1:]:  # ascending rank order, fp32 additions
        total = total + value
    average = total / len(per_rank)  # fp32 division (one rounding)
    if answer_in_fp32:
        return average
    return average.to(wire_dtype).to(torch.float32)


def ddp_compress_hook_average(
    per_rank: Sequence[torch.Tensor], wire_dtype: torch.dtype
) -> torch.Tensor:
    """torch DDP's 16-bit compress hooks: divide in 16 bits, sum in 16 bits, widen."""
    compressed = [gradient.to(wire_dtype).div_(len(per_rank)) for gradient in per_rank]
    total = compressed[0].clone()
    for value in compressed[1:]:
        total = total + value  # a 16-bit addition: rounded to 16 bits every time
    return total.to(torch.float32)


def exact_average(per_rank: Sequence[torch.Tensor]) -> torch.Tensor:
    """The average of the fp32 gradients, in float64 (exact for these inputs to ~1e-16)."""
    return torch.stack([gradient.double() for gradient in per_rank]).mean(dim=0)


def relative_error(result: torch.Tensor, exact: torch.Tensor) -> float:
    """Largest absolute error over the parameter's largest exact value.

    Scaled per parameter rather than per element: an element's own relative
    error is unbounded where the ranks' gradients cancel, for any method.
    """
    scale = float(exact.abs().max())
    return float((result.double() - exact).abs().max()) / scale
