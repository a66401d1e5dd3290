"""BucketBuffer: chunks cut across segment boundaries, writes scattered back."""

from __future__ import annotations

import numpy as np
import pytest
from gradsync.path.buffers import BucketBuffer


def make(sizes: list[int]) -> tuple[BucketBuffer, bytes]:
    rng = np.random.default_rng(len(sizes))
    segments = [rng.integers(0, 256, n, dtype=np.uint8) for n in sizes]
    return BucketBuffer(segments), b"".join(s.tobytes() for s in segments)


@pytest.mark.parametrize("chunk", [1, 3, 7, 64, 1000])
def test_chunks_concatenate_to_the_bucket(chunk: int) -> None:
    buffer, flat = make([5, 0, 17, 1, 40])
    rebuilt = b""
    for offset, pieces in buffer.chunks(chunk):
        assert offset == len(rebuilt)
        data = b"".join(pieces)
        assert len(data) == min(chunk, len(flat) - offset)
        rebuilt += data
    assert rebuilt == flat


def test_write_scatters_into_the_segments() -> None:
    buffer, flat = make([4, 9, 3])
    replacement = bytes(range(100, 116))
    buffer.write(0, replacement[:6])
    buffer.write(6, memoryview(replacement)[6:])
    assert b"".join(s.tobytes() for s in buffer.segments) == replacement
    assert flat != replacement


def test_write_outside_the_bucket_is_refused() -> None:
    buffer, _ = make([4])
    with pytest.raises(ValueError, match="outside"):
        buffer.write(2, b"abc")
