"""The seams between the model wrapper and the network: a gradient path and a session link.

`DistributedDataParallel` and its `Session` drive a step through these
protocols only, never through gRPC, so the step logic (which bucket is handed
off when, where averages land, which error surfaces from `backward()`) can be
unit-tested with a pure-Python fake.

Two concerns, two protocols, because they compose differently:

- `GradientPath` (`gradsync.path.gradient_path`: submit a bucket, wait for a
  step, give a step up) is what the reducer and the step path use; direct,
  sharded or through a local group.
- `SessionLink` (join, state, checkpoints, heal, collectives, heartbeats,
  close) is what the session, collectives and join() use. A local group does
  not change it: every rank keeps its own Sync stream for these.

`CoordinatorLink` is both on one stream: what a `LinkFactory` builds (the
production one is `Transport`, gRPC on its own event loop).

The contract every implementation keeps (the wrapper relies on it):

- `submit_bucket`, `send_*` and `abandon_step` never block on the network and
  never raise for network trouble; autograd hooks call `submit_bucket`.
- Failures are recorded and raised at the next bounded wait (`wait_*`,
  `receive_*`) as `GradSyncError`s naming the rank (and step, bucket).
- `wait_step` returns only once every submitted bucket's averages were written
  back into the very `BucketBuffer` that was submitted.
- A lost coordinator, or a lost shard of it (`ShardUnavailableError`, naming the
  shard), is a `CoordinatorUnavailableError`: the wrapper replaces the link.
- Heartbeats start as soon as the stream is open (a rank waiting for its peers
  is alive), and `wait_welcome` reports what it waits for while it waits.
- Collectives (`run_collective`) are numbered by the link: every rank of a job
  issues them in the same order, so the n-th collective of every rank is the
  same one. `set_collective_sequence` moves the numbering when a join() ends.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import numpy as np
import numpy.typing as npt
from gradsync_proto.v1 import gradsync_pb2 as pb

from gradsync.path.gradient_path import BucketEventHandler, GradientPath


class SessionLink(Protocol):
    """A rank's membership of its job: join, state, checkpoints, heal, collectives, heartbeats."""

    #: The step heartbeats report (the wrapper keeps it current).
    current_step: int

    @property
    def collective_sequence(self) -> int:
        """The sequence number the next collective gets (read-only here)."""
        ...

    def open(self, join: pb.Join) -> None:
        """Open the stream and send `join`; returns without waiting for the job."""

    def wait_welcome(self, timeout_s: float, unreachable_s: float | None = None) -> pb.Welcome:
        """Block (bounded) until the job is assembled; return the Welcome."""
        ...

    def send_state(self, blob: npt.NDArray[np.uint8]) -> None:
        """Queue rank 0's parameters and buffers for broadcast. Never blocks."""

    def receive_state(self, num_bytes: int, timeout_s: float) -> bytearray:
        """Block (bounded) until rank 0's whole state blob arrived; return it."""
        ...

    def receive_resume(self, num_bytes: int, timeout_s: float) -> bytes | bytearray:
        """Block (bounded) until the checkpoint the job resumes from arrived; return it."""
        ...

    def send_checkpoint(self, step: int, blob: bytes) -> None:
        """Queue a checkpoint upload (rank 0). Never blocks."""

    def wait_checkpoint(self, step: int, timeout_s: float) -> pb.CheckpointSaved:
        """Block (bounded) until the coordinator answered the checkpoint of `step`."""
        ...

    def take_heal_request(self) -> bool:
        """True, once, when a rejoining rank asked for this rank's state."""
        ...

    def heal_relay_requested(self) -> bool:
        """Whether the latest request asked for the state itself through the coordinator
        (a rejoining rank could not read a direct offer of it)."""
        ...

    def wait_heal_answer(self, step: int, timeout_s: float) -> bool:
        """After `send_heal(step, ...)`: block until the coordinator admitted the ranks it
        heals (a MembershipChanged past the epoch the state went out in), asked for the
        state again, or aborted `step`. False when none of these came within `timeout_s`;
        True at once if no state was sent.

        A donor uploads nothing of the step until then
        (`gradsync.control.session.await_heal_answer`).
        """
        ...

    def step_report(self) -> pb.StepReport | None:
        """The coordinator's latest StepReport (who was slowest), or None.

        Only the lowest participating rank receives them, for its step log, and only
        when one says something new or every 16 steps (the coordinator's `ReportSchedule`).
        """
        ...

    def send_heal(self, step: int, blob: bytes | bytearray) -> None:
        """Queue this rank's state for a rejoining rank. Never blocks."""

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
        """Run the job's next collective on raw bytes; block (bounded) for its result.

        Assigns the next sequence number, sends `payload` in chunks of the
        Welcome's chunk size (an empty payload as one empty chunk) and waits for
        the coordinator's result, checked against what was asked.

        Args:
            op: a `CollectiveOp` value.
            dtype: the `DType` of the payload's elements (reductions work on them).
            payload: this rank's input as a 1-D uint8 array; empty for BARRIER and
                for a BROADCAST on any rank but the root. Must not change until
                this returns.
            root: BROADCAST only: the rank whose bytes everyone receives.
            timeout_s: bound on the wait for the result.
            result_bytes: the exact result size when the op does not imply it
                (BROADCAST on a non-root rank, and every op whose result differs
                by rank: REDUCE_SCATTER, GATHER, SCATTER, ALL_TO_ALL); otherwise
                derived from the input.
            template: further fields every chunk of the input carries
                (`reduce_op`, `send_splits`, `receive_splits`), or None.

        Returns:
            (the result's bytes, how many ranks contributed).

        Raises:
            ValueError: an unknown op, or a payload that is not a 1-D uint8 array.
            CollectiveError: the result was malformed or not what was asked (names
                the sequence number), or the job has not assembled.
            SyncTimeoutError: no complete result within `timeout_s`.
            GradSyncError: the stream failed (e.g. the coordinator refused the
                input as mismatched across ranks: INVALID_ARGUMENT).
        """
        ...

    def live_ranks(self) -> tuple[int, ...] | None:
        """The job's live ranks as the coordinator last announced them (MembershipChanged).

        None until a membership change arrived (every rank of the Welcome is live).
        A local leader reads it to learn that a lost follower was dropped (elastic).
        """
        ...

    def set_collective_sequence(self, sequence: int) -> None:
        """Number the next collective `sequence` (JoinProgress.next_collective)."""

    def send_out_of_inputs(self, step: int) -> None:
        """Tell the coordinator this rank ran out of inputs; `step` is the first it
        will not run (join()). Never blocks."""

    def send_local_posted(self, step: int, bucket_index: int) -> None:
        """Tell the coordinator this rank posted a bucket into its local group (only
        the leader uploads; this lets the coordinator name a late member). Never blocks."""

    def wait_join_progress(self, timeout_s: float) -> pb.JoinProgress:
        """Block (bounded) until the next JoinProgress not yet returned; return it.

        JoinProgress messages are kept in arrival order until taken, so one
        that arrived before the call is returned at once.
        """
        ...

    def close(self, timeout_s: float = ...) -> None:
        """Leave the job and release the connection. Idempotent."""


class CoordinatorLink(SessionLink, GradientPath, Protocol):
    """One worker's stream to the coordinator: its session link and its direct gradient path."""

    #: Observer of bucket uploads and averages (metrics, trace), or None.
    on_bucket_event: BucketEventHandler | None

    def configure_buckets(self, bucket_bytes: list[int]) -> None:
        """Tell the link the size of each bucket (to know when a step is complete)."""


class IssuesCollectives:
    """`run_collective` as `issue_collective` then `wait_collective` (its two halves,
    which `Transport` and `ResumingLink` implement)."""

    issue_collective: Callable[..., int]
    wait_collective: Callable[[int, float], tuple[bytearray, int]]

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
        sequence = self.issue_collective(
            op, dtype, payload, root, result_bytes=result_bytes, template=template
        )
        return self.wait_collective(sequence, timeout_s)


#: Builds a link from ("host:port" of the coordinator, this worker's rank).
#: The wrapper calls it once at construction and again for every reconnect.
LinkFactory = Callable[[str, int], CoordinatorLink]
