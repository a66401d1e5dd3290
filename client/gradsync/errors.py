"""The exceptions gradsync raises, and the one place that maps status codes to them.

Hierarchy::

    GradSyncError                  base: carries rank, step, bucket_index, code
    ├── CoordinatorUnavailableError  cannot reach / lost the coordinator (reconnects)
    │   └── ShardUnavailableError    ...or one of its shards (names the shard and address)
    ├── SyncTimeoutError             a bounded wait ran out
    ├── JoinRefusedError             the coordinator refused this worker's join
    │   └── AuthenticationError      ...because the token was missing or wrong
    ├── TransportSecurityError       the TLS handshake failed (CA, certificate, mTLS)
    ├── DeclaredDeadError            the coordinator dropped this rank (no heartbeat)
    ├── ResourceExhaustedError       this worker exceeded a coordinator limit
    ├── StepAbortedError             a step was abandoned (nothing was averaged)
    │   ├── MessageRejectedError     ...because this worker sent a bad message
    │   ├── PeerLostError            ...because another rank left or died
    │   ├── NonFiniteGradientError   ...because a rank sent NaN/Inf (`--nonfinite abort`)
    │   └── CoordinatorRestartedError ...because the coordinator restarted (resumed)
    ├── CheckpointFailedError        a checkpoint could not be made durable
    ├── CheckpointMismatchError      the resume checkpoint is not this model's (or not one)
    ├── CollectiveError              a collective's result was invalid (names its sequence)
    ├── SharedMemoryError            a host's local group found too little shared memory
    └── ClosedError                  the object was used after close()

Errors raised inside the background transport are recorded with their context
and re-raised at the next synchronization point (end of backward), so autograd
hooks never raise.

Why a stream's end is classified by reason first and status code second:
several different situations end a stream with the same status code (a rank
declared dead, a required checkpoint that failed and a coordinator shutting
down are all UNAVAILABLE), but only the last one is worth reconnecting for.
The coordinator therefore sends a `StreamEnd` with an `EndReason` just before
the status; `error_from_status` picks the class by that reason and falls back
to the status code when there is none (an older coordinator, or a connection
that broke without a goodbye). Only `CoordinatorUnavailableError` starts the
model wrapper's reconnect path, so nothing but transport trouble or a
coordinator going away may map to it.

Status codes come from `gradsync_proto.codes`, shared with the coordinator.
"""

from __future__ import annotations

from typing import Any

from gradsync_proto.codes import Code
from gradsync_proto.v1 import gradsync_pb2 as pb


class GradSyncError(RuntimeError):
    """Base class of every gradsync error.

    Attributes:
        rank: the rank that observed the error (None if unknown).
        step: the synchronized step concerned (None if not step-specific).
        bucket_index: the bucket concerned (None if not bucket-specific).
        code: the status code behind the error, when there is one.
    """

    def __init__(
        self,
        message: str,
        *,
        rank: int | None = None,
        step: int | None = None,
        bucket_index: int | None = None,
        code: Code | None = None,
    ) -> None:
        context = []
        if rank is not None:
            context.append(f"rank {rank}")
        if step is not None:
            context.append(f"step {step}")
        if bucket_index is not None and bucket_index >= 0:
            context.append(f"bucket {bucket_index}")
        prefix = f"[{', '.join(context)}] " if context else ""
        super().__init__(prefix + message)
        self.rank = rank
        self.step = step
        self.bucket_index = bucket_index
        self.code = code


class CoordinatorUnavailableError(GradSyncError):
    """The coordinator could not be reached, or the connection to it was lost."""


class ShardUnavailableError(CoordinatorUnavailableError):
    """A coordinator shard was lost: its data stream failed, or the leader said so.

    A `CoordinatorUnavailableError` because the remedy is the same: reconnect
    to the leader, rejoin, and resume from the last checkpoint once every shard
    is registered again (the leader refuses to start the job before).

    Attributes:
        shard_index: the lost shard's index, when this worker saw it fail itself
            (None when only the leader's message names it).
        shard_address: the "host:port" this worker reached the shard at (or None).
    """

    def __init__(
        self,
        message: str,
        *,
        shard_index: int | None = None,
        shard_address: str | None = None,
        **context: Any,
    ) -> None:
        super().__init__(message, **context)
        self.shard_index = shard_index
        self.shard_address = shard_address


class SyncTimeoutError(GradSyncError):
    """A bounded wait (join, broadcast, step results) ran out of time."""


class JoinRefusedError(GradSyncError):
    """The coordinator refused to admit this worker (rank taken, signature mismatch, ...)."""


class AuthenticationError(JoinRefusedError):
    """The coordinator (or a shard) refused the call: the token was missing or wrong.

    Not retried: the same token would be refused again. Check `token=`,
    $GRADSYNC_TOKEN or $GRADSYNC_TOKEN_FILE against the coordinator's.
    """


class TransportSecurityError(GradSyncError):
    """The TLS handshake with the coordinator failed (untrusted or expired certificate,
    a client certificate missing or refused under mTLS, TLS on one end only).

    Not a `CoordinatorUnavailableError`: reconnecting cannot fix a certificate.
    """


class DeclaredDeadError(GradSyncError):
    """The coordinator dropped this rank from the job: it sent no heartbeat in time.

    Not a `CoordinatorUnavailableError`: the coordinator is alive and has moved
    on without this rank, so reconnecting and resuming would be wrong. Under an
    elastic policy, restart the worker to rejoin.
    """


class ResourceExhaustedError(GradSyncError):
    """This worker exceeded a coordinator limit (queued averages, buffered bytes)."""


class StepAbortedError(GradSyncError):
    """A step was abandoned by the coordinator; no averaged gradients were applied."""


class MessageRejectedError(StepAbortedError):
    """This worker sent a message the coordinator rejected (the step was abandoned)."""


class PeerLostError(StepAbortedError):
    """Another rank left or disconnected, so the step cannot complete."""


class NonFiniteGradientError(StepAbortedError):
    """A rank sent NaN or Inf gradients and the coordinator runs with `--nonfinite abort`.

    Every rank of the job raises it for the same step (nothing was averaged).
    Skip `optimizer.step()` for that step (as `torch.cuda.amp.GradScaler` skips
    a step with Inf/NaN gradients) and train on; a rank that keeps sending
    NaN needs a lower learning rate, loss scaling, or its data checked.

    Attributes:
        culprit_rank: the rank whose gradients held NaN/Inf (`rank` is the rank
            that raised this error; they are equal on the culprit itself).
    """

    def __init__(self, message: str, *, culprit_rank: int | None = None, **context: Any) -> None:
        super().__init__(message, **context)
        self.culprit_rank = culprit_rank


class CheckpointFailedError(GradSyncError):
    """The coordinator could not make a checkpoint durable (store down, misconfigured)."""


class CheckpointMismatchError(GradSyncError):
    """The checkpoint a job resumes from cannot be loaded into this model.

    It is not a gradsync checkpoint at all, or it was saved by another model
    under the same job id (a missing or unexpected parameter, another shape).
    The coordinator refuses most such checkpoints itself by the model signature
    they carry; this is the worker's own check. Not retried: the same checkpoint
    would fail again. Use another job id, or start the coordinator with
    `--fresh-start`.

    Attributes:
        job_id: the job whose checkpoint it is.
    """

    def __init__(self, message: str, *, job_id: str, rank: int | None, step: int) -> None:
        super().__init__(message, rank=rank, step=step)
        self.job_id = job_id


class CoordinatorRestartedError(StepAbortedError):
    """The coordinator was lost and restarted; this rank reconnected and was restored.

    `step` is where training resumes (the restored checkpoint's step): skip
    `optimizer.step()` for the failed backward pass and continue at `model.step`.
    """


class SharedMemoryError(GradSyncError):
    """The shared memory a local group (hierarchical aggregation) needs is not there.

    The local leader reserves the whole segment when the group forms (so that a
    too small /dev/shm fails at once, not with SIGBUS in the middle of a step);
    every member of the group raises this, with the bytes needed, the directory,
    its free bytes and the fixes (`docker run --shm-size`, $GRADSYNC_SHM_DIR,
    `hierarchical=False`).
    """


class ClosedError(GradSyncError):
    """The object was used after `close()`."""


class CollectiveError(GradSyncError):
    """A collective on user tensors failed: its result was malformed or not what was asked.

    Attributes:
        sequence: the collective's job-wide sequence number (the n-th collective).
    """

    def __init__(
        self, message: str, *, rank: int | None = None, sequence: int, code: Code | None = None
    ) -> None:
        super().__init__(f"collective {sequence}: {message}", rank=rank, code=code)
        self.sequence = sequence


_TERMINAL_CODE_TO_ERROR: dict[Code, type[GradSyncError]] = {
    Code.ALREADY_EXISTS: JoinRefusedError,
    Code.INVALID_ARGUMENT: JoinRefusedError,
    Code.FAILED_PRECONDITION: JoinRefusedError,
    Code.PERMISSION_DENIED: JoinRefusedError,
    Code.UNAUTHENTICATED: AuthenticationError,
    Code.RESOURCE_EXHAUSTED: JoinRefusedError,
    Code.ABORTED: PeerLostError,
    Code.DEADLINE_EXCEEDED: SyncTimeoutError,
    Code.UNAVAILABLE: CoordinatorUnavailableError,
    Code.CANCELLED: CoordinatorUnavailableError,
}


#: Takes precedence over the status code: the reason says why, the code only how.
_END_REASON_TO_ERROR: dict[int, type[GradSyncError]] = {
    pb.END_REASON_DECLARED_DEAD: DeclaredDeadError,
    pb.END_REASON_CHECKPOINT_FAILED: CheckpointFailedError,
    pb.END_REASON_SHUTTING_DOWN: CoordinatorUnavailableError,
    pb.END_REASON_JOB_REFUSED: JoinRefusedError,
    pb.END_REASON_PEER_LOST: PeerLostError,
    pb.END_REASON_RESOURCE_EXHAUSTED: ResourceExhaustedError,
    pb.END_REASON_SHARD_LOST: ShardUnavailableError,
}


def error_from_status(
    code: int, details: str, *, reason: int | None = None, **context: Any
) -> GradSyncError:
    """Translate a stream-ending gRPC status into the matching GradSyncError.

    This is the single error boundary between the transport and user code.

    Args:
        code: the status code (a google.rpc.Code value).
        details: the status message.
        reason: the `EndReason` of the coordinator's `StreamEnd`, when one
            arrived; it decides the class. None or END_REASON_UNSPECIFIED (or
            a value this client does not know) falls back to the code.
        context: `rank`, `step`, `bucket_index`, named in the message.

    Returns:
        The exception to raise (the caller raises it `from` the gRPC error).
    """
    try:
        status = Code(code)
    except ValueError:
        status = Code.UNKNOWN
    cls = _END_REASON_TO_ERROR.get(reason or pb.END_REASON_UNSPECIFIED)
    if cls is None:
        cls = _TERMINAL_CODE_TO_ERROR.get(status, GradSyncError)
    return cls(f"{status.name}: {details}", code=status, **context)
