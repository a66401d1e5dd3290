"""Watch a live process's output: wait (bounded) for a line, keep everything for asserts.

Tests of what a person sees while ranks start at human pace ("waiting for
ranks [2] of 3", "connection refused") need to read a process's stderr while
it runs, with a deadline, and still have the whole text when it exits. A
daemon thread drains the pipe (so the child never blocks on a full pipe) into
a list that `wait_for` polls under a condition variable.
"""

from __future__ import annotations

import re
import subprocess
import threading
import time
from collections.abc import Sequence
from typing import IO

#: What must never appear on a CLI's stderr, on any exit path.
NOISE = (
    "Traceback (most recent call last)",
    "Task was destroyed but it is pending",
    "Future exception was never retrieved",
    "Exception ignored in",
)


class WatchedProcess:
    """A subprocess whose stdout and stderr (merged) are collected line by line."""

    def __init__(self, argv: Sequence[str], name: str = "") -> None:
        self.name = name or " ".join(argv[-4:])
        self.started = time.monotonic()
        self.process: subprocess.Popen[str] = subprocess.Popen(
            list(argv), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        self._lines: list[tuple[float, str]] = []
        self._changed = threading.Condition()
        assert self.process.stdout is not None
        self._reader = threading.Thread(
            target=self._drain, args=(self.process.stdout,), daemon=True
        )
        self._reader.start()

    def _drain(self, stream: IO[str]) -> None:
        for line in stream:
            with self._changed:
                self._lines.append((time.monotonic() - self.started, line))
                self._changed.notify_all()
        with self._changed:
            self._changed.notify_all()

    @property
    def text(self) -> str:
        """Everything the process printed so far."""
        with self._changed:
            return "".join(line for _, line in self._lines)

    def wait_for(self, pattern: str, timeout_s: float) -> tuple[float, str]:
        """Wait until a line matches `pattern` (a regex); return (seconds since start, line).

        Raises:
            AssertionError: no such line within `timeout_s` (the output is in the message).
        """
        regex = re.compile(pattern)
        deadline = time.monotonic() + timeout_s
        with self._changed:
            while True:
                for at, line in self._lines:
                    if regex.search(line):
                        return at, line
                remaining = deadline - time.monotonic()
                if remaining <= 0 or (
                    not self._reader.is_alive() and self.process.poll() is not None
                ):
                    break
                self._changed.wait(min(remaining, 0.5))
        raise AssertionError(
            f"{self.name}: no line matching {pattern!r} within {timeout_s:g}s; output:\n{self.text}"
        )

    def finish(self, timeout_s: float) -> tuple[int, str]:
        """Wait for the exit (killing it after `timeout_s`); return (exit status, all output)."""
        try:
            code = self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
            self._close()
            raise AssertionError(
                f"{self.name} did not exit within {timeout_s:g}s; output:\n{self.text}"
            ) from None
        self._close()
        return code, self.text

    def kill(self) -> None:
        """SIGKILL it if it still runs (a test's cleanup)."""
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        self._close()

    def _close(self) -> None:
        # The pipe ends when the process (and any child holding it) exits.
        self._reader.join(timeout=5)
        if self.process.stdout is not None and not self._reader.is_alive():
            self.process.stdout.close()


def assert_quiet(text: str, who: str) -> None:
    """Fail when `text` holds a traceback or asyncio's leaked-task noise."""
    found = [needle for needle in NOISE if needle in text]
    assert not found, f"{who} printed {found}:\n{text}"
