"""The outer optimizer of low-communication training (DiLoCo), held by the data plane (pure).

In DiLoCo every rank takes H local steps, then sends its pseudo-gradient
(global parameters minus its local ones); their average is the gradient of
one outer optimizer step on the global parameters. A ring would have every
rank run that step on its own copy; here the coordinator runs it once, on
the global parameters it holds (`pb.OuterOptimizer`: torch.optim.SGD
semantics with momentum and Nesterov), and answers every chunk with the new
global parameters. So the global model and the optimizer's momentum live in
one place, in float32 whatever the wire carried, each shard holding the byte
range of every bucket it aggregates.

The first step that completes seeds the global parameters: the ranks send
their parameters (identical after rank 0's broadcast), and their average is
stored and sent back. Every later step is an outer step. A step's results
are kept aside until the whole step completes here (`commit`): an aborted
step (`discard`) leaves the global parameters and the momentum as they were,
as it leaves the ranks' models.

With a compact answer (`OuterOptimizer.answer_dtype` int8 or bfloat16) the
answer is instead the quantized change of the ranks' copy of the global
parameters, kept here as the public copy (`outer_answer.PublicCopy`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
from gradsync_proto import chunking, dtypes
from gradsync_proto.codec import ChunkHeader
from gradsync_proto.v1 import gradsync_pb2 as pb

from gradsync_server.dataplane.outer_answer import PublicCopy, answer_dtype_of

__all__ = ["OuterState"]

Floats = npt.NDArray[np.float32]


@dataclass
class _Pending:
    """One chunk's new global parameters and momentum, applied when the step completes."""

    bucket: int
    start: int
    parameters: Floats
    momentum: Floats | None


class OuterState:
    """Global parameters and outer momentum of this plane's range of every outer bucket.

    Without an outer optimizer (plain averaging) it holds nothing and changes nothing.

    Args:
        outer: the job's outer optimizer; None = none.
        buckets: the job's bucket layout (`BucketSpec.outer` marks what it holds).
        shard_count: how many ranges every bucket is cut into.
        shard_index: the range this plane aggregates.
    """

    def __init__(
        self,
        outer: pb.OuterOptimizer | None = None,
        buckets: Sequence[pb.BucketSpec] = (),
        shard_count: int = 1,
        shard_index: int = 0,
    ) -> None:
        self.active = outer is not None
        outer = outer or pb.OuterOptimizer()
        self.lr = np.float32(outer.lr)
        self.momentum = np.float32(outer.momentum)
        self.nesterov = outer.nesterov
        #: Element range [lo, hi) of each outer bucket that this plane holds.
        self._ranges = {
            index: chunking.shard_ranges(bucket.num_elements, shard_count)[shard_index]
            for index, bucket in enumerate(buckets)
            if bucket.outer and self.active
        }
        self._parameters: dict[int, Floats] = {}
        self._momenta: dict[int, Floats] = {}
        self._pending: list[_Pending] = []
        #: The global parameters as the ranks hold them, for a compact answer (else empty).
        self.public = PublicCopy(answer_dtype_of(outer) if self.active else pb.DTYPE_FLOAT32)
        #: Outer steps applied (the seed not counted).
        self.rounds = 0

    @property
    def seeded(self) -> bool:
        """True once a step has completed: the global parameters are known."""
        return bool(self._parameters) or not self._ranges

    def holds(self, bucket: int) -> bool:
        """True if `bucket` holds parameters (its answers are the global parameters)."""
        return bucket in self._ranges

    def held_bytes(self) -> int:
        """Bytes of global parameters and momentum held (for status and the budget)."""
        arrays = [*self._parameters.values(), *self._momenta.values()]
        return sum(array.nbytes for array in arrays) + self.public.held_bytes()

    def check_reply(self, rank: int, chunk: ChunkHeader, wire_dtype: int) -> int:
        """The dtype a chunk of an outer bucket asks its answer in, if it is the job's.

        Raises:
            RejectedMessage: float32 is not asked at the seed, or the job's answer
                dtype after it (`PublicCopy.check_reply`).
        """
        return self.public.check_reply(rank, chunk, wire_dtype, self.seeded)

    def answer_scale(self, bucket: int, offset: int) -> float:
        """The scale of the open step's int8 answer to a chunk (0.0 for any other answer)."""
        return self.public.scale_at(bucket, offset)

    def answer(self, bucket: int, offset: int, wire_dtype: int, average: memoryview) -> memoryview:
        """The answer to a completed chunk of an outer bucket: the new global parameters
        (float32), or with a compact answer their change of the public copy (its int8
        scale then in `answer_scale`).

        Args:
            bucket: the bucket.
            offset: the chunk's offset in the bucket, in bytes of `wire_dtype`.
            wire_dtype: the dtype the ranks uploaded it in.
            average: the chunk's average in float32 (the parameters at the seed,
                else the averaged pseudo-gradient).
        """
        lo, _ = self._ranges[bucket]
        start = offset // dtypes.itemsize(wire_dtype) - lo
        values = np.frombuffer(average, dtype="<f4")
        if not self.seeded:
            self._pending.append(_Pending(bucket, start, values.copy(), None))
            return average
        stop = start + len(values)
        parameters = self._parameters[bucket][start:stop]
        momentum = self._momenta[bucket][start:stop]
        # As torch.optim.SGD(momentum=mu, nesterov=...): buf = mu * buf + grad; the
        # step is grad + mu * buf with Nesterov, else buf; p = p - lr * step.
        new_momentum = momentum * self.momentum + values if self.momentum else values.copy()
        step = values + self.momentum * new_momentum if self.nesterov else new_momentum
        new_parameters = parameters - self.lr * step
        self._pending.append(_Pending(bucket, start, new_parameters, new_momentum))
        exact = new_parameters.astype(np.float32, copy=False)
        return self.public.answer(bucket, start, offset, exact)

    def current(self, bucket: int, offset: int, wire_dtype: int, count: int) -> memoryview:
        """The committed global parameters of `count` elements of a chunk, as float32 bytes
        (the answer to a late contribution, `gradsync_server.dataplane.late`)."""
        start = offset // dtypes.itemsize(wire_dtype) - self._ranges[bucket][0]
        values = self._parameters[bucket][start : start + count]
        return values.astype("<f4", copy=False).data.cast("B")

    def commit(self) -> None:
        """The step completed: its results become the global parameters and momentum."""
        if not self.active:
            return
        if not self.seeded:
            for index, (lo, hi) in self._ranges.items():
                self._parameters[index] = np.zeros(hi - lo, dtype=np.float32)
                self._momenta[index] = np.zeros(hi - lo, dtype=np.float32)
            seeding = True
        else:
            seeding = False
        for pending in self._pending:
            stop = pending.start + len(pending.parameters)
            self._parameters[pending.bucket][pending.start : stop] = pending.parameters
            if pending.momentum is not None:
                self._momenta[pending.bucket][pending.start : stop] = pending.momentum
        self._pending.clear()
        self.public.commit(self._parameters, seeding)
        if not seeding:
            self.rounds += 1

    def discard(self) -> None:
        """The step was aborted: nothing of it is applied."""
        self._pending.clear()
        self.public.discard()
