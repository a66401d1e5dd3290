"""A group's all-reduce spread over a sharded coordinator: the range split, and the
spread result against one coordinator's, with no sockets.

Two ranks' `ShardRoutes` send their ranges to the coordinator's real pure logic:
range 0 to a `Collectives` (the leader's), range 1 to a shard's `ShardCollectives`;
the results come back as the streams would hand them over. The spread result must
be bitwise the unspread one, whatever rank arrives first; a shard stream that
fails fails the pending range at once naming the shard's address; a range that
never comes back fails within the timeout. A shard follows the leader's members
(a range waiting only for a dropped rank completes) and frees an ended job's bytes.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
from gradsync.control.worker_messages import CollectiveUpload
from gradsync.distributed.shard_routes import MIN_SPREAD_BYTES, ShardRoutes, spread_ranges
from gradsync.errors import GradSyncError, ShardUnavailableError
from gradsync.path.signature import WIRE_DTYPES
from gradsync_proto.chunking import shard_ranges
from gradsync_proto.v1 import gradsync_pb2 as pb
from gradsync_server.control.collectives import Collectives as ServerCollectives
from gradsync_server.dataplane.actions import Send
from gradsync_server.dataplane.budget import ByteBudget
from gradsync_server.rpc.shard_collectives import ShardCollectives


def sent_message(message: pb.CoordinatorMessage | bytes) -> pb.CoordinatorMessage:
    """A Send's message (a result chunk travels encoded once for all its ranks)."""
    return pb.CoordinatorMessage.FromString(message) if isinstance(message, bytes) else message


WORLD, CHUNK = 2, 1 << 20
OPS = {"sum": pb.COLLECTIVE_OP_SUM, "avg": pb.COLLECTIVE_OP_AVG, "max": pb.COLLECTIVE_OP_MAX}
JOB = "j.pg-world"


def test_spread_ranges_cut_large_all_reduces_like_the_wrappers_buckets() -> None:
    numel = MIN_SPREAD_BYTES // 4
    assert spread_ranges(numel - 1, 4, 2) is None  # too small: whole on the leader
    assert spread_ranges(numel, 4, 1) is None  # not sharded
    assert spread_ranges(3, MIN_SPREAD_BYTES, 4) is None  # fewer elements than shards
    for shards in (2, 3, 5):
        ranges = spread_ranges(numel + 7, 4, shards)
        assert ranges == shard_ranges(numel + 7, shards)
        assert ranges is not None and ranges[0][0] == 0 and ranges[-1][1] == numel + 7
        assert all(a[1] == b[0] for a, b in itertools.pairwise(ranges))
        lengths = [stop - start for start, stop in ranges]
        assert lengths == sorted(lengths, reverse=True) and lengths[0] - lengths[-1] <= 1


class Hub:
    """The coordinator's leader range and one shard, as pure logic; results are handed
    to each rank as its streams would."""

    def __init__(self) -> None:
        budget = ByteBudget(1 << 30)
        self.leader = ServerCollectives(WORLD, CHUNK, 1 << 28, budget.for_owner(JOB))
        self.shard = ShardCollectives(1 << 28, budget)
        view = pb.ShardJobView(job_id=JOB, world_size=WORLD, chunk_bytes=CHUNK, shard_count=2)
        view.members.extend(pb.ShardMember(rank=r) for r in range(WORLD))
        self.shard.follow(view)
        self.routes: dict[int, ShardRoutes] = {}
        self.leader_results: dict[tuple[int, int], pb.CollectiveChunk] = {}
        self.ready: dict[int, list[Callable[[], None]]] = {}

    def deliver_leader(self, actions: list[Any]) -> None:
        for action in actions:
            assert isinstance(action, Send)
            for rank in action.ranks:
                chunk = sent_message(action.message).collective
                self.leader_results[rank, chunk.sequence] = chunk
                for hook in self.ready.pop(rank * 1000 + chunk.sequence, []):
                    hook()

    def deliver_shard(self, actions: list[Any]) -> None:
        for action in actions:
            assert isinstance(action, Send)
            for rank in action.ranks:
                self.routes[rank]._on_chunk(1, sent_message(action.message).collective)


class LeaderRange:
    """A rank's `Collectives` for range 0: its input goes to the hub's leader logic."""

    def __init__(self, hub: Hub, rank: int) -> None:
        self.hub, self.rank, self.next = hub, rank, 0

    def start_all_reduce(
        self, tensor: torch.Tensor, op: str, on_ready: Callable[[], None] | None = None
    ) -> Callable[[], int]:
        sequence, self.next = self.next, self.next + 1
        if on_ready is not None:
            self.hub.ready.setdefault(self.rank * 1000 + sequence, []).append(on_ready)
        payload = tensor.contiguous().view(torch.uint8).numpy().tobytes()
        chunk = pb.CollectiveChunk(
            sequence=sequence,
            op=OPS[op],  # type: ignore[arg-type]
            dtype=WIRE_DTYPES[tensor.dtype],  # type: ignore[arg-type]
            total_bytes=len(payload),
            payload=payload,
        )
        self.hub.deliver_leader(self.hub.leader.accept(self.rank, chunk, range(WORLD)))

        def finish() -> int:
            result = self.hub.leader_results.pop((self.rank, sequence))
            if result.error:
                raise GradSyncError(result.error)
            values = torch.frombuffer(bytearray(result.payload), dtype=tensor.dtype)
            tensor.copy_(values)
            return int(result.contributors)

        return finish


class ShardLink:
    """A rank's transport as the routes use it: ranges go to the hub's shard."""

    def __init__(self, hub: Hub, rank: int, answer: bool = True) -> None:
        self.hub, self.rank, self.answer = hub, rank, answer
        self.on_shard_collective: Any = None
        self.on_shard_failed: Any = None

    def send_to_shard(self, index: int, upload: CollectiveUpload) -> None:
        assert index == 1
        if self.answer:
            chunk = upload.message(0, bytes(upload.data())).collective
            self.hub.deliver_shard(self.hub.shard.accept(JOB, self.rank, chunk))


def spread(
    hub: Hub, inputs: list[torch.Tensor], op: str, order: list[int], timeout_s: float = 5.0
) -> list[torch.Tensor]:
    """All-reduce `inputs` (one per rank) spread over the hub, ranks issuing in `order`."""
    finishes: dict[int, Callable[[], int]] = {}
    told: list[int] = []
    for rank in order:
        link = ShardLink(hub, rank)
        routes = hub.routes[rank] = ShardRoutes(
            lambda link=link: link,  # type: ignore[misc]
            2,
            rank,
            WORLD,
            CHUNK,
            timeout_s,
        )
        ranges = spread_ranges(inputs[rank].numel(), inputs[rank].element_size(), 2)
        assert ranges is not None
        leader = LeaderRange(hub, rank)
        finishes[rank] = routes.start_all_reduce(
            leader,  # type: ignore[arg-type]
            inputs[rank],
            op,
            ranges,
            on_ready=lambda rank=rank: told.append(rank),  # type: ignore[misc]
        )
    assert sorted(told) == list(range(WORLD))  # every range in: each rank was told once
    assert [finishes[rank]() for rank in range(WORLD)] == [WORLD, WORLD]
    for rank in range(WORLD):
        assert hub.routes[rank].ranges_sent == 1
    return inputs


@pytest.mark.parametrize("op", ["sum", "avg", "max"])
@pytest.mark.parametrize("order", [[0, 1], [1, 0]], ids=["rank0-first", "rank1-first"])
def test_a_spread_all_reduce_is_bitwise_the_unspread_one(op: str, order: list[int]) -> None:
    generator = torch.Generator().manual_seed(3)
    inputs = [torch.randn(MIN_SPREAD_BYTES // 4 + 5, generator=generator) for _ in range(WORLD)]
    whole = [t.clone() for t in inputs]  # one coordinator: the whole tensor on the leader
    unsharded = Hub()
    finishes = [LeaderRange(unsharded, r).start_all_reduce(whole[r], op) for r in range(WORLD)]
    assert [finish() for finish in finishes] == [WORLD, WORLD]
    spread_results = spread(Hub(), [t.clone() for t in inputs], op, order)
    for rank in range(WORLD):
        assert spread_results[rank].numpy().tobytes() == whole[rank].numpy().tobytes()
    assert not torch.equal(whole[0], inputs[0])  # (it did reduce)


def test_a_failed_shard_stream_fails_the_pending_range_naming_the_shard_at_once() -> None:
    hub = Hub()
    link = ShardLink(hub, 0, answer=False)
    routes = hub.routes[0] = ShardRoutes(lambda: link, 2, 0, WORLD, CHUNK, timeout_s=30.0)
    tensor = torch.ones(MIN_SPREAD_BYTES // 4)
    ranges = spread_ranges(tensor.numel(), 4, 2)
    assert ranges is not None
    leader = LeaderRange(hub, 0)
    told: list[str] = []
    finish = routes.start_all_reduce(leader, tensor, "sum", ranges, lambda: told.append("ready"))  # type: ignore[arg-type]
    other = LeaderRange(hub, 1)
    other.start_all_reduce(torch.ones(len(tensor) // 2), "sum")  # range 0 completes
    link.on_shard_failed(
        ShardUnavailableError(
            "the data stream to shard 1 at 10.0.0.7:50052 failed: UNAVAILABLE: killed",
            shard_index=1,
            shard_address="10.0.0.7:50052",
        )
    )
    assert told == ["ready"]
    started = time.monotonic()
    with pytest.raises(
        GradSyncError,
        match=r"range 1 \(elements 8192..16384\) on shard 1: .*"
        r"shard 1 at 10.0.0.7:50052 failed",
    ):
        finish()
    assert time.monotonic() - started < 1.0
    later = routes.start_all_reduce(leader, tensor, "sum", ranges)  # type: ignore[arg-type]
    other.start_all_reduce(torch.ones(len(tensor) // 2), "sum")
    with pytest.raises(GradSyncError, match=r"shard 1 at 10\.0\.0\.7:50052"):  # fails at once too
        later()


def test_a_range_that_never_comes_back_fails_within_the_timeout() -> None:
    hub = Hub()
    link = ShardLink(hub, 0, answer=False)
    routes = hub.routes[0] = ShardRoutes(lambda: link, 2, 0, WORLD, CHUNK, timeout_s=0.3)
    tensor = torch.ones(MIN_SPREAD_BYTES // 4)
    ranges = spread_ranges(tensor.numel(), 4, 2)
    assert ranges is not None
    finish = routes.start_all_reduce(LeaderRange(hub, 0), tensor, "sum", ranges)  # type: ignore[arg-type]
    LeaderRange(hub, 1).start_all_reduce(torch.ones(len(tensor) // 2), "sum")
    started = time.monotonic()
    with pytest.raises(TimeoutError, match=r"range 1 .* on shard 1 .* within 0\.3 s"):
        finish()
    assert time.monotonic() - started < 2.0


def shard_view(world: int, members: range) -> pb.ShardJobView:
    view = pb.ShardJobView(job_id=JOB, world_size=world, chunk_bytes=CHUNK, shard_count=2)
    view.members.extend(pb.ShardMember(rank=r) for r in members)
    return view


def test_a_shard_follows_the_leaders_members_and_frees_an_ended_jobs_bytes() -> None:
    budget = ByteBudget(1 << 30)
    shard = ShardCollectives(1 << 28, budget)
    assert shard.follow(shard_view(3, range(3))) == [] and shard.knows(JOB)

    def chunk(sequence: int, value: float) -> pb.CollectiveChunk:
        payload = torch.full((2,), value).numpy().tobytes()
        return pb.CollectiveChunk(
            sequence=sequence,
            op=pb.COLLECTIVE_OP_SUM,
            dtype=WIRE_DTYPES[torch.float32],  # type: ignore[arg-type]
            total_bytes=len(payload),
            payload=payload,
        )

    assert shard.accept(JOB, 0, chunk(0, 1.0)) == []
    assert shard.accept(JOB, 1, chunk(0, 2.0)) == []  # rank 2 still to come
    assert budget.held_by(JOB) == 16
    # The leader drops rank 2: the range completes over the ranks that sent theirs.
    (sent,) = shard.follow(shard_view(3, range(2)))
    assert isinstance(sent, Send) and tuple(sent.ranks) == (0, 1)
    assert sent_message(sent.message).collective.contributors == 2
    assert torch.frombuffer(
        bytearray(sent_message(sent.message).collective.payload), dtype=torch.float32
    ).tolist() == [3.0, 3.0]
    assert shard.accept(JOB, 0, chunk(1, 1.0)) == [] and budget.held_by(JOB) == 8
    shard.forget(JOB)  # the job ended at the leader: its bytes go back
    assert budget.held_by(JOB) == 0 and not shard.knows(JOB)
