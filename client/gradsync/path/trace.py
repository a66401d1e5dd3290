"""Chrome trace-event files of each synchronized step (view in Perfetto or chrome://tracing).

Per step the trace shows, on the rank's "autograd" track, the backward pass
and the wait for averages at its end, and on its "transport" track each
bucket's upload and the time until its average was complete; an instant
marks when each bucket's gradients were ready. That is exactly what a user
needs to see whether communication overlaps the backward pass.

The file is a JSON array written incrementally (one flush per step) and
closed with "]" by `close()`; Chrome and Perfetto also load an unclosed
array, so a crashed run still leaves a readable trace.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any, TextIO

AUTOGRAD_TRACK = 0
TRANSPORT_TRACK = 1


class StepTracer:
    """Collects trace events of one rank and appends them to `path`.

    Thread-safe: the autograd thread and the transport thread both record.
    """

    def __init__(self, path: Path, rank: int) -> None:
        self.path = path
        self.rank = rank
        self._origin = time.perf_counter()
        self._lock = threading.Lock()
        self._pending: list[dict[str, Any]] = []
        self._open: dict[tuple[str, int, int], float] = {}
        self._file: TextIO | None = path.open("w")
        self._file.write("[\n")
        self._first = True
        for track, name in ((AUTOGRAD_TRACK, "autograd"), (TRANSPORT_TRACK, "transport")):
            self.name_track(track, name)
        self._pending.append(
            {"name": "process_name", "ph": "M", "pid": rank, "args": {"name": f"rank {rank}"}}
        )

    def now(self) -> float:
        """Seconds on the tracer's clock."""
        return time.perf_counter()

    @property
    def origin(self) -> float:
        """The clock reading the events' times count from (their "ts" is 0 there)."""
        return self._origin

    def name_track(self, track: int, name: str) -> None:
        """Name another track of this rank (a thread in the viewer)."""
        with self._lock:
            self._pending.append(
                {
                    "name": "thread_name",
                    "ph": "M",
                    "pid": self.rank,
                    "tid": track,
                    "args": {"name": name},
                }
            )

    def begin(self, name: str, step: int, bucket: int = -1) -> None:
        """Start a span; `end` with the same key closes it."""
        with self._lock:
            self._open[(name, step, bucket)] = time.perf_counter()

    def end(self, name: str, step: int, bucket: int = -1, track: int = AUTOGRAD_TRACK) -> None:
        """Close a span started with `begin` (ignored if it was never begun)."""
        finished = time.perf_counter()
        with self._lock:
            started = self._open.pop((name, step, bucket), None)
            if started is not None:
                self._pending.append(self._event(name, step, bucket, started, finished, track))

    def span(
        self,
        name: str,
        step: int,
        started: float,
        finished: float,
        bucket: int = -1,
        track: int = AUTOGRAD_TRACK,
        args: dict[str, Any] | None = None,
    ) -> None:
        """Record a complete span from two `now()` readings (`args`: more of its details)."""
        event = self._event(name, step, bucket, started, finished, track)
        if args:
            event["args"].update(args)
        with self._lock:
            self._pending.append(event)

    def instant(self, name: str, step: int, bucket: int = -1, track: int = AUTOGRAD_TRACK) -> None:
        """Record a point in time."""
        at = time.perf_counter()
        with self._lock:
            self._pending.append(
                {
                    "name": name,
                    "ph": "i",
                    "s": "t",
                    "pid": self.rank,
                    "tid": track,
                    "ts": (at - self._origin) * 1e6,
                    "args": {"step": step, "bucket": bucket},
                }
            )

    def flush(self) -> None:
        """Append the recorded events to the file."""
        with self._lock:
            events, self._pending = self._pending, []
            if self._file is None:
                return
            for event in events:
                self._file.write(("" if self._first else ",\n") + json.dumps(event))
                self._first = False
            self._file.flush()

    def close(self) -> None:
        """Flush and terminate the JSON array. Idempotent."""
        self.flush()
        with self._lock:
            if self._file is not None:
                self._file.write("\n]\n")
                self._file.close()
                self._file = None

    def _event(
        self, name: str, step: int, bucket: int, started: float, finished: float, track: int
    ) -> dict[str, Any]:
        label = name if bucket < 0 else f"{name} bucket {bucket}"
        return {
            "name": label,
            "ph": "X",
            "pid": self.rank,
            "tid": track,
            "ts": (started - self._origin) * 1e6,
            "dur": (finished - started) * 1e6,
            "args": {"step": step, "bucket": bucket},
        }
