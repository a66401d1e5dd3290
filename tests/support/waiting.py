"""Wait for a condition with a deadline, instead of sleeping a fixed time and hoping.

A test that sleeps "long enough" for an event and then asserts it is slow
(it always waits the whole time) and flaky (on a loaded machine the event may
come later than the sleep). Polling the condition returns as soon as it holds,
and fails only at the deadline, naming what never happened. A sleep that lets
time pass on purpose (showing that nothing happens within a window) stays a
sleep: there is no event to wait for.

`support.faults.wait_for` is the blocking twin, for tests that drive processes
from plain threads; this one is for the asyncio scenarios (`support.rawclient.run`),
which must not block the event loop the coordinator under test runs on.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable

#: Long enough for any in-process event on a loaded CI machine, well inside
#: `support.rawclient.run`'s 30 s bound on a whole scenario.
DEFAULT_TIMEOUT_S = 10.0
#: Between checks: short next to the events waited for, long enough not to spin.
POLL_INTERVAL_S = 0.01


async def eventually(
    condition: Callable[[], bool | Awaitable[bool]],
    what: str,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> None:
    """Return once `condition()` (a plain or an async check) is true; fail after `timeout_s`.

    The condition is checked once more at the deadline, so a slow last poll
    cannot fail a wait whose event did arrive.

    Raises:
        AssertionError: the condition was still false at the deadline (naming `what`).
    """
    deadline = time.monotonic() + timeout_s
    while True:
        result = condition()
        if inspect.isawaitable(result):
            result = await result
        if result:
            return
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout_s:g}s waiting for {what}")
        await asyncio.sleep(POLL_INTERVAL_S)
