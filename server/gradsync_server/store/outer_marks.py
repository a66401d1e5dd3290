"""The high-water mark of a DiLoCo job's outer state: which record the leader last had
acknowledged, so that a store rolled back behind its back is noticed.

The outer-state record (`gradsync_server.dataplane.outer_snapshot`) is one record per plane,
overwritten every round: the store keeps no history of it, and a MAC proves only that the
coordinator wrote a record, not that it is the newest. So after every acknowledged save of
its own plane's record the leader writes the record's step, round, SHA-256 and run to its
state directory (next to the checkpoints' marks, `high_water_file`, and under the same
rules: outside the store, mode 0600, replaced atomically), and `judge` compares the record
the store returns with it when the job assembles again.

The shards' records are not marked on their own: a restore needs every plane's record at
the leader's step (or one apart) and of the leader's run, so pinning the leader's record
pins them all.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from gradsync_server.store.high_water_file import HighWaterMarks

__all__ = ["OuterMark", "OuterMarks", "judge"]


@dataclass(frozen=True)
class OuterMark:
    """The leader's newest outer-state record acknowledged as durable.

    Attributes:
        step: the step whose answer it holds.
        rounds: the outer steps it had applied.
        digest: the hex SHA-256 of the whole record.
        run: the run it belongs to (`OuterSnapshot.run`).
    """

    step: int
    rounds: int
    digest: str
    run: str

    def __str__(self) -> str:
        return f"round {self.rounds} (step {self.step}, sha256 {self.digest[:16]}...)"


def judge(step: int, rounds: int, digest: str, run: str, mark: OuterMark | None) -> str | None:
    """Why the record (`step`, `rounds`, `digest`, `run`) is not the one `mark` names nor
    a later record of its run, or None.

    A later record of the same run is the save that crashed (or failed to write its
    mark) after the store had acknowledged it.
    """
    if mark is None:
        return None
    acknowledged = f"{mark}, the newest this coordinator had acknowledged"
    if run != mark.run:
        return (
            f"its record holds round {rounds} (step {step}) of another run of the job (run "
            f"{run or 'none'}) than {acknowledged} (run {mark.run or 'none'}): a record from "
            "before a --fresh-start, or another deployment's?"
        )
    if step < mark.step:
        return f"its record holds round {rounds} (step {step}), older than {acknowledged}"
    if step == mark.step and digest != mark.digest:
        return (
            f"its record of round {rounds} (step {step}, sha256 {digest[:16]}...) is not "
            f"{acknowledged}: it was rewritten since"
        )
    return None


def _outer_mark(record: dict[str, Any]) -> OuterMark:
    mark = OuterMark(
        int(record["step"]), int(record["rounds"]), str(record["sha256"]), str(record["run"])
    )
    if mark.step < 0 or mark.rounds < 0 or not mark.digest:
        raise ValueError(f"step {mark.step}, rounds {mark.rounds}, digest {mark.digest!r}")
    return mark


class OuterMarks(HighWaterMarks):
    """The outer-state marks of every (store, job) this leader saved to (one file each).

    Args:
        directory: the state directory (`--state-dir`).
    """

    @staticmethod
    def describe(store_description: str) -> str:
        """The name its marks are filed under (apart from the same store's checkpoint marks)."""
        return f"{store_description} (outer state)"

    def read_outer(self, description: str, job_id: str) -> OuterMark | None:
        """The mark, or None when this coordinator never saved that job's outer state there.

        Raises:
            HighWaterError: the file exists but is unreadable, malformed or another's.
        """
        path = self.path(self.describe(description), job_id)
        return self.read_record(path, description, job_id, "outer-state mark", _outer_mark)

    def write_outer(self, description: str, job_id: str, mark: OuterMark) -> None:
        """Replace the mark atomically and durably.

        Raises:
            OSError: it could not be written (the old mark, if any, stays).
        """
        fields = {"step": mark.step, "rounds": mark.rounds, "sha256": mark.digest, "run": mark.run}
        path = self.path(self.describe(description), job_id)
        self.write_record(path, description, job_id, fields)

    def forget_outer(self, description: str, job_id: str) -> None:
        """Delete the mark (`--fresh-start`: the outer state is seeded anew).

        Raises:
            OSError: it could not be deleted.
        """
        self.forget(self.describe(description), job_id)

    def location(self, description: str, job_id: str) -> str:
        """The mark's file, for messages."""
        return os.fspath(self.path(self.describe(description), job_id))
