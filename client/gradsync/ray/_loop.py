"""An asyncio loop in a daemon thread: where a coordinator or shard runs inside a Ray actor.

The coordinator is written for `grpc.aio` on one event loop. A Ray actor's methods run on
Ray's own threads, so each actor owns one private loop in a thread of its own and hands
coroutines to it. Ray never sees the loop, and the server lives exactly as long as the
actor's process: killing the actor (or losing its node) takes the server with it, so no
orphan coordinator process can outlive its actor.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")

#: How long closing waits for the loop's thread to end.
CLOSE_TIMEOUT_S = 10.0


class LoopThread:
    """A running event loop in a daemon thread, with a blocking `call` into it."""

    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def call(self, coroutine: Coroutine[Any, Any, T], timeout_s: float) -> T:
        """Run `coroutine` on the loop and wait for its result.

        Raises:
            TimeoutError: it did not finish within `timeout_s` (it is cancelled).
            Exception: whatever the coroutine raised.
        """
        future = asyncio.run_coroutine_threadsafe(coroutine, self.loop)
        try:
            return future.result(timeout=timeout_s)
        except TimeoutError:
            future.cancel()
            raise

    def close(self) -> None:
        """Cancel what still runs on the loop, stop it and join its thread; twice is a no-op."""
        # Not `loop.is_running()`: right after __init__ the thread may not have entered
        # run_forever yet, and returning then would leave the loop running for good.
        if self.loop.is_closed() or not self._thread.is_alive():
            return

        async def cancel_rest() -> None:
            current = asyncio.current_task()
            rest = [task for task in asyncio.all_tasks() if task is not current]
            for task in rest:
                task.cancel()
            await asyncio.gather(*rest, return_exceptions=True)

        try:
            self.call(cancel_rest(), CLOSE_TIMEOUT_S)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(CLOSE_TIMEOUT_S)
            if not self._thread.is_alive():
                self.loop.close()
