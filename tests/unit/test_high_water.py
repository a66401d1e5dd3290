"""The high-water mark: the pure judgement of a store's answer, and the file that keeps it.

`judge` is fed hand-made `StoreReading`s (no store): each rule of
`gradsync_server.store.high_water` is one case, the legitimate histories it must accept
(a save whose mark was lost in a crash, a run after --fresh-start, a leftover of a save
that never completed) next to the rollbacks it must report. The mark file is written to
tmp_path for real.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest
from gradsync_server.config import CoordinatorConfig
from gradsync_server.store.checkpoint import (
    Checkpoint,
    CheckpointHeader,
    Skipped,
    StoreReading,
    blob_digest,
    decode,
    encode,
)
from gradsync_server.store.high_water import HighWater, Lineage, judge, previous_of, refusal
from gradsync_server.store.high_water_file import (
    HighWaterError,
    HighWaterMarks,
    default_state_dir,
)

RUN = "run-a"
OTHER_RUN = "run-b"


def header(step: int, lineage: Lineage | None = None, payload: bytes = b"") -> CheckpointHeader:
    metadata = {"world_size": "1", **(lineage or Lineage(RUN)).metadata()}
    payload = payload or f"state before step {step}".encode()
    return Checkpoint("job", step, 0, payload, metadata).header


def checkpoint(step: int, lineage: Lineage | None = None) -> Checkpoint:
    metadata = {"world_size": "1", **(lineage or Lineage(RUN)).metadata()}
    return Checkpoint("job", step, 0, f"state before step {step}".encode(), metadata)


def reading(
    found: Checkpoint | None,
    pointer: int | None = None,
    skipped: tuple[Skipped, ...] = (),
    beyond: tuple[CheckpointHeader, ...] = (),
) -> StoreReading:
    if pointer is None and found is not None:
        pointer = found.step
    return StoreReading("job", pointer, found, skipped, beyond)


def always(_: CheckpointHeader) -> bool:
    return True


def never(_: CheckpointHeader) -> bool:
    return False


# ------------------------------------------------------------------ digests and lineage
def test_the_blob_digest_is_the_blobs_checksum_and_survives_a_round_trip() -> None:
    saved = checkpoint(3, Lineage(RUN, HighWater(2, "ab" * 32, RUN)))
    blob = encode(saved)
    assert blob_digest(saved.header) == blob[-32:].hex()
    loaded = decode(blob)
    assert blob_digest(loaded.header) == blob_digest(saved.header)
    assert loaded.payload_sha256 == saved.payload_sha256
    assert HighWater.of(loaded.header) == HighWater(3, blob[-32:].hex(), RUN)


def test_the_lineage_names_the_run_and_the_mark_before() -> None:
    mark = HighWater(2, "cd" * 32, RUN)
    assert Lineage(RUN).metadata() == {"timeline": RUN}
    assert previous_of(header(3, Lineage(RUN, mark))) == (2, "cd" * 32)
    assert previous_of(header(3)) is None
    forged = Checkpoint("job", 3, 0, b"x", {"previous_step": "-1", "previous_sha256": "x"})
    assert previous_of(forged.header) is None  # not a step number: no claim at all
    after = Lineage(RUN).after(HighWater.of(header(4)))
    assert after.timeline == RUN and after.previous == HighWater.of(header(4))


# ------------------------------------------------------------------ judge: accepted histories
def test_the_marked_checkpoint_itself_is_accepted() -> None:
    three = checkpoint(3)
    assert judge(reading(three), HighWater.of(three.header), always) is None
    assert judge(reading(three), None, always) is None  # no mark, nothing skipped


def test_a_newer_checkpoint_of_the_same_run_is_accepted() -> None:
    """The mark lags (its writes failed, or another host continued the run)."""
    assert judge(reading(checkpoint(7)), HighWater.of(header(3)), always) is None


def test_the_save_after_the_mark_is_accepted_even_from_a_new_run() -> None:
    """Acknowledged by the store, then a crash before its mark was written: it records the
    mark as its previous one. Here the run after a --fresh-start, whose step is lower."""
    old_mark = HighWater.of(header(50))
    restarted = checkpoint(2, Lineage(OTHER_RUN, old_mark))
    assert judge(reading(restarted), old_mark, always) is None


def test_a_leftover_beyond_the_pointer_that_follows_it_is_no_evidence() -> None:
    """A save of step 4 wrote its blob and crashed before the pointer flip."""
    three = checkpoint(3)
    leftover = header(4, Lineage(RUN, HighWater.of(three.header)))
    assert judge(reading(three, beyond=(leftover,)), None, always) is None


def test_another_runs_leftovers_and_unauthenticated_ones_are_no_evidence() -> None:
    """A --fresh-start keeps the abandoned run's newer checkpoints (its pruning guard)."""
    two = checkpoint(2, Lineage(OTHER_RUN))
    old = header(50, Lineage(RUN, HighWater.of(header(48))))
    assert judge(reading(two, beyond=(old,)), None, always) is None
    same_run = header(50, Lineage(OTHER_RUN, HighWater.of(header(48))))
    assert judge(reading(two, beyond=(same_run,)), None, never) is None  # no valid MAC


# ------------------------------------------------------------------ judge: rollbacks
def test_a_checkpoint_older_than_the_mark_is_a_rollback() -> None:
    rollback = judge(reading(checkpoint(1)), HighWater.of(header(3)), always)
    assert rollback is not None
    assert (rollback.found_step, rollback.expected_step) == (1, 3)
    assert "step 1, older than step 3" in rollback.reasons[0]


def test_another_blob_under_the_marked_step_is_a_rollback() -> None:
    replaced = checkpoint(3, Lineage(RUN, HighWater.of(header(1))))  # not the saved one
    rollback = judge(reading(replaced), HighWater.of(header(3)), always)
    assert rollback is not None and rollback.expected_step == 3
    assert "is not step 3 (sha256" in rollback.reasons[0]


def test_a_newer_checkpoint_of_another_run_is_a_rollback() -> None:
    """The pointer moved to the run abandoned by a --fresh-start."""
    rollback = judge(reading(checkpoint(50)), HighWater.of(header(6, Lineage(OTHER_RUN))), always)
    assert rollback is not None and "another run" in rollback.reasons[0]


def test_an_empty_store_under_a_mark_is_a_rollback() -> None:
    rollback = judge(reading(None), HighWater.of(header(3)), always)
    assert rollback is not None and rollback.found_step is None
    assert rollback.found == "step 0 (no checkpoint)" and rollback.expected_step == 3


def test_a_passed_over_newest_checkpoint_is_a_rollback_even_without_a_mark() -> None:
    skipped = (Skipped(3, "its blob is missing"),)
    rollback = judge(reading(checkpoint(2), pointer=3, skipped=skipped), None, always)
    assert rollback is not None and (rollback.found_step, rollback.expected_step) == (2, 3)
    assert "step 3 (the one the latest pointer names) was passed over" in rollback.reasons[0]


def test_a_leftover_recording_a_newer_acknowledged_step_is_a_rollback() -> None:
    one = checkpoint(1)
    three = header(3, Lineage(RUN, HighWater.of(header(2))))
    rollback = judge(reading(one, beyond=(three,)), None, always)
    assert rollback is not None and rollback.expected_step == 2
    assert "records that step 2" in rollback.reasons[0]


def test_the_refusal_names_store_job_steps_and_the_way_out() -> None:
    rollback = judge(reading(checkpoint(1)), HighWater.of(header(3)), always)
    assert rollback is not None
    message = refusal("redis://h:1/0", "job", rollback, "/state/high-water/x.json")
    for words in (
        "refusing to resume job 'job' from redis://h:1/0",
        "Resuming would start from step 1 although step 3 was acknowledged",
        "--fresh-start",
        "delete the high-water mark /state/high-water/x.json",
    ):
        assert words in message


# ------------------------------------------------------------------ the mark file
def test_a_mark_is_written_privately_and_atomically_and_read_back(tmp_path: Path) -> None:
    marks = HighWaterMarks(tmp_path / "state")
    assert marks.read("file:///s", "job") is None
    mark = HighWater(3, "ef" * 32, RUN)
    marks.write("file:///s", "job", mark)
    marks.write("file:///s", "job", mark)  # replaced, not appended
    assert marks.read("file:///s", "job") == mark
    path = marks.path("file:///s", "job")
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert sorted(os.listdir(path.parent)) == [path.name]  # no temp file left behind
    # One mark per (store, job).
    assert marks.read("file:///other", "job") is None and marks.read("file:///s", "j") is None
    marks.forget("file:///s", "job")
    marks.forget("file:///s", "job")  # idempotent
    assert marks.read("file:///s", "job") is None


def test_an_unusable_mark_file_is_an_error_naming_it(tmp_path: Path) -> None:
    marks = HighWaterMarks(tmp_path)
    marks.write("file:///s", "other", HighWater(9, "ab" * 32, RUN))
    path = marks.path("file:///s", "job")
    # Another job's mark copied over this one's: not taken for it.
    path.write_bytes(marks.path("file:///s", "other").read_bytes())
    with pytest.raises(HighWaterError, match=r"belongs to job 'other'"):
        marks.read("file:///s", "job")
    for garbage in (b"{", b"[]", json.dumps({"format": 99}).encode(), b"x" * 70_000):
        path.write_bytes(garbage)
        with pytest.raises(HighWaterError, match=str(path)):
            marks.read("file:///s", "job")


def test_the_state_dir_defaults_follow_xdg_and_can_be_overridden() -> None:
    assert default_state_dir({"GRADSYNC_STATE_DIR": "/s", "XDG_STATE_HOME": "/x"}) == "/s"
    assert default_state_dir({"XDG_STATE_HOME": "/x", "HOME": "/h"}) == "/x/gradsync"
    assert default_state_dir({"XDG_STATE_HOME": "rel", "HOME": "/h"}) == "/h/.local/state/gradsync"
    assert default_state_dir({}, home="/h") == "/h/.local/state/gradsync"


def test_a_state_dir_inside_the_file_store_is_refused(tmp_path: Path) -> None:
    store = tmp_path / "store"
    with pytest.raises(ValueError, match="inside the checkpoint store"):
        CoordinatorConfig(world_size=1, checkpoint_store=str(store), state_dir=str(store / "state"))
    CoordinatorConfig(world_size=1, checkpoint_store=str(store), state_dir=str(tmp_path / "state"))
    CoordinatorConfig(world_size=1, checkpoint_store="redis://h:1/0", state_dir=str(tmp_path))
