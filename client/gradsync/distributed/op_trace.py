"""A process group's Chrome trace: the phases of each of its operations, per rank.

Switched on by `GradsyncOptions(trace_path=...)` or `$GRADSYNC_TRACE` (see `trace_file`).
The file is the model wrapper's trace format (`gradsync.path.trace.StepTracer`); every
group of the process writes to the same file, on an "ops" and a "wire" track of its own.
docs/backend.md (Trace) says what each span and phase means and when a phase is null.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from gradsync.path.trace import StepTracer

#: The environment variable that switches the trace on (a path, see `trace_file`).
ENV_TRACE = "GRADSYNC_TRACE"
#: Upload events of a collective's input (`gradsync.control.worker_messages`).
UPLOAD_START = "collective_upload_start"
UPLOAD_END = "collective_upload_end"
#: Operations whose phases are kept while they wait for a late byte event, at most.
KEPT_OPS = 4096


def trace_file(template: str, rank: int) -> Path:
    """The trace file of global rank `rank` for `template`: "{rank}" in it becomes the rank,
    and a path without "{rank}" gets "-rank<r>" before its suffix (a host's ranks never
    share a file)."""
    if "{rank}" in template:
        return Path(template.replace("{rank}", str(rank)))
    path = Path(template)
    return path.with_name(f"{path.stem}-rank{rank}{path.suffix}")


def resolve_trace_path(option: str | os.PathLike[str] | None) -> str | None:
    """The trace template: the option, else $GRADSYNC_TRACE, else None (no trace)."""
    if option is not None:
        return os.fspath(option) or None
    return os.environ.get(ENV_TRACE) or None


@dataclass
class _Phases:
    name: str
    issued: float
    first_byte: float | None = None
    last_byte: float | None = None
    received: float | None = None


class _TraceFile:
    """One rank's trace file, shared by the groups of the process that write to it."""

    def __init__(self, path: Path, rank: int) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.tracer = StepTracer(path, rank)
        self.users = 0
        self.next_track = 2  # (0 and 1 are the wrapper's autograd and transport tracks)


_files: dict[Path, _TraceFile] = {}
_files_lock = threading.Lock()


@atexit.register
def _close_all() -> None:
    with _files_lock:
        for shared in _files.values():
            shared.tracer.close()
        _files.clear()


class OpTrace:
    """The trace of one group on one rank: fed by the group's `OpQueue` (issue, result,
    completion), its `ResumingLink` (which collectives an operation numbered) and its
    transport (when a collective's first and last byte went out).

    Thread-safe: the caller's thread, the group's threads and the stream's threads record.

    Args:
        template: the trace path (see `trace_file`).
        rank: this process's global rank.
        group: the group's name (its tracks are named after it).
    """

    def __init__(self, template: str, rank: int, group: str) -> None:
        path = trace_file(template, rank)
        with _files_lock:
            shared = _files.get(path)
            if shared is None:
                shared = _files[path] = _TraceFile(path, rank)
            shared.users += 1
            self._ops_track, self._wire_track = shared.next_track, shared.next_track + 1
            shared.next_track += 2
        self.path = path
        self._shared = shared
        self._tracer = shared.tracer
        self._tracer.name_track(self._ops_track, f"{group} ops")
        self._tracer.name_track(self._wire_track, f"{group} wire")
        self._lock = threading.Lock()
        self._ops: dict[int, _Phases] = {}
        #: The link's collective numbers, by the operation that numbered them.
        self._collectives: dict[int, int] = {}
        self._current = threading.local()
        self._closed = False

    # ------------------------------------------------------------ the operation queue
    def issued(self, sequence: int, name: str) -> None:
        """Operation `sequence` (`name`) was called."""
        now = self._tracer.now()
        with self._lock:
            self._ops[sequence] = _Phases(name, now)
            while len(self._ops) > KEPT_OPS:
                del self._ops[next(iter(self._ops))]

    @contextlib.contextmanager
    def running(self, sequence: int) -> Iterator[None]:
        """The collectives numbered on this thread inside belong to operation `sequence`."""
        previous = getattr(self._current, "sequence", None)
        self._current.sequence = sequence
        try:
            yield
        finally:
            self._current.sequence = previous

    def received(self, sequence: int) -> None:
        """Operation `sequence`'s result is in (the first call counts)."""
        now = self._tracer.now()
        with self._lock:
            phases = self._ops.get(sequence)
            if phases is not None and phases.received is None:
                phases.received = now

    def completed(self, sequence: int, ok: bool, finished: float) -> None:
        """Operation `sequence`'s Work completed (or failed) at `finished` (a
        `time.perf_counter()` reading, the trace's clock): its spans are written."""
        with self._lock:
            phases = self._ops.pop(sequence, None)
            for collective in [c for c, op in self._collectives.items() if op == sequence]:
                del self._collectives[collective]
        if phases is None:
            return
        received = phases.received if phases.received is not None else finished
        origin = self._tracer.origin

        def at(moment: float | None) -> float | None:
            return None if moment is None else (moment - origin) * 1e6

        args = {
            "operation": sequence,
            "issued": at(phases.issued),
            "first_byte_sent": at(phases.first_byte),
            "last_byte_sent": at(phases.last_byte),
            "result_received": at(received),
            "completed": at(finished),
            "ok": ok,
        }
        tracer, wire, named = self._tracer, self._wire_track, {"operation": sequence}
        tracer.span(phases.name, sequence, phases.issued, finished, -1, self._ops_track, args)
        waited_from = phases.issued
        if phases.first_byte is not None and phases.last_byte is not None:
            tracer.span("send", sequence, phases.first_byte, phases.last_byte, -1, wire, named)
            waited_from = phases.last_byte
        tracer.span("result", sequence, waited_from, received, -1, wire, named)
        tracer.flush()

    # ------------------------------------------------------------ the link and the stream
    def numbered(self, collective: int) -> None:
        """The link numbered `collective` on this thread (for the operation running here)."""
        sequence = getattr(self._current, "sequence", None)
        if sequence is None:
            return
        with self._lock:
            self._collectives[collective] = sequence
            while len(self._collectives) > KEPT_OPS:
                del self._collectives[next(iter(self._collectives))]

    def on_link_event(self, event: str, collective: int, _bucket: int) -> None:
        """The transport's upload events (`BucketEventHandler`): a collective's first and
        last byte went out."""
        if event not in (UPLOAD_START, UPLOAD_END):
            return
        now = self._tracer.now()
        with self._lock:
            sequence = self._collectives.get(collective)
            phases = self._ops.get(sequence) if sequence is not None else None
            if phases is None:
                return
            if event == UPLOAD_END:
                phases.last_byte = now
            elif phases.first_byte is None:
                phases.first_byte = now

    def close(self) -> None:
        """Flush; the file is closed when its last group closes (or at exit). Idempotent."""
        with _files_lock:
            if self._closed:
                return
            self._closed = True
            self._shared.users -= 1
            if self._shared.users > 0:
                self._tracer.flush()
                return
            self._tracer.close()
            if _files.get(self.path) is self._shared:
                del _files[self.path]
