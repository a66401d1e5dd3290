"""The durable DiLoCo outer state: its record format, its restore, its replay, its atomic file.

Pure logic against references: a record decodes to what was encoded and any
damage is refused by name; the layout signature changes with every setting
that gives the arrays their meaning; a restored `OuterState` replays its
committed step (answering the stored parameters whatever arrives, applying
nothing) and then continues bitwise as the state that never stopped; the
control plane restores only a record of this job's layout and says why not
otherwise; the file store writes the record atomically (temp file, fsync,
rename, fsync of the folder) and leaves no temp file behind.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from gradsync_proto import chunking
from gradsync_proto.v1 import gradsync_pb2 as pb
from gradsync_server.control import outer_resume
from gradsync_server.dataplane.outer import OuterState
from gradsync_server.dataplane.outer_snapshot import (
    OuterSnapshot,
    OuterSnapshotError,
    decode_snapshot,
    encode_snapshot,
    layout_signature,
    record_name,
)
from gradsync_server.store.checkpoint_file import FileCheckpointStore

ELEMENTS = 10
OUTER = pb.OuterOptimizer(lr=0.7, momentum=0.9, nesterov=True)


def decide(
    signature: pb.ModelSignature,
    shard_count: int,
    records: list[tuple[bytes | None, str]] | None,
    checkpoint_step: int | None,
    **reading: Any,
) -> outer_resume.OuterResume | None:
    """`outer_resume.decide` for job "job" on what a store held (`records`, None: no store)."""
    read = None
    if records is not None:
        read = outer_resume.OuterReading(records, "the store", "new-run", **reading)
    return outer_resume.decide("job", signature, shard_count, read, checkpoint_step)


def buckets() -> list[pb.BucketSpec]:
    return [
        pb.BucketSpec(
            parameter_indices=[0], dtype=pb.DTYPE_FLOAT32, num_elements=ELEMENTS, outer=True
        ),
        pb.BucketSpec(parameter_indices=[1], dtype=pb.DTYPE_FLOAT32, num_elements=3, outer=True),
    ]


def floats(values: np.ndarray) -> memoryview:
    return values.astype("<f4").data.cast("B")


def step(state: OuterState, values: list[np.ndarray]) -> list[np.ndarray]:
    """One whole step (every bucket in one chunk): the answers, then commit."""
    answers = [
        np.frombuffer(state.answer(index, 0, pb.DTYPE_FLOAT32, floats(v)), "<f4").copy()
        for index, v in enumerate(values)
    ]
    state.commit()
    return answers


def sample(rng: np.random.Generator) -> list[np.ndarray]:
    return [rng.standard_normal(ELEMENTS).astype(np.float32), rng.standard_normal(3)]


def trained(rounds: int, seed: int = 5) -> tuple[OuterState, np.random.Generator]:
    state = OuterState(OUTER, buckets())
    rng = np.random.default_rng(seed)
    step(state, sample(rng))  # the seed
    for _ in range(rounds):
        step(state, sample(rng))
    return state, rng


def test_a_record_decodes_to_what_was_encoded() -> None:
    state, _ = trained(3)
    snapshot = state.snapshot("job-a", 3)
    decoded = decode_snapshot(b"".join(encode_snapshot(snapshot)), "job-a")
    assert (decoded.job_id, decoded.step, decoded.rounds) == ("job-a", 3, 3)
    assert decoded.signature == state.signature
    for arrays, original in (
        (decoded.parameters, snapshot.parameters),
        (decoded.momenta, snapshot.momenta),
    ):
        assert sorted(arrays) == [0, 1]
        for index in arrays:
            np.testing.assert_array_equal(arrays[index], original[index])
            assert arrays[index].flags.writeable  # the restored plane updates them in place
    assert np.abs(decoded.momenta[0]).max() > 0  # the momentum really travels


@pytest.mark.parametrize("where", ["magic", "header", "array", "digest"])
def test_every_damaged_byte_is_refused_naming_the_job(where: str) -> None:
    state, _ = trained(1)
    blob = bytearray(b"".join(encode_snapshot(state.snapshot("job-a", 1))))
    position = {"magic": 0, "header": 20, "array": len(blob) - 40, "digest": len(blob) - 1}[where]
    blob[position] ^= 0x01
    with pytest.raises(OuterSnapshotError, match="job 'job-a'"):
        decode_snapshot(bytes(blob), "job-a")


def test_a_torn_record_and_another_jobs_record_are_refused() -> None:
    state, _ = trained(1)
    blob = b"".join(encode_snapshot(state.snapshot("job-a", 1)))
    with pytest.raises(OuterSnapshotError, match="torn"):
        decode_snapshot(blob[: len(blob) // 2], "job-a")
    with pytest.raises(OuterSnapshotError, match="SHA-256"):
        decode_snapshot(blob[:-3], "job-a")
    with pytest.raises(OuterSnapshotError, match="belongs to job 'job-a'"):
        decode_snapshot(blob, "job-b")
    with pytest.raises(OuterSnapshotError, match="not an outer-state record"):
        decode_snapshot(b"", "job-a")


def test_the_layout_signature_changes_with_every_setting_that_shapes_the_arrays() -> None:
    base = layout_signature(OUTER, buckets(), 1, 0)
    assert base == layout_signature(
        pb.OuterOptimizer(lr=0.7, momentum=0.9, nesterov=True), buckets(), 1, 0
    )
    other_lr = layout_signature(
        pb.OuterOptimizer(lr=0.5, momentum=0.9, nesterov=True), buckets(), 1, 0
    )
    bigger = buckets()
    bigger[1].num_elements = 4
    variants = {
        other_lr,
        layout_signature(OUTER, bigger, 1, 0),
        layout_signature(OUTER, buckets(), 2, 0),
        layout_signature(OUTER, buckets(), 2, 1),
    }
    assert base not in variants and len(variants) == 4
    assert record_name(0) != record_name(1) and ":" not in record_name(3)


def test_a_restored_state_replays_its_step_then_continues_as_if_never_stopped() -> None:
    reference, rng = trained(3)
    snapshot = reference.snapshot("job", 3)
    blob = b"".join(encode_snapshot(snapshot))
    stored = [p.copy() for p in (snapshot.parameters[0], snapshot.parameters[1])]
    restored = OuterState(OUTER, buckets())
    restored.restore(decode_snapshot(blob, "job"))
    assert restored.seeded and restored.replaying and restored.rounds == 3
    # The replay: whatever arrives (a rank's parameters, garbage), the stored answer.
    answers = [
        np.frombuffer(restored.answer(i, 0, pb.DTYPE_FLOAT32, floats(v * 1e3)), "<f4").copy()
        for i, v in enumerate(sample(np.random.default_rng(9)))
    ]
    for got, want in zip(answers, stored, strict=True):
        np.testing.assert_array_equal(got, want)
    assert restored.commit() is False  # nothing to save: nothing changed
    assert not restored.replaying and restored.rounds == 3
    for _ in range(3):  # later rounds: bitwise the state that never stopped
        values = sample(rng)
        for got, want in zip(step(restored, values), step(reference, values), strict=True):
            np.testing.assert_array_equal(got, want)
    assert restored.rounds == reference.rounds == 6


def test_an_aborted_replay_stays_due_and_a_record_of_another_layout_is_not_restored() -> None:
    state, _ = trained(1)
    snapshot = state.snapshot("job", 1)
    restored = OuterState(OUTER, buckets())
    restored.restore(snapshot)
    restored.discard()
    assert restored.replaying
    other = OuterState(pb.OuterOptimizer(lr=0.5, momentum=0.9, nesterov=True), buckets())
    with pytest.raises(ValueError, match="layout"):
        other.restore(snapshot)
    wrong = OuterSnapshot("job", state.signature, 1, 1, {0: np.zeros(2, np.float32)}, {})
    with pytest.raises(ValueError, match="bucket 0"):
        OuterState(OUTER, buckets()).restore(wrong)


def test_the_control_plane_restores_only_this_layouts_records_and_says_which() -> None:
    signature = pb.ModelSignature(buckets=buckets(), outer=OUTER)
    state, _ = trained(2)
    blob = b"".join(encode_snapshot(state.snapshot("job", 2)))
    restored = decide(signature, 1, [(blob, "")], None)
    assert restored is not None and restored.snapshot is not None
    assert restored.line.startswith("restored round 2 (step 2) from the store")
    other = pb.ModelSignature(buckets=buckets(), outer=pb.OuterOptimizer(lr=0.1, momentum=0.9))
    lines = {
        "mismatch": decide(other, 1, [(blob, "")], None),
        "empty": decide(signature, 1, [(None, "the store holds none")], None),
        "torn": decide(signature, 1, [(blob[:-3], "")], None),
        "checkpoint": decide(signature, 1, [(blob, "")], 40),
        "no store": decide(signature, 1, None, None),
    }
    for name, decision in lines.items():
        assert decision is not None and decision.snapshot is None, name
        assert decision.line.startswith("reseeded ("), name
    assert "another model, outer optimizer or shard count" in lines["mismatch"].line
    assert "the store holds none" in lines["empty"].line
    assert "SHA-256" in lines["torn"].line
    assert "checkpoint of step 40" in lines["checkpoint"].line
    assert decide(pb.ModelSignature(buckets=buckets()), 1, None, None) is None


def sharded_record(shard_index: int, step: int) -> bytes:
    state = OuterState(OUTER, buckets(), 2, shard_index)
    rng = np.random.default_rng(shard_index)
    ranges = [chunking.shard_ranges(b.num_elements, 2)[shard_index] for b in buckets()]
    for _ in range(step + 1):  # the seed, then outer steps, on this shard's ranges
        for index, (lo, hi) in enumerate(ranges):
            values = rng.standard_normal(hi - lo)
            state.answer(index, lo * 4, pb.DTYPE_FLOAT32, floats(values))
        state.commit()
    return b"".join(encode_snapshot(state.snapshot("job", step)))


def test_sharded_planes_restore_when_their_records_hold_one_step_or_two_consecutive() -> None:
    signature = pb.ModelSignature(buckets=buckets(), outer=OUTER)
    both = [(sharded_record(0, 3), ""), (sharded_record(1, 3), "")]
    restored = decide(signature, 2, both, None)
    assert restored is not None and restored.snapshot is not None
    assert (restored.start_step, restored.replay, restored.repeat) == (3, True, False)
    assert "(2 planes)" in restored.line and "step 3 is replayed" in restored.line
    # Killed between the two planes' saves of step 3: step 3 is uploaded again, the plane
    # that saved it replays it, the other runs it as an outer step.
    for leader, shard in ((3, 2), (2, 3)):
        records = [(sharded_record(0, leader), ""), (sharded_record(1, shard), "")]
        apart = decide(signature, 2, records, None)
        assert apart is not None and apart.snapshot is not None and apart.repeat
        assert apart.start_step == 3 and apart.replay is (leader == 3)
        assert "the shards saved steps [2, 3]: step 3 is uploaded again" in apart.line
    cases = {
        "far apart": [(sharded_record(0, 3), ""), (sharded_record(1, 1), "")],
        "missing": [(sharded_record(0, 3), ""), (None, "no record")],
        "swapped": [(sharded_record(1, 3), ""), (sharded_record(0, 3), "")],
        "short": [(sharded_record(0, 3), "")],
    }
    for name, records in cases.items():
        decision = decide(signature, 2, records, None)
        assert decision is not None and decision.snapshot is None, name
        assert decision.line.startswith("reseeded ("), name
    far = decide(signature, 2, cases["far apart"], None)
    missing = decide(signature, 2, cases["missing"], None)
    assert far is not None and "hold steps [1, 3]" in far.line
    assert missing is not None and "shard 1: no record" in missing.line


def test_a_plane_restored_one_step_behind_runs_the_open_step_as_an_outer_step() -> None:
    reference, rng = trained(2)
    behind = OuterState(OUTER, buckets())
    stored = b"".join(encode_snapshot(reference.snapshot("job", 2)))
    behind.restore(decode_snapshot(stored, "job"), replay=False)
    assert not behind.replaying
    values = sample(rng)
    for got, want in zip(step(behind, values), step(reference, values), strict=True):
        np.testing.assert_array_equal(got, want)
    assert behind.rounds == reference.rounds == 3


def test_the_file_store_writes_a_record_atomically_and_durably(tmp_path: Path) -> None:
    synced: list[str] = []

    def fsync(descriptor: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{descriptor}"))
        os.fsync(descriptor)

    store = FileCheckpointStore(tmp_path / "store", fsync=fsync)
    assert store.load_record("job/a", record_name(0)) is None
    store.save_record("job/a", record_name(0), [b"first ", b"record"])
    store.save_record("job/a", record_name(0), [b"second"])
    assert store.load_record("job/a", record_name(0)) == b"second"
    job_dir = store.job_directory("job/a")
    assert sorted(os.listdir(job_dir)) == [record_name(0)]  # no temp file left, no checkpoint
    assert store.steps("job/a") == []  # a record is not a checkpoint
    # Each save: the temp file's bytes, then the folder's entry after the rename.
    temp = [path for path in synced if Path(path).name.startswith(f".{record_name(0)}.")]
    assert len(temp) == 2 and synced.count(str(job_dir)) >= 2
    assert synced.index(str(job_dir), synced.index(temp[0])) > synced.index(temp[0])
    assert (job_dir / record_name(0)).stat().st_mode & 0o077 == 0  # readable by its owner only
