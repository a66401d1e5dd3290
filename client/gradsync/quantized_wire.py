"""DiLoCo's int8 wire on the worker: every chunk of a bucket quantized with its own scale.

`gradsync.DiLoCo(wire_dtype=torch.int8)` uploads each float32 bucket of a
pseudo-gradient as int8 values plus one float32 scale per chunk (the rule is
`gradsync_proto.int8_wire`, shared with the coordinator, which dequantizes
and sums in float32). A scale per chunk means the quantization must happen on
the very grid the transport cuts the bucket on: each shard's range of the
bucket's int8 bytes, chunked on its own, with the coordinator's chunk size
and shard count from the Welcome (`ChunkGrid`, through the transport's own
`bucket_uploads.expected_chunks`). So the comm hook (`Int8Quantization`)
returns an `Int8Wire`, the values and each chunk's scale by offset; the
reducer hands the scales to the transport inside the bucket's `BucketBuffer`,
and each chunk's header carries its own (`GradientChunk.scale`). The answer,
the new global parameters, comes back in float32 into the bucket's buffer, or
with `DiLoCo(answer_dtype=torch.int8)` as int8 changes with a scale per chunk
of the same grid (`Int8Answer`, asked for by `Int8Wire.int8_answer`).

Error feedback uses exactly what the coordinator sums: the hook keeps, per
bucket, the upload minus its dequantized values (q * scale in float32, the
same function the coordinator runs) and adds it to that bucket's next
upload. It is kept per flat bucket, not per parameter as for a 16-bit wire
(`gradsync.diloco`), because a chunk's scale spans parameters: only the
bucket's grid says what each element became.

`DistributedDataParallel(wire_dtype=torch.int8)` is refused
(`gradsync.hooks.hook_for_wire_dtype`): a gradient average every step in
8 bits, without error feedback, is not what this wire is for.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch
from gradsync_proto import chunking, int8_wire
from gradsync_proto.v1 import gradsync_pb2 as pb

from gradsync.hooks import GradBucket
from gradsync.path.bucket_uploads import expected_chunks
from gradsync.path.buffers import BucketBuffer

__all__ = ["ChunkGrid", "Int8Answer", "Int8Quantization", "Int8Wire", "WireHook", "check_int8_wire"]


@dataclass(frozen=True)
class ChunkGrid:
    """The coordinator's chunk size and shard count: what a bucket is cut by."""

    chunk_bytes: int
    shard_count: int

    @classmethod
    def of(cls, welcome: pb.Welcome | None) -> ChunkGrid:
        """The grid the transport cuts on, read from the Welcome as `Transport` reads it."""
        if welcome is None:
            return cls(chunking.DEFAULT_CHUNK_BYTES, 1)
        return cls(welcome.chunk_bytes or chunking.DEFAULT_CHUNK_BYTES, max(1, len(welcome.shards)))

    def spans(self, num_elements: int) -> list[tuple[int, int]]:
        """(offset, length) of every chunk of a bucket of int8 elements, over every shard."""
        chunks = expected_chunks(num_elements, pb.DTYPE_INT8, self.shard_count, self.chunk_bytes)
        return sorted(chunks.items())


@dataclass(frozen=True)
class Int8Wire:
    """A float32 bucket on the int8 wire: its values and the scale of each chunk.

    Attributes:
        values: int8, 1-D, one per element of the bucket.
        scales: {chunk offset (= element index): scale}, on the transport's grid.
        int8_answer: ask for the answer as int8 too (DiLoCo's compact answer: the
            change of the global parameters, dequantized into the bucket's buffer).
        encoded: the sparse 2-bit wire's payload of each chunk, by offset (then
            `values` and `scales` are what they decode to: q and each chunk's step);
            None = the int8 values travel as they are.
    """

    values: torch.Tensor
    scales: dict[int, float]
    int8_answer: bool = False
    encoded: dict[int, bytes] | None = None

    def dequantized(self) -> torch.Tensor:
        """The float32 values the coordinator sums for this bucket."""
        return torch.from_numpy(int8_wire.dequantize_bucket(self.values.numpy(), self.scales))


class WireHook(Protocol):
    """What the reducer runs for a bucket: a `CommHook`, or one that may return an `Int8Wire`.

    Every `gradsync.hooks.CommHook` is one; only DiLoCo's int8 hook returns an
    `Int8Wire`, which the reducer uploads with its scales and has answered in
    float32 in place (so `after_average` is not called for it).
    """

    def before_upload(self, state: Any, bucket: GradBucket) -> torch.Tensor | Int8Wire: ...

    def after_average(self, state: Any, bucket: GradBucket, averaged: torch.Tensor) -> None: ...


class Int8Quantization:
    """The comm hook of DiLoCo's int8 wire (see the module docstring).

    Args:
        grid: returns the current chunk grid (the Welcome's; read at every bucket,
            so a reconnect to a coordinator cut otherwise is followed).
        error_feedback: keep each bucket's quantization error for its next upload.
        int8_answer: every upload but the seed asks for an int8 answer (`Int8Wire`).

    Attributes:
        seeding: the seed round (the global parameters themselves) travels in
            float32, exactly; set by `DiLoCo` before every round.
        residuals: per bucket index, the error the last upload left (None: no feedback).
    """

    def __init__(
        self, grid: Callable[[], ChunkGrid], error_feedback: bool, int8_answer: bool = False
    ) -> None:
        self.grid = grid
        self.int8_answer = int8_answer
        self.seeding = True
        self.residuals: dict[int, torch.Tensor] | None = {} if error_feedback else None

    def before_upload(self, state: Any, bucket: GradBucket) -> torch.Tensor | Int8Wire:
        if self.seeding or bucket.buffer.dtype != torch.float32:
            return bucket.buffer
        upload = bucket.buffer
        residual = None if self.residuals is None else self.residuals.get(bucket.index)
        if residual is not None:
            upload = upload + residual
        wire = self._encode(upload)
        if self.residuals is not None:
            self.residuals[bucket.index] = upload - wire.dequantized()
        return wire

    def _encode(self, upload: torch.Tensor) -> Int8Wire:
        """`upload` on the wire: int8 values and a scale per chunk of the grid."""
        values, scales = int8_wire.quantize(upload.numpy(), self.grid().spans(upload.numel()))
        return Int8Wire(torch.from_numpy(values), scales, self.int8_answer)

    def after_average(self, state: Any, bucket: GradBucket, averaged: torch.Tensor) -> None:
        # Only a float32 upload (the seed) gets here: an int8 one is answered in place.
        bucket.buffer.copy_(averaged)

    def __repr__(self) -> str:
        feedback = self.residuals is not None
        return f"{type(self).__name__}(error_feedback={feedback}, int8_answer={self.int8_answer})"


def check_int8_wire(bucket: GradBucket, wire: Int8Wire, rank: int) -> Int8Wire:
    """Check what the int8 hook returned for `bucket`.

    Raises:
        ValueError: not a float32 bucket, values that are not one int8 per element,
            or no scales for a non-empty bucket, naming rank, step and bucket.
    """
    where = f"rank {rank}, step {bucket.step}, bucket {bucket.index}"
    if bucket.buffer.dtype != torch.float32:
        raise ValueError(
            f"[{where}] the int8 wire is for float32 buckets, not {bucket.buffer.dtype}"
        )
    values = wire.values
    if values.dtype != torch.int8 or values.numel() != bucket.buffer.numel():
        raise ValueError(
            f"[{where}] the int8 wire holds {values.numel()} {values.dtype} values, "
            f"the bucket {bucket.buffer.numel()} float32"
        )
    if values.numel() and not wire.scales:
        raise ValueError(f"[{where}] the int8 wire has no scales")
    return Int8Wire(values.reshape(-1).contiguous(), wire.scales, wire.int8_answer, wire.encoded)


class Int8Answer:
    """One bucket's int8 answer: its values and (filled in on arrival) each chunk's scale.

    With `DiLoCo(answer_dtype=torch.int8)` the coordinator answers every chunk of
    an outer round not with the new global parameters in float32 but with their
    change, quantized to int8 with the chunk's own float32 scale
    (`gradsync_server.dataplane.outer_answer`): a quarter of the bytes down. The
    answer to an upload chunk is one chunk at the same offset of the same grid,
    its scale in the header, so `buffer` collects each chunk's scale as it
    arrives (`gradsync.path.step_results` checks them). Once the whole step is
    in, `dequantize_into` writes q * scale in float32 (one rounding, the
    coordinator's very `dequantize`) into the bucket's float32 buffer, which the
    reducer leaves in `.grad` like any answer; the fragment
    (`gradsync.diloco_fragment`) adds that change to the global parameters it
    holds with one float32 add, as the coordinator adds it to its public copy:
    both ends round the same two operations the same way.

    Args:
        num_elements: the bucket's elements (one int8 each).
    """

    def __init__(self, num_elements: int) -> None:
        self.values = np.zeros(num_elements, dtype=np.int8)
        #: Where the answer's chunks are written; its `scales` fill in as they arrive.
        self.buffer = BucketBuffer([self.values.view(np.uint8)])

    def dequantize_into(self, flat: torch.Tensor) -> None:
        """Write the answer's float32 values (q * scale, chunk by chunk) into `flat`.

        Raises:
            ValueError: `flat` is not a float32 tensor of the bucket's size, or a
                chunk's scale is missing (the step is not complete).
        """
        if flat.dtype != torch.float32 or flat.numel() != self.values.size:
            raise ValueError(
                f"an int8 answer of {self.values.size} elements cannot land in a "
                f"{flat.dtype} tensor of {flat.numel()}"
            )
        scales = self.buffer.scales
        if self.values.size and 0 not in scales:
            raise ValueError("the int8 answer has no scale for its first chunk")
        flat.copy_(torch.from_numpy(int8_wire.dequantize_bucket(self.values, scales)))
