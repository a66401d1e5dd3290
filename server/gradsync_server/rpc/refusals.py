"""One rate-limited log of refused callers, shared by every port of a coordinator process.

Whoever can reach a port can make it refuse them as fast as they can connect: a
wrong token, bytes that are not frames, a TLS handshake that fails or never
starts, a connection dropped over a cap. Logging each refusal would let an
unauthenticated flood fill the log disk, so refusals are counted and written at
most once per `REFUSAL_LOG_PERIOD_S` as one WARNING line: how many, on which
ports, and the latest one's peer and reason. The gRPC port's token check and
the frame port both write here.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable

log = logging.getLogger("gradsync.server")

#: Refusals are logged at most once per this many seconds (with a count).
REFUSAL_LOG_PERIOD_S = 10.0


class RefusalLog:
    """Counts refusals and logs them at most once per `period_s`.

    Args:
        period_s: the least time between two lines.
        clock: monotonic seconds (injectable for tests of the rate limit).
    """

    def __init__(
        self, period_s: float = REFUSAL_LOG_PERIOD_S, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._period_s = period_s
        self._clock = clock
        self._last_line = -period_s
        self._since_line: Counter[str] = Counter()
        #: Refusals since start, by port ("gRPC", "frame"), for tests and status.
        self.total: Counter[str] = Counter()
        #: Lines written (for tests of the rate limit).
        self.lines = 0

    def note(self, port: str, peer: str, reason: str) -> None:
        """Count one refusal on `port` of `peer` for `reason`; log if a period has passed."""
        self.total[port] += 1
        self._since_line[port] += 1
        now = self._clock()
        elapsed = now - self._last_line
        if elapsed < self._period_s:
            return
        counts = ", ".join(
            f"{count} on the {name} port" for name, count in self._since_line.items()
        )
        log.warning(
            "refused %d unauthenticated connection(s) or call(s) in the last %.3gs (%s; latest: "
            "%s on the %s port: %s)",
            sum(self._since_line.values()),
            elapsed if self.lines else min(self._period_s, elapsed),
            counts,
            peer,
            port,
            reason,
        )
        self.lines += 1
        self._last_line = now
        self._since_line.clear()
