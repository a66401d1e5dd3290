"""The raw-tensor state format and the donor's direct offer of it (`gradsync.control`).

A healing state comes from another process over a socket, so every size in
its header is a claim: these tests check a round trip keeps every tensor
bitwise and every container kind, and that a truncated, corrupted or
oversized header is refused, with a message, before anything is allocated.
The offer tests use a real loopback socket (no mocks).
"""

from __future__ import annotations

import json
import math
import struct

import pytest
import torch
from gradsync.control import heal_channel, raw_state
from gradsync.control.raw_state import MAGIC, BadRawState
from gradsync.control.state_load import load_module_state
from gradsync.errors import CheckpointMismatchError
from gradsync_proto import auth

LIMIT = 1 << 30


def _adam_state() -> dict[str, object]:
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(7, 5), torch.nn.BatchNorm1d(5))
    optimizer = torch.optim.Adam(module.parameters(), lr=1e-3)
    module(torch.randn(4, 7)).square().mean().backward()
    optimizer.step()
    return {
        "module": module.state_dict(),
        "optimizer": optimizer.state_dict(),
        "step": 17,
        "world_size": 3,
    }


def _blob(state: object) -> bytes:
    prefix, tensors = raw_state.encode(state)
    return prefix + b"".join(raw_state.tensor_bytes(t).tobytes() for t in tensors if t.numel())


def _assert_same(left: object, right: object) -> None:
    assert type(left) is type(right)
    if isinstance(left, torch.Tensor):
        assert isinstance(right, torch.Tensor)
        assert left.dtype == right.dtype and left.shape == right.shape
        assert torch.equal(left.reshape(-1).view(torch.uint8), right.reshape(-1).view(torch.uint8))
    elif isinstance(left, dict):
        assert isinstance(right, dict) and list(left) == list(right)
        assert getattr(left, "_metadata", None) == getattr(right, "_metadata", None)
        for key in left:
            _assert_same(left[key], right[key])
    elif isinstance(left, list | tuple):
        assert isinstance(right, list | tuple) and len(left) == len(right)
        for a, b in zip(left, right, strict=True):
            _assert_same(a, b)
    elif isinstance(left, float) and math.isnan(left):
        assert isinstance(right, float) and math.isnan(right)
    else:
        assert left == right


def test_a_round_trip_keeps_every_tensor_bitwise_and_every_container_kind() -> None:
    state = _adam_state()
    extra = {
        "odd": [None, True, 3, -0.0, float("nan"), "s", (1, 2)],
        5: torch.empty(0, 3),
        "scalar": torch.tensor(2.5, dtype=torch.bfloat16),
        "ints": torch.arange(6, dtype=torch.int64).reshape(2, 3),
        "flags": torch.tensor([True, False]),
    }
    state["extra"] = extra
    back = raw_state.decode(_blob(state), LIMIT)
    _assert_same(state, back)
    # Adam's int state keys and tuple betas survive (load_state_dict needs them).
    assert all(isinstance(k, int) for k in back["optimizer"]["state"])  # type: ignore[index]
    assert back["optimizer"]["param_groups"][0]["betas"] == (0.9, 0.999)  # type: ignore[index]


def test_a_state_of_anything_else_is_refused_when_written() -> None:
    with pytest.raises(TypeError, match="cannot hold a object"):
        raw_state.encode({"x": object()})


def _with_header(header: dict[str, object], body: bytes = b"") -> bytes:
    raw = json.dumps(header).encode()
    return MAGIC + struct.pack("<Q", len(raw)) + raw + body


def test_a_truncated_blob_is_refused() -> None:
    blob = _blob(_adam_state())
    with pytest.raises(BadRawState, match="not a gradsync raw state"):
        raw_state.decode(blob[:10], LIMIT)
    with pytest.raises(BadRawState, match="truncated"):
        raw_state.decode(blob[: raw_state.PREFIX_BYTES + 5], LIMIT)
    with pytest.raises(BadRawState, match="its body has"):
        raw_state.decode(blob[:-1], LIMIT)


def test_a_corrupted_header_is_refused_with_what_is_wrong() -> None:
    one = {"dtype": "float32", "shape": [2], "offset": 0, "nbytes": 8}
    cases = [
        (b"NOTMAGIC" + bytes(8), "not a gradsync raw state"),
        (MAGIC + struct.pack("<Q", 3) + b"{{{", "not valid"),
        (
            _with_header({"tree": {"t": 0}, "tensors": [{**one, "dtype": "object"}], "total": 8}),
            "unknown dtype",
        ),
        (
            _with_header({"tree": {"t": 0}, "tensors": [{**one, "nbytes": 4}], "total": 4}),
            "claims 4 bytes",
        ),
        (
            _with_header({"tree": {"t": 0}, "tensors": [{**one, "offset": 8}], "total": 8}),
            "starts at byte 8",
        ),
        (
            _with_header({"tree": {"t": 0}, "tensors": [{**one, "shape": [-2]}], "total": 8}),
            "malformed shape",
        ),
        (_with_header({"tree": {"t": 0}, "tensors": [one], "total": 9}), "claims 9"),
        (
            _with_header({"tree": {"t": 1}, "tensors": [one], "total": 8}, bytes(8)),
            "tree is malformed",
        ),
        (_with_header({"tree": {"x": 1}, "tensors": [], "total": 0}), "tree is malformed"),
        (_with_header({"tree": {"v": [1]}, "tensors": [], "total": 0}), "tree is malformed"),
    ]
    for blob, message in cases:
        with pytest.raises(BadRawState, match=message):
            raw_state.decode(blob, LIMIT)


def test_oversized_claims_are_refused_before_anything_is_allocated() -> None:
    huge = {"dtype": "float32", "shape": [1 << 40], "offset": 0, "nbytes": 4 << 40}
    with pytest.raises(BadRawState, match="at most 1073741824 are accepted here"):
        raw_state.decode(
            _with_header({"tree": {"t": 0}, "tensors": [huge], "total": 4 << 40}), LIMIT
        )
    with pytest.raises(BadRawState, match="header claims"):
        raw_state.decode(MAGIC + struct.pack("<Q", 1 << 40), LIMIT)
    deep: object = {"v": 0}
    for _ in range(100):
        deep = {"l": [deep]}
    with pytest.raises(BadRawState, match="64 levels"):
        raw_state.decode(_with_header({"tree": deep, "tensors": [], "total": 0}), LIMIT)


def test_an_offer_is_read_bitwise_over_loopback_and_again_from_its_snapshot() -> None:
    state = _adam_state()
    offer = heal_channel.StateOffer(state, serve_s=30.0)
    try:
        blob = offer.offer()
        assert heal_channel.is_offer(blob) and len(blob) < heal_channel.MAX_OFFER_BYTES
        _assert_same(state, heal_channel.fetch(blob, LIMIT, timeout_s=30.0))
        assert offer.settle(wait_s=5.0)  # the first joiner has read it
        live = state["module"]["0.weight"]  # type: ignore[index]
        expected = live.clone()
        live.add_(1.0)  # the donor trains on: a later joiner gets the snapshot
        again = heal_channel.fetch(blob, LIMIT, timeout_s=30.0)
        assert torch.equal(again["module"]["0.weight"], expected)
    finally:
        offer.close()


def test_an_offer_is_refused_with_a_wrong_token_another_socket_or_too_little_room() -> None:
    offer = heal_channel.StateOffer(_adam_state(), serve_s=30.0)
    try:
        fields = json.loads(offer.offer()[len(heal_channel.OFFER_MAGIC) :])
        forged = {**fields, "token": "00" * 32}
        with pytest.raises(heal_channel.HealChannelError, match="closed after 0"):
            heal_channel.fetch(heal_channel.OFFER_MAGIC + json.dumps(forged).encode(), LIMIT, 10.0)
        foreign = {**fields, "socket": "/tmp/elsewhere"}
        with pytest.raises(heal_channel.HealChannelError, match="only a gradsync heal socket"):
            heal_channel.fetch(heal_channel.OFFER_MAGIC + json.dumps(foreign).encode(), LIMIT, 10.0)
        # Served by another process than the one the offer names: the token is not sent.
        impostor = {**fields, "pid": fields["pid"] + 1}
        with pytest.raises(heal_channel.HealChannelError, match="not the donor the offer names"):
            heal_channel.fetch(
                heal_channel.OFFER_MAGIC + json.dumps(impostor).encode(), LIMIT, 10.0
            )
        with pytest.raises(heal_channel.HealChannelError, match="are accepted here"):
            heal_channel.fetch(offer.offer(), 16, 10.0)
        with pytest.raises(heal_channel.HealChannelError, match="not a heal offer"):
            heal_channel.fetch(b"x" * 10, LIMIT, 10.0)
    finally:
        offer.close()
    # Closed: nothing listens any more.
    with pytest.raises(heal_channel.HealChannelError):
        heal_channel.fetch(offer.offer(), LIMIT, 5.0)


def test_loopback_addresses_are_told_apart_from_remote_ones() -> None:
    for address in ("127.0.0.1:50051", "localhost:1", "[::1]:5", "127.3.4.5"):
        assert auth.is_loopback(address), address
    for address in ("10.0.0.1:50051", "example.org:1", "0.0.0.0:5"):
        assert not auth.is_loopback(address), address


def test_a_joiner_whose_donor_is_gone_gets_a_clear_error_naming_job_rank_and_step() -> None:
    offer = heal_channel.StateOffer(_adam_state(), serve_s=30.0)
    blob = offer.offer()
    offer.close()  # the donor is gone before the joiner comes
    module = torch.nn.Sequential(torch.nn.Linear(7, 5), torch.nn.BatchNorm1d(5))
    with pytest.raises(CheckpointMismatchError, match="rank 2 could not read a live rank's state"):
        load_module_state(blob, module, "job-a", 2, 9, timeout_s=5.0)


def test_a_shape_of_zero_bytes_with_a_huge_dimension_is_a_mismatch_naming_the_tensor() -> None:
    # [2**70, 0] claims 0 bytes; torch cannot even make such a tensor.
    empty = {"dtype": "float32", "shape": [2**70, 0], "offset": 0, "nbytes": 0}
    blob = _with_header(
        {"tree": {"d": [[{"v": "module"}, {"t": 0}]]}, "tensors": [empty], "total": 0}
    )
    module = torch.nn.Linear(3, 2)
    with pytest.raises(CheckpointMismatchError, match=r"tensor 0 claims the shape \[1180591620"):
        load_module_state(blob, module, "job-a", 1, 4)
    many = {"dtype": "uint8", "shape": [1] * (raw_state.MAX_DIMS + 1), "offset": 0, "nbytes": 1}
    with pytest.raises(BadRawState, match=f"at most {raw_state.MAX_DIMS} are accepted"):
        raw_state.decode(_with_header({"tree": {"t": 0}, "tensors": [many], "total": 1}), LIMIT)
    none = {"dtype": "uint8", "shape": [0], "offset": 0, "nbytes": 0}
    crowd = [none] * (raw_state.MAX_TENSORS + 1)
    header = json.dumps({"tree": {"v": 0}, "tensors": crowd, "total": 0}, separators=(",", ":"))
    assert len(header) < raw_state.MAX_HEADER_BYTES  # the header's own cap lets it through
    with pytest.raises(BadRawState, match=f"at most {raw_state.MAX_TENSORS} are accepted"):
        raw_state.parse_header(header.encode(), LIMIT)


def test_an_allocation_torch_refuses_is_a_bad_raw_state_naming_the_tensor() -> None:
    # Within a (huge) limit, so only the allocation itself can fail: 32 TiB.
    entry = {"dtype": "float32", "shape": [1 << 43], "offset": 0, "nbytes": 4 << 43}
    header = json.dumps({"tree": {"t": 0}, "tensors": [entry], "total": 4 << 43}).encode()
    layout = raw_state.parse_header(header, 1 << 50)
    with pytest.raises(
        BadRawState, match=r"tensor 0 \(torch.float32 x \[8796093022208\].*allocated"
    ):
        raw_state.read_tensors(layout, lambda target: None)
