"""The seam between the model wrapper and the network: what a link to the coordinator offers.

`DistributedDataParallel` and its `Session` drive a step through this
protocol only, never through gRPC, so the step logic (which bucket is handed
off when, where averages land, which error surfaces from `backward()`) can be
unit-tested with a pure-Python fake, and a different transport (shared memory
for hierarchical aggregation, sharded coordinators) can be plugged in later.
`gradsync.transport.Transport`, gRPC on its own event loop, is the one used in
production and the default.

The contract every implementation keeps (the wrapper relies on it):

- `submit_bucket`, `send_*` and `abandon_step` never block on the network and
  never raise for network trouble; autograd hooks call `submit_bucket`.
- Failures are recorded and raised at the next bounded wait (`wait_*`,
  `receive_*`) as `GradSyncError`s naming the rank (and step, bucket).
- `wait_step` returns only once every submitted bucket's averages were written
  back into the very `BucketBuffer` that was submitted.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import numpy as np
import numpy.typing as npt

from gradsync.buffers import BucketBuffer
from gradsync.v1 import gradsync_pb2 as pb

#: Called as (event, step, bucket_index) for "upload_start", "upload_end" and
#: "averaged"; must be quick and must not raise (it runs on the I/O thread).
BucketEventHandler = Callable[[str, int, int], None]


class CoordinatorLink(Protocol):
    """One worker's connection to the coordinator, as the model wrapper uses it."""

    #: The step heartbeats report (the wrapper keeps it current).
    current_step: int
    #: Observer of bucket uploads and averages (metrics, trace), or None.
    on_bucket_event: BucketEventHandler | None

    def configure_buckets(self, bucket_bytes: list[int]) -> None:
        """Tell the link the size of each bucket (to know when a step is complete)."""

    def open(self, join: pb.Join) -> None:
        """Open the stream and send `join`; returns without waiting for the job."""

    def wait_welcome(self, timeout_s: float) -> pb.Welcome:
        """Block (bounded) until the job is assembled; return the Welcome."""
        ...

    def send_state(self, blob: npt.NDArray[np.uint8]) -> None:
        """Queue rank 0's parameters and buffers for broadcast. Never blocks."""

    def receive_state(self, num_bytes: int, timeout_s: float) -> bytearray:
        """Block (bounded) until rank 0's whole state blob arrived; return it."""
        ...

    def receive_resume(self, num_bytes: int, timeout_s: float) -> bytes:
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

    def send_heal(self, step: int, blob: bytes) -> None:
        """Queue this rank's state for a rejoining rank. Never blocks."""

    def abandon_step(self, step: int, reason: str) -> None:
        """Tell the coordinator this rank gives up on `step`. Never blocks."""

    def submit_bucket(self, step: int, bucket_index: int, buffer: BucketBuffer, dtype: int) -> None:
        """Queue a bucket for upload; its averages are written back into `buffer`."""

    def wait_step(self, step: int, timeout_s: float) -> int:
        """Block (bounded) until every averaged bucket of `step` is in place.

        Returns:
            The number of ranks averaged over.
        """
        ...

    def close(self, timeout_s: float = ...) -> None:
        """Leave the job and release the connection. Idempotent."""


#: Builds a link from ("host:port" of the coordinator, this worker's rank).
#: The wrapper calls it once at construction and again for every reconnect.
LinkFactory = Callable[[str, int], CoordinatorLink]
