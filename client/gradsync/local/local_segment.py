"""The shared memory of a local group: one anonymous file, its layout, and the local sums.

A local group (hierarchical aggregation, see `gradsync.local.local_group`) sums its
members' gradients in one shared segment before the leader uploads the sum.
The segment is ONE file without a name: `open(dir, O_TMPFILE)` in
`$GRADSYNC_SHM_DIR` (default /dev/shm), or `memfd_create` where O_TMPFILE is
not supported. Having no name, it cannot outlive the job, even when every
process is killed with SIGKILL: the kernel frees it with the last mapping or
descriptor. Its whole size is reserved with `posix_fallocate` when the group
forms, so a /dev/shm too small for it fails there, with ENOSPC turned into a
`SharedMemoryError` that says what to do, instead of with SIGBUS in the
middle of a step when a page is first touched.

Layout: one slot of `total` bytes per local rank (every bucket, the presence
bucket included, at a 64-byte aligned offset), then one result region of the
same layout. Each rank copies its buckets into its own slot; rank j of the
group sums share j of a bucket's elements over the slots, in local-rank
order (ascending global rank: the same bits whatever the timing), into the
result region, which the leader uploads and which the averages come back to.
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import shutil
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
from gradsync_proto.v1 import gradsync_pb2 as pb

from gradsync.errors import SharedMemoryError

#: Where the segment is created (a tmpfs); default /dev/shm.
ENV_SHM_DIR = "GRADSYNC_SHM_DIR"
DEFAULT_SHM_DIR = "/dev/shm"
#: Every bucket and every share starts on a cache line: no two ranks write one line.
ALIGN_BYTES = 64
#: The bucket dtypes a local group sums (hierarchy v1: full precision only).
LOCAL_DTYPES: dict[int, type[np.floating]] = {
    pb.DTYPE_FLOAT32: np.float32,
    pb.DTYPE_FLOAT64: np.float64,
}


def _align(value: int) -> int:
    return (value + ALIGN_BYTES - 1) // ALIGN_BYTES * ALIGN_BYTES


@dataclass(frozen=True)
class SegmentLayout:
    """Where each bucket of each slot, and of the result region, lies in the segment.

    Args:
        bucket_bytes: the size of each bucket (the presence bucket last).
        members: the number of local ranks (slots).
    """

    bucket_bytes: tuple[int, ...]
    members: int

    @property
    def offsets(self) -> tuple[int, ...]:
        """Each bucket's offset inside a slot (64-byte aligned)."""
        out, position = [], 0
        for size in self.bucket_bytes:
            out.append(position)
            position += _align(size)
        return tuple(out)

    @property
    def slot_bytes(self) -> int:
        """The size of one slot (and of the result region)."""
        return sum(_align(size) for size in self.bucket_bytes)

    @property
    def total_bytes(self) -> int:
        """The segment's size: a slot per member and the result region (at least one page)."""
        return max(mmap.PAGESIZE, (self.members + 1) * self.slot_bytes)

    def region(self, index: int) -> int:
        """The offset of slot `index`; `members` is the result region."""
        return index * self.slot_bytes


def shm_dir(environ: dict[str, str] | None = None) -> str:
    """`$GRADSYNC_SHM_DIR`, else /dev/shm."""
    env = os.environ if environ is None else environ
    return env.get(ENV_SHM_DIR) or DEFAULT_SHM_DIR


def create_segment(size: int, directory: str) -> int:
    """Create the group's anonymous file of `size` bytes, all reserved; return its fd.

    Raises:
        SharedMemoryError: the directory has less than `size` bytes free (ENOSPC).
        OSError: anything else (the directory does not exist, ...).
    """
    try:
        fd = os.open(directory, os.O_TMPFILE | os.O_RDWR, 0o600)
    except OSError as exc:
        if exc.errno not in (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL):
            raise
        # A file system without O_TMPFILE: a memfd (unnamed as well, but it
        # counts against the memory cgroup, not against `directory`).
        fd = os.memfd_create("gradsync-local-group", os.MFD_CLOEXEC)
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as exc:
        os.close(fd)
        if exc.errno in (errno.ENOSPC, errno.ENOMEM, errno.EFBIG):
            raise SharedMemoryError(shortage_message(size, directory)) from exc
        raise
    return fd


def shortage_message(size: int, directory: str) -> str:
    """What a too small shared-memory directory is told: the numbers and the fixes."""
    try:
        free = f"{shutil.disk_usage(directory).free} bytes free"
    except OSError:
        free = "free space unknown"
    return (
        f"hierarchical aggregation needs {size} bytes of shared memory in {directory} "
        f"({free}); give it more (docker run --shm-size=..., a larger tmpfs), point "
        "$GRADSYNC_SHM_DIR at a tmpfs with room, or pass hierarchical=False"
    )


class Segment:
    """A mapped segment: numpy views of every member's slot and of the result region.

    Args:
        fd: the segment's file, owned from here on: kept open until `close`,
            so that a local leader can hand it to a coordinator on its host
            (`gradsync.local.hierarchy.register_segment`). It has no name: nothing
            outlives the job.
        layout: where the buckets lie.
    """

    def __init__(self, fd: int, layout: SegmentLayout) -> None:
        self.layout = layout
        self.fd: int | None = fd
        try:
            self._map: mmap.mmap | None = mmap.mmap(fd, layout.total_bytes, mmap.MAP_SHARED)
        except BaseException:
            os.close(fd)
            self.fd = None
            raise
        whole = np.frombuffer(self._map, dtype=np.uint8)
        offsets = layout.offsets
        #: [region][bucket] -> uint8 view; region `members` is the result.
        self.views: list[list[npt.NDArray[np.uint8]]] = [
            [
                whole[layout.region(index) + offset : layout.region(index) + offset + size]
                for offset, size in zip(offsets, layout.bucket_bytes, strict=True)
            ]
            for index in range(layout.members + 1)
        ]

    def slot(self, index: int, bucket_index: int) -> npt.NDArray[np.uint8]:
        """Member `index`'s copy of a bucket (bytes)."""
        return self.views[index][bucket_index]

    def result(self, bucket_index: int) -> npt.NDArray[np.uint8]:
        """A bucket's sum, then its averages (bytes)."""
        return self.views[self.layout.members][bucket_index]

    def result_offset(self, bucket_index: int) -> int:
        """Where a bucket's result (its sum, then its averages) lies in the file."""
        return self.layout.region(self.layout.members) + self.layout.offsets[bucket_index]

    def close(self) -> None:
        """Close the file and unmap, unless views are still held (then the GC unmaps it)."""
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
        self.views = []
        if self._map is not None:
            # A BucketBuffer of the transport may still hold a view: the GC unmaps then.
            with contextlib.suppress(BufferError):
                self._map.close()
            self._map = None


def share_range(num_elements: int, itemsize: int, members: int, share: int) -> tuple[int, int]:
    """Elements [lo, hi) of a bucket that local rank `share` sums (64-byte aligned cuts)."""
    step = ALIGN_BYTES // itemsize if itemsize < ALIGN_BYTES else 1
    per_share = -(-num_elements // members)
    per_share = -(-per_share // step) * step
    lo = min(num_elements, share * per_share)
    return lo, min(num_elements, lo + per_share)


#: Elements the last pass of `sum_share` writes and checks at a time (cache-sized).
_CHECK_BLOCK = 1 << 15


def sum_share(
    segment: Segment, bucket_index: int, dtype: int, share: int, covered: Sequence[int]
) -> tuple[int, ...]:
    """Sum share `share` of a bucket over the slots of `covered` (in that order) into the result.

    ((s0 + s1) + s2) + ...: local-rank order, so the bits do not depend on
    which rank finished first. numpy adds whole shares with `out=`, without
    holding the GIL for long.

    The last pass also checks what it wrote for NaN/Inf, block by block while the
    block is still in cache (a dot product of the block with itself is finite
    exactly when every element is, short of an overflow of huge values): the
    coordinator's --nonfinite policy can then name the member that produced one,
    not only the leader that uploads the group's sum. Only on a hit are the
    slots' shares read again, to find the culprits.

    Returns:
        The slots (of `covered`) whose share holds NaN or Inf; () almost always,
        and () too when finite values overflowed in the sum (nobody to blame).
    """
    numpy_dtype = np.dtype(LOCAL_DTYPES[dtype])
    result = segment.result(bucket_index).view(numpy_dtype)
    lo, hi = share_range(result.size, numpy_dtype.itemsize, segment.layout.members, share)
    if hi <= lo:
        return ()
    out = result[lo:hi]
    slots = [segment.slot(index, bucket_index).view(numpy_dtype)[lo:hi] for index in covered]
    finite = True
    # An overflow or inf - inf is not this sum's to report: the coordinator classifies it.
    with np.errstate(over="ignore", invalid="ignore"):
        partial = slots[0]
        for slot in slots[1:-1]:
            np.add(partial, slot, out=out)
            partial = out
        for start in range(0, out.size, _CHECK_BLOCK):
            block = slice(start, start + _CHECK_BLOCK)
            if len(slots) == 1:
                np.copyto(out[block], partial[block])
            else:
                np.add(partial[block], slots[-1][block], out=out[block])
            finite = finite and bool(np.isfinite(np.dot(out[block], out[block])))
    if finite:
        return ()
    return tuple(
        index for index, slot in zip(covered, slots, strict=True) if not np.isfinite(slot).all()
    )
