"""Pacing a worker's uploads: a window clocked by the answers, shards visited in rotation.

A coordinator (or shard) answers a chunk only once every rank's copy of it is
in, so on shaped links the slowest of the flows that share a port sets the
pace of the answers: measured on 200 Mbit/s links (W = 4, one coordinator),
the four upload flows ran at 0.3-11 MB/s each while their sum filled the
link, the answers went out at the slowest flow's rate, and the ranks that
finished early left the coordinator's downlink half idle at the end. A rank
that is far ahead of the others gains nothing: its chunks wait at the
coordinator for everyone else's.

So each rank keeps at most `window_bytes` of the current step on each stream
that are handed to gRPC and not yet answered (answers clock the uploads, as
acknowledgements clock TCP): a rank that runs ahead stalls until the others
catch up, and its share of the shared links goes to them. Every rank still
uploads as fast as the slowest can keep up, and the answers flow from the
first chunks on, overlapping the uploads as the cost model assumes.

With S shards, each rank hands its chunks out in rotation, chunk by chunk,
starting at shard (rank mod S) each step, like a ring's schedule: while the
ranks keep pace, shard s hears first from rank s, then from rank s-1, ..., so
no shard gets every rank's first window at once while another waits. (The
kernel still sends from every socket that holds data, so the S flows through a
port share it whatever the order; measured with S = W = 4 dedicated shards,
pacing did not change the time beyond the noise, README "Sharded coordinators".)

Pacing is an optimization, never a condition for progress: when a full
window gets no answer for `stall_s` (a straggler the step waits for anyway, an
aborted step, a mode that answers late), the rest of the step is sent
unpaced, so that a rank which is ahead never looks late itself by more than
`stall_s`; a newer step resets every window (the uploads of older steps are
then sent unpaced); uploads whose payload stays in a same-host segment,
empty ranges, and `window_bytes` <= 0 are not paced at all. Nothing here
changes what is sent, only when: every chunk keeps its offset on its range's
grid, so the coordinator's checks and its rank-order sums are untouched.
A coordinator reached over loopback gets no pacing unless the window is set
explicitly: one host has no shared link to pace, only cores, and holding
chunks back there only shortens the pipeline (25 MB, W = 2 on loopback: 151-200
ms per sync unpaced against 158-212 ms with a 2 MiB window, in alternating runs).

Loop thread only (no lock); timers come from an injected `schedule`
(`loop.call_later`), so the logic is tested without a network or a loop.
"""

from __future__ import annotations

import functools
import logging
import os
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

from gradsync_proto import auth, chunking, dtypes
from gradsync_proto.v1 import gradsync_pb2 as pb

from gradsync.path.bucket_uploads import RangeUpload, UploadProgress

log = logging.getLogger("gradsync.client")

#: Unanswered bytes of the current step allowed per stream. It has to cover a
#: stream's share of the link times a chunk's round trip (its upload, everyone
#: else's copy of it, the answer); larger only loosens the lockstep. Measured at
#: W = 4, 16 MB, one coordinator on 200 Mbit/s links: 3459 ms with 2 MiB, 3592-3609
#: with 4-8 MiB, 4166 with 16 MiB, 3842 unpaced (1 MiB chunks, one run each).
UPLOAD_WINDOW_BYTES = 2 << 20
#: A full window that no answer opened for this long ends the pacing of its step. Answers
#: come every few tens of ms while the ranks keep pace (a 256 KiB chunk from W = 4 ranks
#: takes 40 ms at 200 Mbit/s); a longer silence means the step waits for someone else.
PACING_STALL_S = 0.5
#: Overrides `UPLOAD_WINDOW_BYTES` (MiB, 0 = no pacing); read when a transport is built.
ENV_UPLOAD_WINDOW_MB = "GRADSYNC_UPLOAD_WINDOW_MB"


class WelcomeSource(Protocol):
    """Where the Welcome is read from (the transport's `Inbox`)."""

    @property
    def welcome(self) -> pb.Welcome | None: ...


class Timer(Protocol):
    """What `schedule` returns (an `asyncio.TimerHandle`)."""

    def cancel(self) -> None: ...


#: Called as (delay_s, callback); returns something that can be cancelled.
Schedule = Callable[[float, Callable[[], None]], Timer]
#: Called as (stream index, range piece): hand it to that stream's queue.
Send = Callable[[int, RangeUpload], None]


def window_bytes_from_env(environ: Mapping[str, str] | None = None, target: str = "") -> int:
    """The per-stream window: `ENV_UPLOAD_WINDOW_MB` if set, else `UPLOAD_WINDOW_BYTES`
    (0 when `target`, the coordinator, is on loopback).

    Raises:
        ValueError: the variable is not a number >= 0.
    """
    env = os.environ if environ is None else environ
    text = env.get(ENV_UPLOAD_WINDOW_MB, "").strip()
    if not text:
        return 0 if auth.is_loopback(target) else UPLOAD_WINDOW_BYTES
    try:
        megabytes = float(text)
    except ValueError:
        megabytes = -1.0
    if not megabytes >= 0:  # also NaN
        raise ValueError(f"${ENV_UPLOAD_WINDOW_MB} must be a number of MiB >= 0, got {text!r}")
    return int(megabytes * (1 << 20))


def chunk_bytes_of(welcome: pb.Welcome | None) -> int:
    """The chunk size uploads are cut on: the Welcome's, else the default."""
    return (welcome.chunk_bytes if welcome is not None else 0) or chunking.DEFAULT_CHUNK_BYTES


def rotation(rank: int, shard_count: int) -> list[int]:
    """The order rank `rank` visits the shards in: rank mod S, then upwards, wrapping."""
    return [(rank + k) % shard_count for k in range(shard_count)]


def split_range(part: RangeUpload, chunk_bytes: int) -> list[RangeUpload]:
    """`part` as one piece per chunk of its grid (same upload, same progress object).

    Every piece starts on the range's own chunk grid (lo + k * chunk_bytes), so
    its chunks have exactly the offsets and lengths the unsplit range's have.
    The caller counts the pieces into `part.progress.ranges_left`.
    """
    return [
        RangeUpload(part.upload, offset, offset + length, part.progress)
        for offset, length in chunking.range_chunk_spans(part.lo, part.hi, chunk_bytes)
    ]


class UploadPacer:
    """Hands each rank's range pieces to the streams under a per-stream window.

    Args:
        rank: this worker's rank (where the rotation starts).
        send: queues a piece on stream i (0 = the leader's).
        source: where the Welcome is (its chunk size is read at each dispatch).
        schedule: `loop.call_later`.
        target: the coordinator's (leader's) "host:port" (loopback: no pacing by default).
        window_bytes: unanswered bytes per stream; <= 0 = no pacing; None =
            `window_bytes_from_env` for `target`.
        stall_s: how long a full window waits for an answer before it opens anyway.
    """

    def __init__(
        self,
        rank: int,
        send: Send,
        source: WelcomeSource,
        schedule: Schedule,
        target: str = "",
        window_bytes: int | None = None,
        stall_s: float = PACING_STALL_S,
    ) -> None:
        self._rank = rank
        self._send = send
        self._source = source
        self._schedule = schedule
        self.window_bytes = (
            window_bytes_from_env(target=target) if window_bytes is None else window_bytes
        )
        self._stall_s = stall_s
        #: The newest step dispatched: only its bytes count against the windows.
        self._step: int | None = None
        #: Bytes per element of the newest step's uploads (to weigh answers).
        self._itemsize = 4
        self._queues: list[deque[RangeUpload]] = []
        self._outstanding: list[int] = []
        self._timers: dict[int, Timer] = {}
        #: The shard the next release looks at first.
        self._cursor = 0
        #: Steps whose pacing the stall bound ended (for tests and the debug log).
        self.stalls = 0
        #: The step the stall bound ended the pacing of (sent unpaced from then on).
        self._unpaced_step: int | None = None

    def dispatch(self, parts: Sequence[RangeUpload | None]) -> None:
        """Queue range i of one bucket for stream i, for every range there is."""
        if self.window_bytes <= 0 or not parts or parts[0] is None:
            self._send_all(parts)
            return
        upload = parts[0].upload
        if upload.segment_offset is not None:  # nothing crosses a network: nothing to pace
            self._send_all(parts)
            return
        self._grow(len(parts))
        if upload.step != self._step:
            self._new_step(upload.step, upload.dtype)
        chunk_bytes = chunk_bytes_of(self._source.welcome)
        pieces = [[] if part is None else split_range(part, chunk_bytes) for part in parts]
        progress: UploadProgress = parts[0].progress
        if not any(pieces):  # an empty bucket: range 0 carries its events
            self._send(0, parts[0])
            return
        progress.ranges_left = sum(len(found) for found in pieces)
        for index, found in enumerate(pieces):
            self._queues[index].extend(found)
        self._pump()

    def answered(self, index: int, step: int, dtype: int, payload_bytes: int) -> None:
        """Stream `index` brought an answer of `payload_bytes` in `dtype` for `step`."""
        if step != self._step or index >= len(self._outstanding):
            return
        try:
            elements = payload_bytes // dtypes.itemsize(dtype)
        except ValueError:  # an answer this rank cannot weigh: open the window
            elements = self._outstanding[index]
        answered = elements * self._itemsize
        self._outstanding[index] = max(0, self._outstanding[index] - answered)
        timer = self._timers.pop(index, None)
        if timer is not None:
            timer.cancel()
        self._pump()

    def outstanding(self, index: int) -> int:
        """Unanswered bytes of the current step on stream `index`."""
        return self._outstanding[index] if index < len(self._outstanding) else 0

    def queued(self, index: int) -> int:
        """Pieces waiting for room on stream `index`."""
        return len(self._queues[index]) if index < len(self._queues) else 0

    def close(self) -> None:
        """Cancel the stall timers (the transport is closing)."""
        for timer in self._timers.values():
            timer.cancel()
        self._timers.clear()

    # ------------------------------------------------------------ internals
    def _send_all(self, parts: Sequence[RangeUpload | None]) -> None:
        for index, part in enumerate(parts):
            if part is not None:
                self._send(index, part)

    def _grow(self, streams: int) -> None:
        while len(self._queues) < streams:
            self._queues.append(deque())
            self._outstanding.append(0)

    def _new_step(self, step: int, dtype: int) -> None:
        """A newer step: forget the old windows (their answers no longer count)."""
        self._step = step
        try:
            self._itemsize = dtypes.itemsize(dtype)
        except ValueError:
            self._itemsize = 1
        self._outstanding = [0] * len(self._outstanding)
        self.close()
        self._cursor = self._rank % len(self._queues)

    def _has_room(self, index: int, piece: RangeUpload) -> bool:
        if piece.upload.step == self._unpaced_step:
            return True
        outstanding = self._outstanding[index]
        # Always one piece in flight, whatever the window: a chunk larger than
        # the window must still go.
        return outstanding == 0 or outstanding + (piece.hi - piece.lo) <= self.window_bytes

    def _pump(self) -> None:
        """Release pieces in rotation order while their streams have room."""
        count = len(self._queues)
        released = True
        while released:
            released = False
            for k in range(count):
                index = (self._cursor + k) % count
                queue = self._queues[index]
                if queue and self._has_room(index, queue[0]):
                    piece = queue.popleft()
                    if piece.upload.step == self._step:
                        self._outstanding[index] += piece.hi - piece.lo
                    self._send(index, piece)
                    self._cursor = (index + 1) % count
                    released = True
                    break
        for index, queue in enumerate(self._queues):
            if queue and index not in self._timers:
                stall = functools.partial(self._stall, index)
                self._timers[index] = self._schedule(self._stall_s, stall)

    def _stall(self, index: int) -> None:
        """No answer opened stream `index`'s window in time: send the rest of the step."""
        self._timers.pop(index, None)
        if not self._queues[index]:
            return
        self.stalls += 1
        log.debug(
            "rank %d: no answer on stream %d for %gs with %d bytes unanswered; "
            "the rest of step %s goes unpaced",
            self._rank,
            index,
            self._stall_s,
            self._outstanding[index],
            self._step,
        )
        self._unpaced_step = self._step
        self.close()
        self._pump()
