"""A coordinator in a box for unit tests of the model wrapper: no sockets, no threads.

`FakeLink` implements `gradsync.control.link.CoordinatorLink`: it records what the
wrapper submits and answers as a coordinator would (averages with a silent
peer, aborts, a lost stream, collectives with scripted peers, join progress).
"""

from __future__ import annotations

from collections.abc import Callable

import gradsync
import numpy as np
import numpy.typing as npt
import torch
from gradsync.control.link import CoordinatorLink
from gradsync.path.buffers import BucketBuffer
from gradsync.path.gradient_path import BucketEventHandler
from gradsync.path.signature import PRESENCE_NAME
from gradsync.path.step_results import RoundReport
from gradsync_proto.v1 import gradsync_pb2 as pb

#: Wire dtypes a FakeLink accepts, as torch dtypes.
WIRE_NUMPY = {
    pb.DTYPE_FLOAT32: torch.float32,
    pb.DTYPE_FLOAT16: torch.float16,
    pb.DTYPE_BFLOAT16: torch.bfloat16,
    pb.DTYPE_FLOAT64: torch.float64,
}


class FakeLink:
    """A coordinator in a box: records submissions, averages with a silent peer.

    The averages it writes back are `scale` times this rank's gradients (0.5:
    a second rank contributed zeros), so a test can tell an averaged `.grad`
    from a local one.
    """

    #: As over TCP: a resend needs the copy of the upload (averages may land over it).
    averages_land_early = True

    def __init__(self, target: str, rank: int, welcome: pb.Welcome | None = None) -> None:
        self.target = target
        self.rank = rank
        self.current_step = 0
        self.on_bucket_event: BucketEventHandler | None = None
        self.welcome = welcome if welcome is not None else pb.Welcome(start_step=0)
        self.bucket_bytes: list[int] = []
        self.joins: list[pb.Join] = []
        #: Where the presence vector travels, from the Join's signature: (bucket index,
        #: element offset in it); offset 0 = a bucket of its own.
        self.presence_at = (-1, 0)
        self.sent_state: list[bytes] = []
        self.state_for_us = b""
        self.resume_blob = b""
        #: (step, bucket_index, buffer) of every gradient bucket hand-off, in order
        #: (the presence bucket, always last in a step, is in `presence`; a last
        #: bucket the presence vector rides on is here, and its tail in `presence`).
        self.submitted: list[tuple[int, int, BucketBuffer]] = []
        #: Every hand-off, the presence bucket included, with its wire dtype.
        self.uploads: list[tuple[int, int, BucketBuffer, int]] = []
        #: By (step, bucket_index): where averages asked for in another dtype go.
        self.results: dict[tuple[int, int], tuple[BucketBuffer, int]] = {}
        #: This rank's presence vector of each step (1.0: it used the parameter).
        self.presence: list[list[float]] = []
        #: Presence of the other ranks: added to ours before averaging (1.0 = used there).
        self.peer_presence: list[float] | None = None
        self.checkpoints: list[int] = []
        self.checkpoint_durable = True
        self.heals: list[int] = []
        self.heal_requested = False
        #: What `step_report()` returns (a test sets it to play the coordinator).
        self.report: pb.StepReport | None = None
        self.abandoned: list[tuple[int, str]] = []
        self.waited_steps: list[int] = []
        #: Raised by the next wait_step instead of answering (a recorded failure).
        self.fail_with: gradsync.GradSyncError | None = None
        self.scale = 0.5
        #: Added to every averaged gradient element: what a peer's gradient contributed.
        self.peer_value = 0.0
        self.contributors = 2
        self.closed = False
        #: Called at every hand-off, while autograd is still running.
        self.on_submit: Callable[[int], None] | None = None
        #: (op, dtype, payload bytes, root) of every collective, in order.
        self.collectives: list[tuple[int, int, bytes, int]] = []
        #: What a BROADCAST from another rank delivers (None: this rank's own bytes).
        self.broadcast_result: bytes | None = None
        self.collective_sequence = 0
        self.out_of_inputs: list[int] = []
        self.local_posted: list[tuple[int, int]] = []
        #: JoinProgress messages wait_join_progress hands out, in order.
        self.join_progress: list[pb.JoinProgress] = []

    def configure_buckets(self, bucket_bytes: list[int]) -> None:
        self.bucket_bytes = list(bucket_bytes)

    def open(self, join: pb.Join) -> None:
        self.joins.append(join)
        names = [spec.name for spec in join.signature.parameters]
        if PRESENCE_NAME in names:
            index = names.index(PRESENCE_NAME)
            for bucket_index, bucket in enumerate(join.signature.buckets):
                if index in bucket.parameter_indices:
                    before = list(bucket.parameter_indices)[
                        : list(bucket.parameter_indices).index(index)
                    ]
                    offset = sum(int(np.prod(join.signature.parameters[i].shape)) for i in before)
                    self.presence_at = (bucket_index, offset)

    def _presence_offset(self, bucket_index: int, dtype: int) -> int | None:
        """The byte where the presence vector starts in `bucket_index` (None: not in it)."""
        presence_bucket, offset = self.presence_at
        if presence_bucket < 0:  # no Join seen: the presence bucket is the last one
            presence_bucket = len(self.bucket_bytes) - 1
        itemsize = torch.empty(0, dtype=WIRE_NUMPY[dtype]).element_size()
        return offset * itemsize if bucket_index == presence_bucket else None

    def wait_welcome(self, timeout_s: float, unreachable_s: float | None = None) -> pb.Welcome:
        return self.welcome

    def send_state(self, blob: npt.NDArray[np.uint8]) -> None:
        self.sent_state.append(blob.tobytes())

    def receive_state(self, num_bytes: int, timeout_s: float) -> bytearray:
        assert len(self.state_for_us) == num_bytes
        return bytearray(self.state_for_us)

    def receive_resume(self, num_bytes: int, timeout_s: float) -> bytes:
        assert len(self.resume_blob) == num_bytes
        return self.resume_blob

    def send_checkpoint(self, step: int, blob: bytes) -> None:
        self.checkpoints.append(step)

    def wait_checkpoint(self, step: int, timeout_s: float) -> pb.CheckpointSaved:
        message = "" if self.checkpoint_durable else "the store is read-only"
        return pb.CheckpointSaved(step=step, durable=self.checkpoint_durable, message=message)

    def heal_relay_requested(self) -> bool:
        return False

    def take_heal_request(self) -> bool:
        requested, self.heal_requested = self.heal_requested, False
        return requested

    def step_report(self) -> pb.StepReport | None:
        return self.report

    def send_heal(self, step: int, blob: bytes) -> None:
        self.heals.append(step)

    def wait_heal_answer(self, step: int, timeout_s: float) -> bool:
        return True  # the coordinator a fake stands for admits at once

    def abandon_step(self, step: int, reason: str) -> None:
        self.abandoned.append((step, reason))

    def submit_bucket(
        self,
        step: int,
        bucket_index: int,
        buffer: BucketBuffer,
        dtype: int,
        *,
        result: BucketBuffer | None = None,
        result_dtype: int = 0,
    ) -> None:
        assert dtype in WIRE_NUMPY, dtype
        self.uploads.append((step, bucket_index, buffer, dtype))
        if result is not None:
            assert result_dtype in WIRE_NUMPY, result_dtype
            self.results[(step, bucket_index)] = (result, result_dtype)
        offset = self._presence_offset(bucket_index, dtype)
        if offset is not None:
            tail = torch.from_numpy(np.concatenate(buffer.segments)[offset:])
            self.presence.append(tail.view(WIRE_NUMPY[dtype]).float().tolist())
            if offset == 0:
                return
        self.submitted.append((step, bucket_index, buffer))
        if self.on_submit is not None:
            self.on_submit(bucket_index)

    def round_report(self) -> RoundReport:
        """What the last step's answers said beyond the averages: nothing, here."""
        return RoundReport()

    def wait_step(self, step: int, timeout_s: float) -> int:
        self.waited_steps.append(step)
        if self.fail_with is not None:
            error, self.fail_with = self.fail_with, None
            raise error
        for submitted_step, bucket_index, buffer, dtype in self.uploads:
            if submitted_step != step:
                continue
            uploaded, sent_dtype = np.concatenate(buffer.segments), dtype
            offset = self._presence_offset(bucket_index, dtype)
            end = len(uploaded) if offset is None else offset
            answer = b""
            if end:
                wire = torch.from_numpy(uploaded[:end]).view(WIRE_NUMPY[dtype])
                averaged = wire.float() * self.scale + self.peer_value
                buffer, dtype = self.results.get((step, bucket_index), (buffer, dtype))
                answer = np.asarray(averaged.to(WIRE_NUMPY[dtype]).view(torch.uint8)).tobytes()
            if offset is not None:  # the presence vector, uploaded in the wire dtype
                local = torch.from_numpy(uploaded[offset:]).view(WIRE_NUMPY[sent_dtype]).float()
                peers = torch.tensor(self.peer_presence or [0.0] * local.numel())
                averaged = ((local + peers) / 2).to(WIRE_NUMPY[dtype])
                answer += np.asarray(averaged.view(torch.uint8)).tobytes()
            buffer.write(0, answer)
        return self.contributors

    def run_collective(
        self,
        op: int,
        dtype: int,
        payload: npt.NDArray[np.uint8],
        root: int,
        timeout_s: float,
        *,
        result_bytes: int | None = None,
        template: pb.CollectiveChunk | None = None,
    ) -> tuple[bytearray, int]:
        self.collectives.append((op, dtype, payload.tobytes(), root))
        self.collective_sequence += 1
        if op == pb.COLLECTIVE_OP_BROADCAST and root != self.rank:
            assert self.broadcast_result is not None, "no scripted broadcast result"
            assert result_bytes == len(self.broadcast_result)
            return bytearray(self.broadcast_result), self.contributors
        # A reduction with peers that sent what this rank sent (sum: scaled).
        return bytearray(payload.tobytes()), self.contributors

    def set_collective_sequence(self, sequence: int) -> None:
        self.collective_sequence = sequence

    def send_out_of_inputs(self, step: int) -> None:
        self.out_of_inputs.append(step)

    def send_local_posted(self, step: int, bucket_index: int) -> None:
        self.local_posted.append((step, bucket_index))

    def wait_join_progress(self, timeout_s: float) -> pb.JoinProgress:
        if not self.join_progress:
            raise gradsync.SyncTimeoutError("no join progress scripted", rank=self.rank)
        return self.join_progress.pop(0)

    def close(self, timeout_s: float = 10.0) -> None:
        self.closed = True


class LinkFactory:
    """Hands the wrapper FakeLinks; keeps every one it made (one per (re)connect)."""

    def __init__(self, *welcomes: pb.Welcome) -> None:
        self._welcomes = list(welcomes)
        self.links: list[FakeLink] = []
        self.prepare: Callable[[FakeLink], None] | None = None

    def __call__(self, target: str, rank: int) -> CoordinatorLink:
        welcome = self._welcomes.pop(0) if self._welcomes else None
        link = FakeLink(target, rank, welcome)
        if self.prepare is not None:
            self.prepare(link)
        self.links.append(link)
        return link

    @property
    def link(self) -> FakeLink:
        return self.links[-1]
