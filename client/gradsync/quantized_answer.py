"""DiLoCo's int8 answer on the worker: where it lands, and what the rank adds for it.

With `gradsync.DiLoCo(wire_dtype=torch.int8, answer_dtype=torch.int8)` the
coordinator answers every chunk of an outer round not with the new global
parameters in float32 but with their change, quantized to int8 with the
chunk's own float32 scale (`gradsync_server.dataplane.outer_answer`): a
quarter of the bytes down. The answer to an upload chunk is one chunk at the
same offset of the same grid, its scale in the header, so each bucket's
answer lands in an `Int8Answer`: an int8 array the size of the bucket, whose
`BucketBuffer` collects the scale of each chunk as it arrives
(`gradsync.path.step_results`, which checks them). Once the whole step is in,
`dequantize_into` writes q * scale in float32 (one rounding, the int8 wire's
own `dequantize`, the coordinator's very function) into the bucket's float32
buffer, which the reducer then leaves in `.grad` like any answer. The
fragment (`gradsync.diloco_fragment`) adds that change to the global
parameters it holds with one float32 add, as the coordinator adds it to its
public copy: both ends round the same two operations the same way.
"""

from __future__ import annotations

import numpy as np
import torch
from gradsync_proto import int8_wire

from gradsync.path.buffers import BucketBuffer

__all__ = ["Int8Answer"]


class Int8Answer:
    """One bucket's int8 answer: its values and (filled in on arrival) each chunk's scale.

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
