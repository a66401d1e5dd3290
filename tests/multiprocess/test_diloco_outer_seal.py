"""A DiLoCo job's outer state in the store is sealed: forged or rolled-back records are refused.

The outer-state record (global parameters, outer momentum, round) is the job's model. Real
`gradsync serve` processes with a token and a file store, two real DiLoCo worker processes:
the record is rewritten as a store writer without the token would (parameters 42, momentum
100, the project's own encoder recomputing the unkeyed hash), or put back to an older
genuine one, and the restarted coordinator must refuse the job with FAILED_PRECONDITION
naming the store, the job, both rounds and `--fresh-start`, never restore or reseed it.
Without a token the forged record cannot be told from a genuine one but for the leader's
high-water mark: an ERROR line, and the documented behaviour (it is restored: the ranks hold
42 after construction, which also proves the record was read). With a shard started
elsewhere and a shard-token file, the records are sealed under the shard token, which the
workers do not hold: a worker's forgery of the shard's range refuses the restart too.
"""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from gradsync_proto.auth import derive_key
from gradsync_proto.net.channels import ChannelSecurity
from gradsync_proto.net.launch import free_port
from gradsync_server.dataplane.outer_snapshot import (
    OuterSnapshot,
    OuterSnapshotError,
    decode_snapshot,
    encode_snapshot,
)
from support.diloco_reference import Run, make_model
from support.processes import WORKERS, CoordinatorProcess, launch_ranks, reap
from support.shards import ShardProcess, wait_for_shards

DILOCO_WORKER = WORKERS / "diloco_worker.py"
NAMES = [name for name, _ in make_model(0).named_parameters()]
WORLD = 2
TOKEN = "outer-seal-test-token-0123456789abcdef"


def outer_key(token: str) -> bytes:
    """The outer-state key of an unsharded coordinator with `token`."""
    return derive_key(token, "outer-state")


def _captured(rank: int, argv: list[str]) -> subprocess.Popen[Any]:
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def run_job(address: str, out: Path, run: Run) -> tuple[list[int], list[str]]:
    """Run both ranks to their end; their exit codes and output."""
    out.mkdir()
    processes = launch_ranks(
        DILOCO_WORKER,
        address,
        WORLD,
        lambda rank: out / f"rank{rank}.npz",
        *run.argv(),
        launch=_captured,
    )
    try:
        texts = [process.communicate(timeout=120)[0] for process in processes]
    finally:
        reap(processes)
    return [process.returncode for process in processes], texts


def forge(path: Path) -> None:
    """Rewrite the record as a store writer without the token can: parameters 42, momentum
    100, re-encoded with the project's own encoder (its SHA-256 recomputed)."""
    genuine = decode_snapshot(path.read_bytes(), "default")
    fake = OuterSnapshot(
        genuine.job_id,
        genuine.signature,
        genuine.step,
        genuine.rounds,
        {index: np.full_like(array, 42.0) for index, array in genuine.parameters.items()},
        {index: np.full_like(array, 100.0) for index, array in genuine.momenta.items()},
        genuine.run,
    )
    path.write_bytes(b"".join(encode_snapshot(fake)))


@pytest.mark.timeout(300)
def test_a_forged_or_rolled_back_outer_state_is_refused_with_a_token(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("GRADSYNC_HIERARCHICAL", "0")
    monkeypatch.delenv("GRADSYNC_TOKEN_FILE", raising=False)
    monkeypatch.setenv("GRADSYNC_TOKEN", TOKEN)
    store = tmp_path / "store"
    record = store / "default" / "outer-state-shard0"
    serve = ("--checkpoint-store", str(store))
    run = Run(rounds=2, sync_every=2)

    def session(name: str, *flags: str) -> tuple[list[int], list[str], str]:
        coordinator = CoordinatorProcess(WORLD, *serve, *flags)
        try:
            codes, texts = run_job(coordinator.address, tmp_path / name, run)
        finally:
            log = coordinator.stop()[1]
        return codes, texts, log

    codes, texts, log = session("first")
    assert codes == [0, 0], texts
    older = record.read_bytes()
    sealed = decode_snapshot(older, "default", outer_key(TOKEN))  # sealed by the coordinator
    assert sealed.sealed and sealed.step == 2 and sealed.run
    codes, texts, log = session("second")  # restored from round 2, two rounds more
    assert codes == [0, 0], texts
    assert "outer state restored round 2 (step 2)" in log, log[-3000:]
    assert decode_snapshot(record.read_bytes(), "default").rounds == 4
    newest = record.read_bytes()

    record.write_bytes(older)  # an older, genuine, validly sealed record: a rollback
    codes, texts, log = session("rollback")
    assert all(code != 0 for code in codes), texts
    for words in (
        "refusing to resume the outer state of job 'default'",
        store.absolute().as_uri(),
        "round 2 (step 2)",
        "round 4 (step 4",
        "older than",
        "--fresh-start",
    ):
        assert words in log, (words, log[-4000:])
    assert "FAILED_PRECONDITION" in texts[0] or "--fresh-start" in texts[0], texts[0][-2000:]
    assert "outer state restored" not in log and "outer state reseeded" not in log
    assert record.read_bytes() == older  # refused, nothing overwritten

    record.write_bytes(newest)
    forge(record)
    codes, texts, log = session("forged")
    assert all(code != 0 for code in codes), texts
    for words in ("carries no MAC", "job 'default'", "round 4 (step 4", "--fresh-start"):
        assert words in log, (words, log[-4000:])
    assert "outer state restored" not in log and "outer state reseeded" not in log

    # The same forged record under a coordinator without a token: nothing in the store is
    # authenticated, so only the mark's digest shows it; an ERROR line, and it is restored.
    monkeypatch.delenv("GRADSYNC_TOKEN")
    codes, texts, log = session("tokenless")
    assert codes == [0, 0], texts
    error = [line for line in log.splitlines() if "rewritten since" in line]
    assert error and "ERROR" in error[0] and "without a token" in error[0], log[-4000:]
    with np.load(tmp_path / "tokenless" / "rank0.npz") as output:
        assert all(np.all(output[f"round0/{name}"] == 42.0) for name in NAMES)

    # The way out the refusal names: --fresh-start seeds the outer state anew (token on).
    monkeypatch.setenv("GRADSYNC_TOKEN", TOKEN)
    codes, texts, log = session("fresh", "--fresh-start")
    assert codes == [0, 0], texts
    assert "outer state reseeded (--fresh-start" in log, log[-3000:]
    with np.load(tmp_path / "fresh" / "rank0.npz") as output:
        assert not any(np.any(output[f"round0/{name}"] == 42.0) for name in NAMES)
    assert decode_snapshot(record.read_bytes(), "default", outer_key(TOKEN)).rounds == 2


SHARD_TOKEN = "outer-seal-shard-token-" + "s" * 24


@pytest.mark.timeout(300)
def test_remote_shards_seal_under_the_shard_token_so_the_workers_token_forges_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A leader waiting for a shard started elsewhere, both with a shard-token file: every
    plane's record is sealed under the shard token's key, not the workers' token's, so a
    worker (it holds the token) with write access to the store cannot forge the shard's
    range; its record sealed under the workers' token's key refuses the restart."""
    monkeypatch.setenv("GRADSYNC_HIERARCHICAL", "0")
    for name in ("GRADSYNC_TOKEN_FILE", "GRADSYNC_SHARD_TOKEN", "GRADSYNC_SHARD_TOKEN_FILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("GRADSYNC_TOKEN", TOKEN)
    shard_token_file = tmp_path / "shard-token"
    shard_token_file.write_text(SHARD_TOKEN + "\n")
    shard_token_file.chmod(0o600)
    store = tmp_path / "store"
    secret = ("--checkpoint-store", str(store), "--shard-token-file", str(shard_token_file))
    run = Run(rounds=2, sync_every=2)
    security = ChannelSecurity(token=TOKEN)

    def session(name: str) -> tuple[list[int], list[str], str]:
        leader = CoordinatorProcess(WORLD, "--wait-for-shards", "1", *secret)
        shard = ShardProcess(leader.address, free_port(), tmp_path / f"{name}-shard.log", *secret)
        try:
            wait_for_shards(leader.address, 2, 60, security)
            codes, texts = run_job(leader.address, tmp_path / name, run)
        finally:
            shard.stop()
            log = leader.stop()[1]
        return codes, texts, log

    codes, texts, _ = session("first")
    assert codes == [0, 0], texts
    records = [store / "default" / f"outer-state-shard{index}" for index in (0, 1)]
    for path in records:
        blob = path.read_bytes()
        assert decode_snapshot(blob, "default", outer_key(SHARD_TOKEN)).sealed
        with pytest.raises(OuterSnapshotError, match="fails its MAC"):
            decode_snapshot(blob, "default", outer_key(TOKEN))
    # A worker rewrites the shard's range, sealing it with the key its token gives.
    genuine = decode_snapshot(records[1].read_bytes(), "default")
    fake = OuterSnapshot(
        genuine.job_id,
        genuine.signature,
        genuine.step,
        genuine.rounds,
        {index: np.full_like(array, 42.0) for index, array in genuine.parameters.items()},
        {index: np.full_like(array, 100.0) for index, array in genuine.momenta.items()},
        genuine.run,
    )
    records[1].write_bytes(b"".join(encode_snapshot(fake, outer_key(TOKEN))))
    codes, texts, log = session("forged")
    assert all(code != 0 for code in codes), texts
    for words in ("shard 1:", "fails its MAC", "job 'default'", "round 2 (step 2", "--fresh-start"):
        assert words in log, (words, log[-4000:])
