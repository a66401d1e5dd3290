"""Hierarchical aggregation's pure parts: host ids, the segment layout, shares, the sum order.

The group itself (sockets, processes, tmpfs) is exercised in
tests/multiprocess/test_local_group_processes.py.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gradsync.hierarchy import check_hierarchical
from gradsync.host_identity import host_id
from gradsync.local_rendezvous import Kind, frame, parse, socket_name
from gradsync.local_segment import ALIGN_BYTES, SegmentLayout, share_range, shortage_message


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
