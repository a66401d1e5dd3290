"""The StepAborted messages that tell ranks a step is abandoned, and why.

Every abort (a rejected chunk at the leader or at a shard, an abandoned step,
a NaN/Inf contribution under `--nonfinite abort`) is worded here, so that the
leader's own aborts and those it makes for its shards (`Job.reject_from_shard`) say the
same thing with the same reasons. Pure logic, no gRPC, no asyncio.
"""

from __future__ import annotations

from gradsync_proto.codes import Code
from gradsync_proto.v1 import gradsync_pb2 as pb

from gradsync_server.dataplane.actions import Action, Send
from gradsync_server.dataplane.nonfinite import NonFiniteRejection
from gradsync_server.errors import RejectedMessage

__all__ = ["abort_actions", "abort_message"]


def abort_message(
    ranks: tuple[int, ...],
    step: int,
    code: Code,
    details: str,
    bucket_index: int,
    reason: pb.AbortReason,
    culprit: int = -1,
) -> Send:
    """A StepAborted for `ranks`.

    `bucket_index` may come straight from a refused chunk's header (a stale
    step is refused before its bucket is checked): one that StepAborted's int32
    cannot hold is sent as -1 (unknown), since the message names it anyway.
    """
    aborted = pb.StepAborted(
        step=step,
        code=int(code),
        message=details,
        culprit_rank=culprit,
        bucket_index=bucket_index if -1 <= bucket_index < 2**31 else -1,
        reason=reason,
    )
    return Send(ranks, pb.CoordinatorMessage(step_aborted=aborted))


def abort_actions(
    ranks: tuple[int, ...], culprit: int, step: int, rejection: RejectedMessage
) -> list[Action]:
    """The StepAborted messages telling `ranks` that `step` is aborted because of `culprit`.

    A rejected message: the culprit hears its own refusal (MESSAGE_REJECTED,
    the refusal's code), the others that a peer's message was refused. A
    non-finite contribution under `--nonfinite abort`: one message for every
    rank alike (reason NONFINITE, code ABORTED, the culprit named).
    """
    bucket, code, details = rejection.bucket_index, rejection.code, rejection.message
    if isinstance(rejection, NonFiniteRejection):
        # The rank whose gradient held it: a local group's member, not the leader
        # that uploaded the group's sum, when the group could tell.
        reason = pb.ABORT_REASON_NONFINITE
        return [abort_message(ranks, step, code, details, bucket, reason, rejection.rank)]
    actions: list[Action] = []
    if culprit in ranks:
        reason = pb.ABORT_REASON_MESSAGE_REJECTED
        actions.append(abort_message((culprit,), step, code, details, bucket, reason, culprit))
    others = tuple(r for r in ranks if r != culprit)
    if others:
        why = f"step {step} aborted because rank {culprit}'s message was rejected: {details}"
        reason = pb.ABORT_REASON_PEER_MESSAGE_REJECTED
        actions.append(abort_message(others, step, Code.ABORTED, why, bucket, reason, culprit))
    return actions
