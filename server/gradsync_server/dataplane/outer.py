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

The state survives a coordinator restart (`snapshot`, `restore`; the record
format is `gradsync_server.dataplane.outer_snapshot`). A restored plane holds
the parameters that answered its last committed step, and *replays* that
step: the job resumes at it, every rank uploads again (what it uploads is
not used) and every chunk is answered with the stored parameters, with no
outer step applied. So a rank that missed that step's answer gets it, a
rank that had it gets the same bytes again, and no round is applied twice.

With a compact answer (`OuterOptimizer.answer_dtype` int8 or bfloat16) the
answer is instead the quantized change of the ranks' copy of the global
parameters, kept here as the public copy (`outer_answer.PublicCopy`).

A compact answer's job is not saved (its public copy would have to be, and a
replay answered in float32): a restart reseeds it, momentum from zero.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt
from gradsync_proto import chunking, dtypes
from gradsync_proto.codec import ChunkHeader
from gradsync_proto.v1 import gradsync_pb2 as pb

from gradsync_server.dataplane.actions import PersistOuter
from gradsync_server.dataplane.outer_answer import Pending, PublicCopy, answer_dtype_of
from gradsync_server.dataplane.outer_snapshot import OuterSnapshot, layout_signature

__all__ = ["OuterState"]

Floats = npt.NDArray[np.float32]


def _nonfinite(values: Floats) -> int:
    """How many elements of `values` are NaN or Inf."""
    return int(values.size - np.count_nonzero(np.isfinite(values)))


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
        self._pending: list[Pending] = []
        #: The global parameters as the ranks hold them, for a compact answer (else empty).
        self.public = PublicCopy(answer_dtype_of(outer), outer.answer_density)
        #: Outer steps applied (the seed not counted).
        self.rounds = 0
        #: What a stored record must match to be restored here (`outer_snapshot`).
        self.signature = layout_signature(
            outer if self.active else None, buckets, shard_count, shard_index
        )
        #: Restored from a record: the open step repeats the last committed one.
        self.replaying = False
        #: Save the state after every step that changed it (a store is configured).
        self.persist = False
        #: The run its records belong to (`OuterSnapshot.run`), set by the control plane.
        self.run = ""
        #: NaN/Inf in what the latest `answer` set pending (the parameters and momentum
        #: it would commit), for the `--nonfinite` check before the step commits.
        self.last_nonfinite = 0
        self._shard_index = shard_index

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
        self.last_nonfinite = 0
        if self.replaying:  # the stored answer of the committed step, whatever was sent
            stored = self._parameters[bucket][start : start + len(values)]
            return stored.astype("<f4", copy=True).data.cast("B")
        if not self.seeded:
            self._pending.append(Pending(bucket, start, values.copy()))
            self.last_nonfinite = _nonfinite(values)
            return average
        stop = start + len(values)
        parameters = self._parameters[bucket][start:stop]
        momentum = self._momenta[bucket][start:stop]
        # As torch.optim.SGD(momentum=mu, nesterov=...): buf = mu * buf + grad; the
        # step is grad + mu * buf with Nesterov, else buf; p = p - lr * step.
        with np.errstate(over="ignore", invalid="ignore"):  # counted in `last_nonfinite`
            new_momentum = momentum * self.momentum + values if self.momentum else values.copy()
            step = values + self.momentum * new_momentum if self.nesterov else new_momentum
            new_parameters = parameters - self.lr * step
        self._pending.append(Pending(bucket, start, new_parameters, new_momentum))
        self.last_nonfinite = _nonfinite(new_parameters) + _nonfinite(new_momentum)
        exact = new_parameters.astype(np.float32, copy=False)
        return self.public.answer(bucket, start, offset, exact)

    def current(self, bucket: int, offset: int, wire_dtype: int, count: int) -> memoryview:
        """The committed global parameters of `count` elements of a chunk, as float32 bytes
        (the answer to a late contribution, `gradsync_server.dataplane.late`)."""
        start = offset // dtypes.itemsize(wire_dtype) - self._ranges[bucket][0]
        values = self._parameters[bucket][start : start + count]
        return values.astype("<f4", copy=False).data.cast("B")

    def commit(self) -> bool:
        """The step completed: its results become the global parameters and momentum.

        Returns True if the state changed (a seed or an outer step: worth saving),
        False for plain averaging and for a replayed step.
        """
        if not self.active:
            return False
        if self.replaying:
            self.replaying = False
            self._pending.clear()
            return False
        seeding = not self.seeded
        if seeding:
            for index, (lo, hi) in self._ranges.items():
                self._parameters[index] = np.zeros(hi - lo, dtype=np.float32)
                self._momenta[index] = np.zeros(hi - lo, dtype=np.float32)
        for pending in self._pending:
            pending.apply(self._parameters, self._momenta)
        self._pending.clear()
        self.public.commit(self._parameters, seeding)
        if not seeding:
            self.rounds += 1
        return True

    def close_step(self, job_id: str, step: int) -> list[PersistOuter]:
        """`step` completed: `commit`, and the save it calls for (if `persist`), to be
        carried out before the step's last answers go out."""
        if not self.commit() or not self.persist or self.public.active:
            return []  # (a compact answer's public copy is not saved: a restart reseeds)
        return [PersistOuter(self.snapshot(job_id, step), self._shard_index)]

    def discard(self) -> None:
        """The step was aborted: nothing of it is applied (a replay stays due)."""
        self._pending.clear()
        self.public.discard()

    def snapshot(self, job_id: str, step: int) -> OuterSnapshot:
        """The committed state, as the answer of `step` (call right after `commit`).

        The arrays are not copied: they change only at the next commit, which needs
        every rank's upload of the next step, which needs this step's answers, which
        are released only once the record is saved (`Delivery`).
        """
        return OuterSnapshot(
            job_id,
            self.signature,
            step,
            self.rounds,
            dict(self._parameters),
            dict(self._momenta),
            self.run,
        )

    def restore(self, snapshot: OuterSnapshot, replay: bool = True) -> None:
        """Hold `snapshot`'s state; replay its step (the job resumes at `snapshot.step`),
        or with `replay` False run the next one as usual (another shard saved that one).

        Raises:
            ValueError: the record's layout is not this plane's (the caller checks the
                signature first; this is the last line against a record that lies).
        """
        if snapshot.signature != self.signature or not self.active:
            raise ValueError("the outer-state record does not match this plane's layout")
        for index, (lo, hi) in self._ranges.items():
            for arrays in (snapshot.parameters, snapshot.momenta):
                if index not in arrays or len(arrays[index]) != hi - lo:
                    raise ValueError(f"the outer-state record lacks bucket {index}'s range")
        self._parameters = {i: snapshot.parameters[i] for i in self._ranges}
        self._momenta = {i: snapshot.momenta[i] for i in self._ranges}
        self._pending.clear()
        self.rounds = snapshot.rounds
        self.run = snapshot.run
        self.replaying = replay
