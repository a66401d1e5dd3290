"""DiLoCo's sparse 2-bit wire on the worker: each chunk's top-k, 2 bits a value, error feedback.

`gradsync.DiLoCo(wire_dtype=gradsync.SparseWire(density=0.02))` uploads each
float32 bucket of a pseudo-gradient, chunk by chunk of the coordinator's
grid (the int8 wire's: one element per int8 byte, each shard's range chunked
on its own, `ChunkGrid`), as the chunk's top `density` share of elements by
magnitude, 2 bits each, with one float32 step per chunk and the indices as
gap varints or a bitmap, whichever is shorter (the rule and the bytes:
`gradsync_proto.sparse_wire`, shared with the coordinator). Everything the
chunk did not send, the rounding of what it did included, stays on the
worker: the hook keeps, per bucket, the upload minus exactly what the
coordinator will sum (q * step in float32) and adds it to that bucket's next
upload.

The coordinator sums the contributions per chunk in a dense float32
accumulator in rank order, takes the outer step and answers with the same
form: the top `answer_density` of each chunk's change of the global
parameters the ranks hold, its own residual kept in exact - public
(`gradsync_server.dataplane.outer_answer`). The answer lands like the int8
compact answer (`gradsync.quantized_wire.Int8Answer`): q and the chunk's step, then
q * step in float32, added to the rank's global parameters with one float32
add, so every replica stays bitwise equal to the coordinator's public copy.
Bytes per round, each way: about 1.25 bytes per selected element plus a
few per chunk, some 1/150 of float32 DiLoCo's at a density of 0.02, and the
download does not grow with the number of ranks.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from gradsync_proto import sparse_wire

from gradsync.quantized_wire import ChunkGrid, Int8Quantization, Int8Wire

__all__ = [
    "DENSE_OUTER_MOMENTUM",
    "SPARSE_OUTER_MOMENTUM",
    "SparseQuantization",
    "SparseWire",
    "default_outer_momentum",
    "sparse_settings",
]

#: DiLoCo's outer momentum when the caller leaves it None: Nesterov 0.5 on a dense
#: wire, none on the sparse wire, whose error feedback already carries every
#: element a round left out into later rounds (momentum on top of it overshoots:
#: bench/results/wire/ has the measurements).
DENSE_OUTER_MOMENTUM = 0.5
SPARSE_OUTER_MOMENTUM = 0.0


@dataclass(frozen=True)
class SparseWire:
    """The sparse 2-bit wire's settings, passed as `gradsync.DiLoCo(wire_dtype=...)`.

    Args:
        density: the share of each chunk's elements a rank uploads, in (0, 0.25].
        answer_density: the share of each chunk's change of the global parameters
            the coordinator answers with, in (0, 0.25] (None = `density`).

    Raises:
        ValueError: a density outside (0, 0.25] or not a number.
    """

    density: float = 0.02
    answer_density: float | None = None

    def __post_init__(self) -> None:
        for name in ("density", "answer_density"):
            value = getattr(self, name)
            if name == "answer_density" and value is None:
                continue
            problem = sparse_wire.density_problem(value)
            if problem is not None:
                raise ValueError(f"SparseWire({name}={value!r}): {problem}")

    @property
    def downlink_density(self) -> float:
        """The answer's density (`answer_density`, else `density`)."""
        return self.density if self.answer_density is None else self.answer_density


class SparseQuantization(Int8Quantization):
    """The comm hook of the sparse 2-bit wire (see the module docstring).

    Args:
        grid: returns the current chunk grid (read at every bucket).
        error_feedback: keep what each upload left out for the bucket's next one.
        density: the share of each chunk's elements sent.
    """

    def __init__(self, grid: Callable[[], ChunkGrid], error_feedback: bool, density: float) -> None:
        super().__init__(grid, error_feedback, int8_answer=True)
        self.density = density

    def _encode(self, upload: torch.Tensor) -> Int8Wire:
        payloads, q, steps = sparse_wire.encode_bucket(
            upload.numpy(), self.grid().spans(upload.numel()), self.density
        )
        return Int8Wire(torch.from_numpy(q), steps, int8_answer=True, encoded=payloads)

    def __repr__(self) -> str:
        feedback = self.residuals is not None
        return f"{type(self).__name__}(density={self.density}, error_feedback={feedback})"


def default_outer_momentum(
    outer_momentum: float | None, wire_dtype: torch.dtype | SparseWire | None
) -> float:
    """`outer_momentum`, or when None the default for the wire (see the constants)."""
    if outer_momentum is not None:
        return outer_momentum
    sparse = isinstance(wire_dtype, SparseWire)
    return SPARSE_OUTER_MOMENTUM if sparse else DENSE_OUTER_MOMENTUM


def sparse_settings(
    wire_dtype: torch.dtype | SparseWire | None, answer_dtype: torch.dtype | str | None
) -> tuple[SparseWire | None, torch.dtype | None, torch.dtype | str | None]:
    """(sparse settings or None, the wire dtype, the answer dtype) DiLoCo runs with.

    A `SparseWire` travels as int8 chunks (its grid) and is answered in int8
    levels, sparse too: (settings, torch.int8, torch.int8).

    Raises:
        ValueError: `answer_dtype` other than "auto", None or torch.int8 with a `SparseWire`.
    """
    if not isinstance(wire_dtype, SparseWire):
        return None, wire_dtype, answer_dtype
    if answer_dtype not in ("auto", None, torch.int8):
        raise ValueError(
            f"answer_dtype={answer_dtype!r} cannot answer wire_dtype={wire_dtype!r}: its "
            'answer is sparse int8 levels (leave answer_dtype "auto", or torch.int8)'
        )
    return wire_dtype, torch.int8, torch.int8
