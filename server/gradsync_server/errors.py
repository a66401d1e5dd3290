"""The coordinator's internal refusal: a message that must be turned away.

Raised by the pure coordinator logic and caught by the servicer, which turns
it into a gRPC status (the sender's stream ends) or an in-band StepAborted
message (the open step is abandoned for every rank). It never reaches users.
"""

from __future__ import annotations

from gradsync_proto.codes import Code


class RejectedMessage(Exception):
    """Raised by coordinator logic when a message must be refused.

    Internal to the coordinator: the servicer turns it into a gRPC status or an
    in-band StepAborted message. `message` names the rank, step, bucket and the
    values involved.
    """

    def __init__(
        self, code: Code, message: str, *, step: int | None = None, bucket_index: int = -1
    ) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.step = step
        self.bucket_index = bucket_index
