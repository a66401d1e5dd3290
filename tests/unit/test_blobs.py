"""The one chunked blob of both ends: cut by `blob_chunks`, reassembled by `BlobAssembly`.

Checkpoints, healing state, resume downloads, the state broadcast and
collective inputs and results all travel this way, so the rule is tested
once here: every offset and length checked, duplicates and overflow refused,
the declared size only a claim (memory follows the bytes that arrived), and
on the coordinator the bytes held counted in its budget until released.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
from gradsync_proto.blobs import BadChunk, BlobAssembly, blob_chunks
from gradsync_proto.codes import Code
from gradsync_proto.v1 import gradsync_pb2 as pb
from gradsync_server.control.persistence import Persistence
from gradsync_server.dataplane.budget import ByteBudget
from gradsync_server.dataplane.uploads import BlobAssembler
from gradsync_server.errors import RejectedMessage

GIB = 1 << 30


def test_a_blob_is_cut_by_the_wire_rule_and_an_empty_one_as_asked() -> None:
    blob = bytes(range(10))
    assert list(blob_chunks(blob, 4)) == [(0, blob[:4]), (4, blob[4:8]), (8, blob[8:])]
    array = np.frombuffer(blob, dtype=np.uint8)
    assert list(blob_chunks(array.data, 4)) == list(blob_chunks(blob, 4))
    assert list(blob_chunks(b"", 4)) == []
    assert list(blob_chunks(b"", 4, empty_chunk=True)) == [(0, b"")]


@pytest.mark.parametrize("seed", range(4))
def test_chunks_in_any_order_reassemble_the_blob(seed: int) -> None:
    blob = random.Random(seed).randbytes(4 * 10 + 3)
    chunks = list(blob_chunks(blob, 4))
    random.Random(seed).shuffle(chunks)
    assembly = BlobAssembly("blob", len(blob), 4, in_order=False)
    done = [assembly.add(offset, payload) for offset, payload in chunks]
    assert done == [False] * (len(chunks) - 1) + [True]
    assert assembly.received == len(blob) and bytes(assembly.blob()) == blob


def test_in_order_refuses_a_chunk_ahead_and_names_both_offsets() -> None:
    assembly = BlobAssembly("checkpoint of step 5 from rank 0", 12, 4)
    assembly.add(0, b"abcd")
    with pytest.raises(BadChunk, match="offset 8 arrived before the one at offset 4") as bad:
        assembly.add(8, b"ijkl")
    assert bad.value.code is Code.INVALID_ARGUMENT
    assert bad.value.message.startswith("checkpoint of step 5 from rank 0: ")
    assert assembly.received == 4, "a refused chunk was kept"


@pytest.mark.parametrize("in_order", [True, False])
def test_a_chunk_twice_is_refused(in_order: bool) -> None:
    assembly = BlobAssembly("blob", 12, 4, in_order=in_order)
    assembly.add(0, b"abcd")
    if not in_order:
        assembly.add(8, b"ijkl")
    for offset in (0, 8) if not in_order else (0,):
        with pytest.raises(BadChunk, match=f"offset {offset} arrived twice"):
            assembly.add(offset, b"abcd")
    assert assembly.chunks_received == (1 if in_order else 2)


@pytest.mark.parametrize(
    ("offset", "payload", "code", "needle"),
    [
        (12, b"mn", Code.INVALID_ARGUMENT, "offset 12 is out of range or misaligned"),
        (2, b"cdef", Code.INVALID_ARGUMENT, "multiples of 4 below 10"),
        (8, b"ijk", Code.INVALID_ARGUMENT, "3 bytes at offset 8, expected 2"),
        (4, b"efg", Code.INVALID_ARGUMENT, "3 bytes at offset 4, expected 4"),
        (0, b"abcde", Code.RESOURCE_EXHAUSTED, "5 bytes in one chunk at offset 0; the chunk limit"),
    ],
)
def test_overflow_misplaced_and_misshapen_chunks_are_refused(
    offset: int, payload: bytes, code: Code, needle: str
) -> None:
    assembly = BlobAssembly("blob", 10, 4, in_order=False)
    with pytest.raises(BadChunk, match=needle) as bad:
        assembly.add(offset, payload)
    assert bad.value.code is code and assembly.received == 0


def test_the_code_of_an_oversized_chunk_is_the_receivers_choice() -> None:
    assembly = BlobAssembly("blob", 10, 4, oversize=Code.INVALID_ARGUMENT)
    with pytest.raises(BadChunk) as bad:
        assembly.add(0, b"abcde")
    assert bad.value.code is Code.INVALID_ARGUMENT


def test_the_declared_size_is_a_claim_memory_follows_what_arrived() -> None:
    assembly = BlobAssembly("blob", 2 * GIB, 4096, in_order=False)
    assembly.add(GIB, bytes(4096))  # a chunk far ahead is held apart, not zero-filled up to it
    assert assembly.received == 4096 and not assembly.complete
    assert assembly.missing_offsets()[:2] == [0, 4096]
    with pytest.raises(ValueError, match="incomplete"):
        assembly.blob()
    assembly.release()


def test_an_empty_blob_is_one_empty_chunk_or_none() -> None:
    one = BlobAssembly("input", 0, 4, in_order=False)
    assert not one.complete and one.missing_offsets() == [0]
    with pytest.raises(BadChunk, match="declared empty"):
        one.add(0, b"x")
    assert one.add(0, b"") and bytes(one.blob()) == b""
    with pytest.raises(BadChunk, match="arrived twice"):
        one.add(0, b"")
    none = BlobAssembly("state", 0, 4, empty_chunk=False)
    assert none.complete and none.chunks_expected == 0
    with pytest.raises(BadChunk, match="out of range"):
        none.add(0, b"")


def test_a_relay_counts_chunks_and_keeps_no_bytes() -> None:
    relay = BlobAssembly("rank 0's state", 10, 4, in_order=False, keep=False)
    relay.add(8, b"ij")
    relay.add(0, b"abcd")
    assert relay.add(4, b"efgh") and relay.received == 10
    assert bytes(relay.blob()) == b""


def test_the_coordinator_counts_what_it_holds_and_gives_it_back() -> None:
    budget = ByteBudget(1 << 20)
    view = budget.for_owner("job")
    assembler = BlobAssembler("input", 12, 4, None, view, in_order=False)
    assembler.add(8, b"ijkl")
    assert budget.held_by("job") == 4
    assembler.add(0, b"abcd")
    assert assembler.add(4, b"efgh") and budget.held_by("job") == 12
    assert assembler.blob() == b"abcdefghijkl" and budget.used == 0
    refused = BlobAssembler("input", 12, 4, None, view)
    refused.add(0, b"abcd")
    with pytest.raises(RejectedMessage, match="arrived before the one at offset 4"):
        refused.add(8, b"ijkl")
    assert budget.held_by("job") == 4
    refused.release()
    refused.release()  # idempotent
    assert budget.used == 0


def test_the_coordinator_refuses_beyond_its_cap_and_its_budget() -> None:
    with pytest.raises(RejectedMessage, match=r"declares 9 bytes.*at most 8 \(--flag\)") as big:
        BlobAssembler("blob from rank 2", 9, 4, (8, "--flag"))
    assert big.value.code is Code.RESOURCE_EXHAUSTED
    budget = ByteBudget(8, owner_limit=6)
    assembler = BlobAssembler("blob from rank 2", 12, 4, None, budget.for_owner("job"))
    assembler.add(0, b"abcd")
    with pytest.raises(RejectedMessage, match="no room for 4 more bytes at offset 4") as full:
        assembler.add(4, b"efgh")
    assert full.value.code is Code.RESOURCE_EXHAUSTED and "rank 2" in full.value.message
    assert budget.used == 4
    assembler.release()
    assert budget.used == 0


def test_a_chunk_claiming_another_size_is_refused_naming_both_sizes() -> None:
    assembly = BlobAssembly("the result", 8, 4, in_order=False)
    assembly.add(0, b"abcd", 8)
    with pytest.raises(BadChunk, match="the result: the chunk at offset 4 claims 12 bytes in all"):
        assembly.add(4, b"efgh", 12)
    budget = ByteBudget(1 << 20)
    persistence = Persistence(4, GIB, budget.for_owner("job"))
    persistence.on_upload_chunk(
        pb.CheckpointChunk(step=5, offset=0, total_bytes=8, payload=b"ab" * 2)
    )
    changed = pb.CheckpointChunk(step=5, offset=4, total_bytes=12, payload=b"efgh")
    with pytest.raises(RejectedMessage) as refused:
        persistence.on_upload_chunk(changed)
    assert refused.value.code is Code.INVALID_ARGUMENT
    assert refused.value.message == (
        "checkpoint of step 5 from rank 0: the chunk at offset 4 claims 12 bytes in all, not 8"
    )
    assert budget.used == 0, "an abandoned upload kept its bytes"
