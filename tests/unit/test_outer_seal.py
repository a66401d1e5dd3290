"""The DiLoCo outer-state record sealed like a checkpoint, and judged against the leader's mark.

Pure logic and one real state folder: a record sealed under the outer-state key
decodes under that key and under no other; a record re-encoded by someone without
the key (the project's own encoder, an unkeyed SHA-256) is refused under it; with a
key every restore that is not of the newest acknowledged record of this run is
refused naming the store, the job, both rounds and `--fresh-start`, and without one
the same finding is an ERROR while the job goes on as documented; the key comes from
the shard token only where that is a durable secret the workers lack.
"""

from __future__ import annotations

import stat
from pathlib import Path

import numpy as np
import pytest
from gradsync_proto.auth import derive_key
from gradsync_proto.v1 import gradsync_pb2 as pb
from gradsync_server.config import CoordinatorConfig, Role
from gradsync_server.control import outer_resume
from gradsync_server.dataplane.outer import OuterState
from gradsync_server.dataplane.outer_snapshot import (
    OuterSnapshot,
    OuterSnapshotError,
    decode_snapshot,
    encode_snapshot,
    record_digest,
)
from gradsync_server.rpc.outer_records import outer_state_key
from gradsync_server.store.outer_marks import OuterMark, OuterMarks, judge

KEY = derive_key("the token", "outer-state")
OUTER = pb.OuterOptimizer(lr=0.7, momentum=0.9, nesterov=True)
BUCKETS = [pb.BucketSpec(parameter_indices=[0], dtype=pb.DTYPE_FLOAT32, num_elements=6, outer=True)]
SIGNATURE = pb.ModelSignature(buckets=BUCKETS, outer=OUTER)


def snapshot_at(step: int, run: str = "run-a", value: float = 1.0) -> OuterSnapshot:
    state = OuterState(OUTER, BUCKETS)
    state.run = run
    for number in range(step + 1):
        values = np.full(6, value + number, np.float32)
        state.answer(0, 0, pb.DTYPE_FLOAT32, values.data.cast("B"))
        state.commit()
    return state.snapshot("job", step)


def sealed(snapshot: OuterSnapshot, key: bytes | None = KEY) -> bytes:
    return b"".join(encode_snapshot(snapshot, key))


def forged(genuine: bytes) -> bytes:
    """What a store writer without the key makes of a genuine record: the parameters set
    to 42 and the momentum to 100, re-encoded with the project's own (unkeyed) encoder."""
    decoded = decode_snapshot(genuine, "job")
    parameters = {index: np.full_like(array, 42.0) for index, array in decoded.parameters.items()}
    momenta = {index: np.full_like(array, 100.0) for index, array in decoded.momenta.items()}
    fake = OuterSnapshot(
        "job", decoded.signature, decoded.step, decoded.rounds, parameters, momenta, decoded.run
    )
    return sealed(fake, None)


def mark_of(blob: bytes) -> OuterMark:
    snapshot = decode_snapshot(blob, "job")
    return OuterMark(snapshot.step, snapshot.rounds, record_digest([blob]), snapshot.run)


def decide(
    blob: bytes | None, key: bytes | None, mark: OuterMark | None = None
) -> outer_resume.OuterResume:
    reading = outer_resume.OuterReading(
        [(blob, "the store holds no outer state of job 'job'")],
        "file store /srv/store",
        "new-run",
        key,
        mark,
        "/state/high-water/x.json" if mark else "",
    )
    decision = outer_resume.decide("job", SIGNATURE, 1, reading, None)
    assert decision is not None
    return decision


def test_a_sealed_record_verifies_under_its_key_only() -> None:
    blob = sealed(snapshot_at(3))
    decoded = decode_snapshot(blob, "job", KEY)
    assert decoded.sealed and decoded.run == "run-a" and decoded.step == 3
    assert decoded.digest == record_digest([blob])
    with pytest.raises(OuterSnapshotError, match="fails its MAC"):
        decode_snapshot(blob, "job", derive_key("another token", "outer-state"))
    # Without a key nothing is authenticated: the record reads, unsealed as far as we know.
    assert not decode_snapshot(blob, "job").sealed
    with pytest.raises(OuterSnapshotError, match="carries no MAC"):
        decode_snapshot(sealed(snapshot_at(3), None), "job", KEY)


def test_a_forged_record_with_a_recomputed_hash_is_refused_under_the_key() -> None:
    genuine = sealed(snapshot_at(3))
    fake = forged(genuine)
    assert decode_snapshot(fake, "job").parameters[0][0] == 42.0  # the hash checks out
    with pytest.raises(OuterSnapshotError, match="carries no MAC"):
        decode_snapshot(fake, "job", KEY)
    # Flipping a byte of a sealed record's arrays and recomputing nothing fails too.
    damaged = bytearray(genuine)
    damaged[len(damaged) // 2] ^= 1
    with pytest.raises(OuterSnapshotError):
        decode_snapshot(bytes(damaged), "job", KEY)


def test_with_a_key_every_record_but_the_acknowledged_ones_is_refused_by_name() -> None:
    old, new = sealed(snapshot_at(2)), sealed(snapshot_at(3))
    mark = mark_of(new)
    restored = decide(new, KEY, mark)
    assert restored.snapshot is not None and restored.refusal is None and restored.run == "run-a"
    later = decide(sealed(snapshot_at(4)), KEY, mark)  # saved, then the mark was lost
    assert later.snapshot is not None and later.refusal is None
    cases = {
        "forged": (forged(new), "carries no MAC"),
        "rollback": (old, "older than round 3 (step 3"),
        "other run": (sealed(snapshot_at(3, run="run-b")), "another run of the job"),
        "emptied": (None, "the store holds no outer state"),
        "other job": (sealed(OuterSnapshot(**{**vars(snapshot_at(3)), "job_id": "x"})), "job 'x'"),
    }
    for name, (blob, why) in cases.items():
        decision = decide(blob, KEY, mark)
        assert decision.snapshot is None and decision.refusal is not None, name
        for words in (why, "job 'job'", "file store /srv/store", "--fresh-start", "round 3"):
            assert words in decision.refusal, (name, words, decision.refusal)
    rollback = decide(old, KEY, mark).refusal
    assert rollback is not None and "round 2 (step 2)" in rollback and "x.json" in rollback
    # Without a mark a forged record is refused all the same; a first start reseeds.
    assert decide(forged(new), KEY).refusal is not None
    first = decide(None, KEY)
    assert first.refusal is None and first.line.startswith("reseeded (") and first.run == "new-run"
    # A store that could not be read is no first start: with a token it refuses.
    outage = outer_resume.OuterReading(
        [(None, "reading it from the store failed: timed out")],
        "redis://store",
        "new-run",
        KEY,
        read_failed=True,
    )
    refused = outer_resume.decide("job", SIGNATURE, 1, outage, None)
    assert refused is not None and refused.refusal is not None
    assert "timed out" in refused.refusal and "--fresh-start" in refused.refusal


def test_without_a_key_a_finding_is_an_error_and_the_documented_fallback_stands() -> None:
    old, new = sealed(snapshot_at(2), None), sealed(snapshot_at(3), None)
    mark = mark_of(new)
    assert decide(new, None, mark).finding is None
    fake = decide(forged(new), None, mark)  # undetectable but for the mark's digest
    assert fake.refusal is None and fake.snapshot is not None
    assert fake.finding is not None and "rewritten since" in fake.finding
    assert "without a token nothing in the store is authenticated" in fake.finding
    back = decide(old, None, mark)
    assert back.snapshot is not None and back.finding is not None and "older than" in back.finding
    emptied = decide(None, None, mark)
    assert emptied.snapshot is None and emptied.line.startswith("reseeded (")
    assert emptied.finding is not None and "round 3 (step 3" in emptied.finding
    assert decide(None, None).finding is None  # a first start is no finding


def test_judge_accepts_the_mark_and_later_records_of_its_run_only() -> None:
    mark = OuterMark(5, 5, "ab" * 32, "run-a")
    assert judge(5, 5, "ab" * 32, "run-a", mark) is None
    assert judge(6, 6, "cd" * 32, "run-a", mark) is None
    assert judge(5, 5, "cd" * 32, "run-a", None) is None
    assert "rewritten" in (judge(5, 5, "cd" * 32, "run-a", mark) or "")
    assert "older" in (judge(4, 4, "ab" * 32, "run-a", mark) or "")
    assert "another run" in (judge(9, 9, "ab" * 32, "run-b", mark) or "")


def test_the_mark_round_trips_in_a_private_file(tmp_path: Path) -> None:
    marks = OuterMarks(tmp_path / "state")
    assert marks.read_outer("store", "job") is None
    mark = OuterMark(7, 6, "ef" * 32, "run-a")
    marks.write_outer("store", "job", mark)
    assert marks.read_outer("store", "job") == mark
    path = Path(marks.location("store", "job"))
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert marks.read("store", "job") is None  # apart from the checkpoints' mark
    marks.forget_outer("store", "job")
    assert marks.read_outer("store", "job") is None


def test_the_key_comes_from_the_shard_token_only_where_it_is_a_durable_separate_secret() -> None:
    def key(**options: object) -> bytes | None:
        return outer_state_key(CoordinatorConfig(**options))  # type: ignore[arg-type]

    by_token, by_shard = derive_key("tok", "outer-state"), derive_key("shard", "outer-state")
    assert key(world_size=2) is None
    assert key(world_size=2, token="tok") == by_token
    remote = {"world_size": 2, "token": "tok", "shard_token": "shard", "local_shards": False}
    assert key(**remote, shard_count=2) == by_shard
    shard = {"role": Role.SHARD, "leader": "127.0.0.1:1", "token": "tok", "shard_token": "shard"}
    assert key(**shard) == by_shard
    assert key(**shard, parent_pid=1) == by_token  # `serve --shards`' own child
    local = {"world_size": 2, "token": "tok", "shard_token": "shard", "local_shards": True}
    assert key(**local, shard_count=2) == by_token
    assert by_token != derive_key("tok", "checkpoint")
