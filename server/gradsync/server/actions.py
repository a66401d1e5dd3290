"""What the job state machine asks the servicer to do, and who the members are.

`Job` methods return lists of actions instead of touching sockets, so the
protocol logic stays testable without gRPC: `Send` a message to ranks,
`Terminate` their streams with a status, or `Persist` a checkpoint.
"""

from __future__ import annotations

from dataclasses import dataclass

from gradsync.protocol.codes import Code
from gradsync.v1 import gradsync_pb2 as pb


@dataclass(frozen=True)
class Send:
    """Deliver `message` (a CoordinatorMessage, or its serialized bytes) to each of `ranks`."""

    ranks: tuple[int, ...]
    message: pb.CoordinatorMessage | bytes


@dataclass(frozen=True)
class Terminate:
    """End the streams of `ranks` with status `code` and `details`."""

    ranks: tuple[int, ...]
    code: Code
    details: str


@dataclass
class Member:
    rank: int
    incarnation: str
    signature: pb.ModelSignature
    joined_at: float
    peer: str = ""
    last_seen: float = 0.0
    reported_step: int = 0


@dataclass(frozen=True)
class Persist:
    """Store `blob` as the checkpoint of `step`, then acknowledge to rank 0."""

    step: int
    blob: bytes


Action = Send | Terminate | Persist
