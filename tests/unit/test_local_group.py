"""Hierarchical aggregation's pure parts: host ids, the segment layout, shares, the sum order.

The group itself (sockets, processes, tmpfs) is exercised in
tests/multiprocess/test_local_group_processes.py.
"""

from __future__ import annotations

import os
import socket

import numpy as np
import pytest
import torch
from gradsync.local.hierarchy import check_hierarchical
from gradsync.local.local_group import LocalGroup
from gradsync.local.local_rendezvous import Kind, frame, parse, socket_name
from gradsync.local.local_segment import (
    ALIGN_BYTES,
    Segment,
    SegmentLayout,
    share_range,
    shortage_message,
    sum_share,
)
from gradsync_proto.host import host_id
from gradsync_proto.v1 import gradsync_pb2 as pb


def test_host_id_override_and_computed_form() -> None:
    assert host_id({"GRADSYNC_HOST_ID": "node-7"}) == "node-7"
    computed = host_id({})
    hostname, digest = computed.rsplit("/", 1)
    assert hostname and len(digest) == 16
    assert host_id({}) == computed  # stable within one process
    with pytest.raises(ValueError, match="256"):
        host_id({"GRADSYNC_HOST_ID": "x" * 257})


def test_layout_aligns_every_bucket_and_region() -> None:
    layout = SegmentLayout((10, 0, 130, 4), members=3)
    assert all(offset % ALIGN_BYTES == 0 for offset in layout.offsets)
    assert layout.slot_bytes == 64 + 0 + 192 + 64
    assert layout.total_bytes >= 4 * layout.slot_bytes
    assert layout.region(3) == 3 * layout.slot_bytes  # the result region follows the slots


@pytest.mark.parametrize("num_elements", [0, 1, 15, 16, 17, 1000, 4099])
@pytest.mark.parametrize("members", [2, 3, 8])
@pytest.mark.parametrize("itemsize", [4, 8])
def test_shares_cover_every_element_once_on_aligned_cuts(
    num_elements: int, members: int, itemsize: int
) -> None:
    covered = []
    for share in range(members):
        lo, hi = share_range(num_elements, itemsize, members, share)
        assert (lo * itemsize) % ALIGN_BYTES == 0 or lo == num_elements
        covered.extend(range(lo, hi))
    assert covered == list(range(num_elements))


def test_messages_round_trip() -> None:
    raw = frame(Kind.REDUCE, 3, 2**40, 7, b"\x01\x00\x02\x00")
    assert parse(raw) == (Kind.REDUCE, 3, 2**40, 7, b"\x01\x00\x02\x00")


def test_socket_name_is_abstract_and_depends_on_job_and_secret() -> None:
    name = socket_name("job", b"s" * 32)
    assert name.startswith(b"\0gradsync-")
    assert name != socket_name("job", b"t" * 32)
    assert name != socket_name("other", b"s" * 32)


def test_shortage_message_names_size_directory_and_fixes(tmp_path: object) -> None:
    text = shortage_message(123456789, str(tmp_path))
    for needle in ("123456789 bytes", str(tmp_path), "--shm-size", "GRADSYNC_SHM_DIR", "False"):
        assert needle in text


def test_hierarchical_needs_full_precision_buckets_and_no_wire_dtype(
    caplog: pytest.LogCaptureFixture,
) -> None:
    assert check_hierarchical("auto", [torch.float32, torch.float64], None) is True
    assert check_hierarchical(False, [torch.float32], None) is False
    assert check_hierarchical("auto", [torch.float16], None) is False
    assert check_hierarchical("auto", [torch.float32], torch.bfloat16) is False
    with pytest.raises(ValueError, match="hierarchical=False"):
        check_hierarchical(True, [torch.float32], torch.float16)
    with pytest.raises(ValueError, match="float16"):
        check_hierarchical(True, [torch.float16], None)
    with pytest.raises(ValueError, match="'auto', True or False"):
        check_hierarchical("yes", [torch.float32], None)


def test_local_sum_order_is_local_rank_order() -> None:
    # The reference every group test compares with, bit for bit: ((s0 + s1) + s2).
    rng = np.random.default_rng(1)
    slots = [rng.standard_normal(1000).astype(np.float32) * 10.0**k for k in range(3)]
    ordered = (slots[0] + slots[1]) + slots[2]
    assert not np.array_equal(ordered, (slots[2] + slots[1]) + slots[0])


def _segment(members: int, elements: int, dtype: type[np.floating]) -> Segment:
    layout = SegmentLayout((elements * np.dtype(dtype).itemsize,), members)
    fd = os.memfd_create("gradsync-test")
    os.ftruncate(fd, layout.total_bytes)
    return Segment(fd, layout)


@pytest.mark.parametrize("members", [1, 2, 3, 5])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_sum_share_keeps_the_order_and_names_the_slots_that_held_nan_or_inf(
    members: int, dtype: type[np.floating]
) -> None:
    # More elements than one check block, so that the hit lies in a later block.
    elements = 3 * 40_000 + 7
    segment = _segment(members, elements, dtype)
    code = pb.DTYPE_FLOAT32 if dtype is np.float32 else pb.DTYPE_FLOAT64
    rng = np.random.default_rng(members)
    grads = [rng.standard_normal(elements).astype(dtype) for _ in range(members)]
    poisoned = {members - 1: float("nan")} if members == 1 else {1: float("inf"), 0: float("nan")}
    for slot, value in poisoned.items():
        grads[slot][elements - 3] = value  # the last share, past the first block
    for slot, grad in enumerate(grads):
        segment.slot(slot, 0).view(dtype)[:] = grad
    covered = list(range(members))
    found: set[int] = set()
    for share in range(members):
        found.update(sum_share(segment, 0, code, share, covered))
    assert found == set(poisoned)
    expected = grads[0].copy()
    for grad in grads[1:]:
        expected += grad
    np.testing.assert_array_equal(segment.result(0).view(dtype), expected)  # NaN == NaN here
    # Clean gradients name nobody; finite values that overflow in the sum name nobody either.
    big = np.full(elements, np.finfo(dtype).max / 1.5, dtype=dtype)
    for slot in range(members):
        segment.slot(slot, 0).view(dtype)[:] = big if members > 1 else 0.0
    assert all(sum_share(segment, 0, code, share, covered) == () for share in range(members))
    segment.close()


def test_a_frozen_member_that_wakes_excluded_sums_nothing_still_queued() -> None:
    # What a SIGSTOPped follower finds when SIGCONT wakes it: a REDUCE sent while it was
    # frozen, the leader's EXCLUDED (it summed that share itself), then EOF.
    elements = 1000
    segment = _segment(2, elements, np.float32)
    segment.slot(0, 0).view(np.float32)[:] = 1.0
    segment.slot(1, 0).view(np.float32)[:] = 2.0
    segment.result(0).view(np.float32)[:] = 7.0  # the leader's later use of the region
    leader, follower = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    covered = np.array([0, 1], np.uint16).tobytes()
    leader.send(frame(Kind.REDUCE, 0, 3, pb.DTYPE_FLOAT32, covered))
    leader.send(frame(Kind.EXCLUDED))
    leader.shutdown(socket.SHUT_RDWR)
    group = LocalGroup(1, [0, 1], segment.layout, segment, {0: follower}, None, 0.25)
    group._thread.join(5)
    assert not group._thread.is_alive()
    np.testing.assert_array_equal(segment.result(0).view(np.float32), 7.0)
    assert "excluded" in group._lost[0]
    group.close()
    leader.close()
