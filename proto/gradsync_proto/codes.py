"""Status codes, as numbers both ends can use without importing grpc.

`Code` mirrors google.rpc.Code (the same numbers as `grpc.StatusCode`), so the
coordinator's pure logic can decide "this is INVALID_ARGUMENT" and the client
can map a stream-ending status to an exception, neither importing grpc.
"""

from __future__ import annotations

import enum


class Code(enum.IntEnum):
    """google.rpc.Code values used by gradsync (same numbers as grpc.StatusCode)."""

    OK = 0
    CANCELLED = 1
    UNKNOWN = 2
    INVALID_ARGUMENT = 3
    DEADLINE_EXCEEDED = 4
    NOT_FOUND = 5
    ALREADY_EXISTS = 6
    PERMISSION_DENIED = 7
    RESOURCE_EXHAUSTED = 8
    FAILED_PRECONDITION = 9
    ABORTED = 10
    INTERNAL = 13
    UNAVAILABLE = 14
    UNAUTHENTICATED = 16
