"""A restarted rank joins a live elastic job and is healed with the donor's state, bitwise.

Real processes (the heal benchmark's workers: an MLP with Adam, so the state
is parameters plus both moments), a real coordinator, a real SIGKILL. With
the coordinator on loopback the donor serves its state directly
(`gradsync.control.heal_channel`); with `$GRADSYNC_HEAL_CHANNEL=0` it goes
through the coordinator as before. Either way every rank must end with the
same digest of parameters and optimizer state: a joiner that had missed a
single byte (or had kept its own Adam moments) would train to other values.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from gradsync_bench import heal


@pytest.mark.timeout(240)
@pytest.mark.parametrize("path", ["direct", "grpc"])
def test_a_rank_joining_a_live_job_gets_the_donors_state_bitwise(tmp_path: Path, path: str) -> None:
    # A worker's outbox far smaller than the state: the coordinator sends a state chunk
    # by chunk as the joiner reads it (it once queued it whole and dropped the joiner
    # of any state over the default 128 MiB).
    row = heal.heal_once(
        3, 12.0, tmp_path, path, timeout_s=180.0, serve_flags=("--max-outbox-mb", "8")
    )
    assert row["bitwise"], row
    assert row["state_bytes"] > 10e6  # parameters and both Adam moments
    joiner_log = (tmp_path / "joiner2.log").read_text()
    direct = "directly (loopback), into its own parameters" in joiner_log
    relayed = "through the coordinator, into its own parameters" in joiner_log
    if path == "direct":
        # The donor timed a direct transfer, and the joiner read it from the donor.
        assert row["transfer_s"] is not None and direct, joiner_log[-2000:]
    else:  # a raw state relayed by the coordinator, read in place as well
        assert row["transfer_s"] is None and relayed and not direct, joiner_log[-2000:]
    assert "resumed from the checkpoint of step" in joiner_log
