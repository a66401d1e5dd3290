"""A bucket as a list of byte segments: sent from, and averaged into, in place.

A bucket's gradients live in separate tensors (one per parameter). Instead of
concatenating them into one flat buffer (a copy) and later copying averages
back out (two more), the transport cuts wire chunks straight out of the
segments (joining at most a few memoryviews per chunk, the one unavoidable
copy) and scatters each averaged chunk straight back into them.

Writing averages into the very memory that was uploaded is safe: an averaged
chunk can only exist after the coordinator has received this rank's copy of
that chunk, so the upload of those bytes is finished.

An int8 bucket (DiLoCo's int8 wire, `gradsync.int8_wire`) also holds the
scale of each of its chunks, computed on the grid the transport cuts it on,
which every chunk's header carries (`scale_at`).

That an average overwrites the upload is also why a step that must be
uploaded again (a restarted coordinator, `Reducer.resend`) needs the uploaded
bytes from somewhere else. A buffer made with `record_sent` collects, for
each chunk the transport encodes, a view of the payload inside the encoded
message (`record`): the transport's one copy doubles as the kept copy, and
`restore_sent` writes it back. An average can only land on a chunk that was
sent, so what was recorded covers every byte an average may have overwritten.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Iterator, Mapping, Sequence

import numpy as np
import numpy.typing as npt
from gradsync_proto import chunking


class BucketBuffer:
    """One bucket's bytes, held by `segments` (1-D uint8 arrays, writable).

    Args:
        segments: the bucket's parameters' gradient bytes, in bucket order.
        scales: an int8 bucket's scale of each chunk, by the chunk's offset; None
            for any other bucket (its chunks carry no scale).
        weight: a weighted DiLoCo round's weight of this rank (every chunk carries
            it, `GradientChunk.weight`); 0 = none.
        record_sent: keep a view of every chunk's payload as sent (`record`), so
            that the uploaded bytes can be restored after averages landed over
            them (`restore_sent`).
        encoded: a sparse bucket's payload of each chunk, by offset (DiLoCo's sparse
            2-bit wire): its chunks carry these bytes, not slices of `segments`
            (which then only give the bucket's size and grid).
    """

    def __init__(
        self,
        segments: Sequence[npt.NDArray[np.uint8]],
        scales: Mapping[int, float] | None = None,
        weight: float = 0.0,
        *,
        record_sent: bool = False,
        encoded: Mapping[int, bytes] | None = None,
    ) -> None:
        self.segments = list(segments)
        self.encoded = None if encoded is None else dict(encoded)
        self._starts = [0, *itertools.accumulate(len(s) for s in self.segments)]
        self.size = self._starts[-1]
        self.scales = dict(scales or {})
        self.weight = weight
        #: (offset, payload as sent) of every chunk encoded so far; None = not recorded.
        #: Appended to by the transport's loop thread; read by `restore_sent` only once
        #: that transport is closed (a coordinator lost), so no lock.
        self.sent: list[tuple[int, memoryview]] | None = [] if record_sent else None

    @property
    def wire_bytes(self) -> int:
        """The bucket's bytes on the wire: its payload and a float32 scale per scaled chunk."""
        if self.encoded is not None:
            return sum(len(payload) for payload in self.encoded.values())
        return self.size + 4 * len(self.scales)

    def scale_at(self, offset: int) -> float:
        """The scale the chunk at `offset` carries: 0.0 for a bucket without scales.

        Raises:
            ValueError: the bucket has scales, but none at `offset`: it was quantized
                on another chunk grid than the one it is being cut on.
        """
        if not self.scales:
            return 0.0
        try:
            return self.scales[offset]
        except KeyError:
            raise ValueError(
                f"no scale for the chunk at offset {offset} of this int8 bucket: it was "
                f"quantized on another chunk grid (scaled chunks at {sorted(self.scales)[:4]}...)"
            ) from None

    def chunks(self, chunk_bytes: int) -> Iterator[tuple[int, list[memoryview]]]:
        """Yield (offset, pieces) per wire chunk; the pieces concatenate to the chunk."""
        return self.range_chunks(0, self.size, chunk_bytes)

    def range_chunks(
        self, lo: int, hi: int, chunk_bytes: int
    ) -> Iterator[tuple[int, list[memoryview]]]:
        """Yield (absolute offset, pieces) per wire chunk of bytes [lo, hi).

        A sharded coordinator chunks each shard's range on its own grid
        (`gradsync_proto.chunking.range_chunk_spans`); [0, size) is the
        unsharded grid.

        Raises:
            ValueError: the range falls outside the bucket.
        """
        if not 0 <= lo <= hi <= self.size:
            raise ValueError(f"bytes [{lo}, {hi}) are outside the bucket's {self.size}")
        for offset, length in chunking.range_chunk_spans(lo, hi, chunk_bytes):
            yield offset, self.pieces(offset, length)

    def pieces(self, offset: int, length: int) -> list[memoryview]:
        """Memoryviews covering bytes [offset, offset + length)."""
        out = []
        index = bisect.bisect_right(self._starts, offset) - 1
        end = offset + length
        while offset < end:
            start = self._starts[index]
            segment = self.segments[index]
            take = min(end, start + len(segment)) - offset
            if take > 0:
                out.append(memoryview(segment.data)[offset - start : offset - start + take])
            offset += max(take, 0)
            index += 1
        return out

    def write(self, offset: int, payload: memoryview | bytes) -> None:
        """Copy `payload` into bytes [offset, offset + len(payload)).

        Raises:
            ValueError: the range falls outside the bucket.
        """
        if offset < 0 or offset + len(payload) > self.size:
            raise ValueError(
                f"bytes [{offset}, {offset + len(payload)}) are outside the bucket's {self.size}"
            )
        position = 0
        for piece in self.pieces(offset, len(payload)):
            piece[:] = payload[position : position + len(piece)]
            position += len(piece)

    def record(self, offset: int, pieces: Sequence[memoryview], message: bytes) -> None:
        """Note that the chunk at `offset` (`pieces`) went out as the tail of `message`.

        The payload is the last bytes of an encoded chunk (`gradsync_proto.codec`
        writes it last); the view keeps the message alive, not a copy of the
        payload. Nothing is noted when the buffer does not record, or for a chunk
        without payload (the same-host segment path).
        """
        sent = self.sent
        if sent is None:
            return
        length = sum(piece.nbytes for piece in pieces)
        if length > 0:
            sent.append((offset, memoryview(message)[len(message) - length :]))

    def restore_sent(self) -> None:
        """Write every recorded payload back over the bucket, and record afresh.

        Raises:
            RuntimeError: the buffer does not record what it sends.
        """
        sent = self.sent
        if sent is None:
            raise RuntimeError("this bucket's uploads were not recorded (record_sent=False)")
        for offset, payload in sent:
            self.write(offset, payload)
        self.sent = []
