"""Buffers sized by what arrives, never by what a peer declares (issue 11), and budget shares."""

from __future__ import annotations

import pytest
from gradsync.control.inbox import Inbox
from gradsync.control.inbox_state import state_bytes
from gradsync.errors import GradSyncError
from gradsync_proto.v1 import gradsync_pb2 as pb
from gradsync_server.control.persistence import Persistence
from gradsync_server.dataplane.budget import ByteBudget
from gradsync_server.dataplane.uploads import BlobAssembler
from gradsync_server.errors import RejectedMessage
from support.rawclient import signature

GIB = 1 << 30


def test_an_upload_holds_only_the_bytes_that_arrived_and_counts_them() -> None:
    budget = ByteBudget(1 << 20)
    view = budget.for_owner("job")
    assembler = BlobAssembler("blob", GIB, 4096, (2 * GIB, "--max-checkpoint-mb"), view)
    assert not assembler.add(0, bytes(4096))
    assert (assembler.received, budget.held_by("job")) == (4096, 4096)
    with pytest.raises(RejectedMessage, match="arrived twice"):
        assembler.add(0, bytes(4096))
    with pytest.raises(RejectedMessage, match="before the one at offset 4096"):
        assembler.add(8192, bytes(4096))
    assembler.release()
    assert budget.used == 0


def test_a_declared_size_beyond_the_cap_is_refused_before_anything_is_held() -> None:
    with pytest.raises(RejectedMessage, match=r"declares 2147483648 bytes.*max-checkpoint-mb"):
        BlobAssembler("checkpoint", 2 * GIB, 4096, (GIB, "--max-checkpoint-mb"))


def test_an_upload_beyond_the_jobs_share_is_refused_and_given_back() -> None:
    budget = ByteBudget(4 * 4096)  # each job may hold half: 8192 bytes
    persistence = Persistence(4096, GIB, budget.for_owner("job"))
    for offset in (0, 4096):
        chunk = pb.CheckpointChunk(step=1, offset=offset, total_bytes=8 * 4096, payload=bytes(4096))
        assert persistence.on_upload_chunk(chunk) is None
    assert budget.held_by("job") == 8192
    third = pb.CheckpointChunk(step=1, offset=8192, total_bytes=8 * 4096, payload=bytes(4096))
    with pytest.raises(RejectedMessage, match="no room for 4096 more bytes"):
        persistence.on_upload_chunk(third)
    assert budget.used == 0, "a refused upload kept its bytes"


def test_a_job_share_leaves_the_rest_to_the_others() -> None:
    budget = ByteBudget(100)
    hog, other = budget.for_owner("hog"), budget.for_owner("other")
    hog.reserve().hold(50)
    assert not hog.fits(1) and (hog.used, hog.limit) == (50, 50)
    assert other.fits(50) and not other.fits(51)
    with pytest.raises(ValueError, match="per-owner limit"):
        ByteBudget(10, owner_limit=11)


def _join() -> pb.Join:
    return pb.Join(job_id="job", rank=1, world_size=2, signature=signature())


def _welcome(**fields: object) -> bytes:
    welcome = pb.Welcome(
        job_id="job",
        world_size=2,
        chunk_bytes=4096,
        max_message_bytes=4096 + (64 << 10),
        heartbeat_interval_s=0.5,
        state_bytes=state_bytes(signature()),
    )
    for name, value in fields.items():
        if name == "shards":
            welcome.shards.extend(value)  # type: ignore[arg-type]
        else:
            setattr(welcome, name, value)
    return pb.CoordinatorMessage(welcome=welcome).SerializeToString()


@pytest.mark.parametrize(
    ("fields", "needle"),
    [
        ({"world_size": 3}, "Welcome.world_size = 3"),
        ({"state_bytes": 2 * GIB}, "Welcome.state_bytes = 2147483648"),
        ({"chunk_bytes": 128 << 20}, "Welcome.chunk_bytes = 134217728"),
        ({"max_message_bytes": 10}, "Welcome.max_message_bytes = 10"),
        ({"heartbeat_interval_s": float("nan")}, "Welcome.heartbeat_interval_s = nan"),
        ({"heartbeat_interval_s": 1e9}, "Welcome.heartbeat_interval_s = 1000000000.0"),
        ({"start_step": 1 << 60}, "Welcome.start_step"),
        ({"resume_bytes": 64 * GIB}, "Welcome.resume_bytes = 68719476736"),
        ({"job_id": "other"}, "Welcome.job_id = 'other'"),
        (
            {"shards": [pb.ShardAddress(index=0), pb.ShardAddress(index=1, address="no port")]},
            "Welcome.shards.address = 'no port'",
        ),
    ],
)
def test_every_welcome_field_is_checked_before_it_is_trusted(
    fields: dict[str, object], needle: str
) -> None:
    inbox = Inbox("127.0.0.1:1", rank=1)
    inbox.expect(_join())
    inbox.on_message(_welcome(**fields))
    with pytest.raises(GradSyncError, match="invalid message") as raised:
        inbox.wait_welcome(timeout_s=1)
    assert needle in str(raised.value)


def test_state_and_resume_buffers_grow_with_what_arrives() -> None:
    inbox = Inbox("127.0.0.1:1", rank=1)
    inbox.expect(_join())
    inbox.on_message(_welcome(resume_bytes=10))
    assert inbox.wait_welcome(timeout_s=1).state_bytes == 8328
    state = inbox._shared.state
    assert state is not None and state.received == 0, "the state buffer was allocated up front"
    first = pb.StateChunk(offset=0, payload=b"a" * 4096)
    inbox.on_message(pb.CoordinatorMessage(state=first).SerializeToString())
    assert (state.received, state.total_bytes) == (4096, 8328)
    resume = pb.CheckpointChunk(step=0, offset=0, total_bytes=GIB, payload=b"abc")
    inbox.on_message(pb.CoordinatorMessage(resume=resume).SerializeToString())
    with pytest.raises(GradSyncError, match=r"10 bytes announced in Welcome\.resume_bytes"):
        inbox.receive_resume(10, timeout_s=1)
