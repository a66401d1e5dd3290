"""A process group's host group with threads as ranks: real sockets, a real shared segment.

Three ranks of one "host" form their host group through a real c10d store
(`torch.distributed.HashStore`), the abstract-socket rendezvous and one
shared segment; a stand-in for the coordinator's link records what reaches
it and answers each upload with the leader's input (the only one of a host).
The members' inputs reach the coordinator only inside their leader's sum; a
mismatch fails every rank naming both values; a segment that cannot be made
leaves each rank a host group of one.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
from gradsync.distributed.host_group import HostGroup, form_host_group, resolve_hierarchical
from gradsync.errors import GradSyncError

WORLD = 3


class Hub:
    """The coordinator's side for one host: each upload is the whole group's input."""

    def __init__(self) -> None:
        self.uploads: list[tuple[int, list[int], np.ndarray]] = []
        self.lock = threading.Lock()


class Link:
    """One rank's link to the `Hub` (what `HostGroup` uses of `ResumingLink`)."""

    def __init__(self, hub: Hub) -> None:
        self.hub = hub
        self.next = 0
        self.carried: list[int] = []
        self.results: dict[int, tuple[bytearray, int]] = {}
        self.on_lost: Callable[[str], None] | None = None

    def reserve_collective(self, *, carried: bool) -> int:
        self.next += 1
        if carried:
            self.carried.append(self.next - 1)
        return self.next - 1

    def issue_collective(self, op: int, dtype: int, payload: Any, root: int, **fields: Any) -> int:
        covered = list(fields["template"].covered_ranks)
        with self.hub.lock:
            self.hub.uploads.append((fields["sequence"], covered, payload.copy()))
        self.results[fields["sequence"]] = (bytearray(payload.tobytes()), len(covered))
        fields["on_ready"]()
        return int(fields["sequence"])

    def wait_collective(self, sequence: int, timeout_s: float) -> tuple[bytearray, int]:
        return self.results.pop(sequence)

    def reconnect(self, why: str) -> None:
        pass


def form(store: Any, hub: Hub) -> list[HostGroup | None]:
    groups: list[HostGroup | None] = [None] * WORLD

    def one(rank: int) -> None:
        groups[rank] = form_host_group(
            store, rank, WORLD, "job.pg-world", "auto", Link(hub), 8, 10.0
        )

    threads = [threading.Thread(target=one, args=(rank,)) for rank in range(WORLD)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    return groups


def run(groups: list[HostGroup], inputs: list[torch.Tensor], op: str) -> list[Any]:
    """Every rank's all-reduce of its input, on a thread of its own: its result or error."""
    out: list[Any] = [None] * WORLD

    def one(rank: int) -> None:
        ready = threading.Event()
        try:
            finish = groups[rank].start(inputs[rank], op, ready.set)
            assert ready.wait(10)
            out[rank] = (finish(), inputs[rank].clone())
        except GradSyncError as exc:
            out[rank] = exc

    threads = [threading.Thread(target=one, args=(rank,)) for rank in range(WORLD)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    return out


def test_a_host_sums_in_shared_memory_and_only_its_leader_uploads() -> None:
    hub = Hub()
    groups = form(dist.HashStore(), hub)
    try:
        assert all(g is not None and g.members == [0, 1, 2] for g in groups)
        live = [g for g in groups if g is not None]
        rng = np.random.default_rng(5)
        values = [torch.from_numpy(rng.standard_normal(1000).astype(np.float32)) for _ in range(3)]
        for op in ("sum", "avg", "max"):
            inputs = [v.clone() for v in values]
            out = run(live, inputs, op)
            flat = (values[0] + values[1]) + values[2]  # the coordinator's order
            if op == "avg":
                flat = flat / WORLD
            if op == "max":
                flat = torch.maximum(torch.maximum(values[0], values[1]), values[2])
            for rank in range(WORLD):
                count, result = out[rank]
                assert count == WORLD
                assert torch.equal(result, flat), (op, rank)
        # One upload per all-reduce, from rank 0, covering the host; the others sent none.
        assert [(s, c) for s, c, _ in hub.uploads] == [
            (0, [0, 1, 2]),
            (1, [0, 1, 2]),
            (2, [0, 1, 2]),
        ]
        assert (
            hub.uploads[0][2].view(np.float32).tolist()
            == ((values[0] + values[1]) + values[2]).tolist()
        )
        assert live[0].uploaded_bytes == 3 * 4000 and live[1].uploaded_bytes == 0
        # An all-reduce above the old 4 MiB regions: each rank reserves what it holds, 6 MiB
        # (the leader its result block), and every block is given back once copied out.
        big = [torch.full((3 << 19,), float(r + 1)) for r in range(WORLD)]
        out = run(live, big, "sum")
        assert all(torch.equal(result, torch.full((3 << 19,), 6.0)) for _, result in out)
        assert [g.reserved_bytes for g in live] == [6 << 20] * WORLD
        deadline = time.monotonic() + 5
        while any(g._arena.live for g in live if g._arena) and time.monotonic() < deadline:
            time.sleep(0.01)  # (the leader frees its result block on the members' DONE)
        assert [g._arena.live for g in live if g._arena] == [0] * WORLD
        hub.uploads.pop()
        # A mismatch fails every rank, naming both.
        out = run(live, [torch.ones(2), torch.ones(3), torch.ones(2)], "sum")
        for rank in range(WORLD):
            assert isinstance(out[rank], GradSyncError), out[rank]
            assert (
                "local rank 1 issued collective 4 as all_reduce sum of 3 float32 (12 bytes)"
                in str(out[rank])
            )
            assert "rank 0 issued collective 4 as all_reduce sum of 2 float32 (8 bytes)" in str(
                out[rank]
            )
        assert len(hub.uploads) == 3
    finally:
        for group in groups:
            if group is not None:
                group.close()


def test_without_the_shared_segment_each_rank_is_a_host_group_of_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("GRADSYNC_SHM_DIR", str(tmp_path / "missing"))
    hub = Hub()
    groups = form(dist.HashStore(), hub)
    try:
        assert [g.members if g else None for g in groups] == [[0], [1], [2]]
        live = [g for g in groups if g is not None]
        out = run(live, [torch.full((4,), float(r)) for r in range(WORLD)], "sum")
        assert sorted(c for _, c, _ in hub.uploads) == [[0], [1], [2]]
        assert all(count == 1 for count, _ in out)
    finally:
        for group in groups:
            if group is not None:
                group.close()


def test_the_setting_and_what_goes_through_a_host_group() -> None:
    assert resolve_hierarchical(None, {}) == "auto"
    assert resolve_hierarchical(None, {"GRADSYNC_HIERARCHICAL": "0"}) == "off"
    assert resolve_hierarchical(True) == "on" and resolve_hierarchical("false") == "off"
    with pytest.raises(ValueError, match="GRADSYNC_HIERARCHICAL='maybe'"):
        resolve_hierarchical(None, {"GRADSYNC_HIERARCHICAL": "maybe"})
    assert HostGroup.takes(torch.ones(4), "avg") and HostGroup.takes(
        torch.ones(4, dtype=torch.float64), "min"
    )
    assert not HostGroup.takes(torch.ones(4, dtype=torch.int32), "sum")
    assert not HostGroup.takes(torch.ones(4, dtype=torch.bfloat16), "sum")
    assert not HostGroup.takes(torch.ones(4), "product")
    assert HostGroup.takes(torch.empty(25 << 18), "sum")  # DDP's 25 MiB bucket
    assert not HostGroup.takes(torch.empty((16 << 20) + 1), "sum")  # over 64 MiB: flat
