"""A token holder posing as a shard, against real `gradsync serve` and `gradsync shard` processes.

Found by attacking 7dbe765: a `ShardLink` carrying the workers' token and
`ShardRegister(advertise=<a live shard's address>)` was admitted as that
shard's index, the real shard was displaced (it re-registered 0.46 s later),
and meanwhile the impostor received every member's session secret. Now the
link needs the shard token, a live shard is never displaced, the real shard
never notices the attempt, and two real ranks still train through it with a
token on. The command line refuses configurations that would reopen the hole.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

import grpc
import numpy as np
import pytest
from gradsync_proto import auth
from gradsync_proto.net.channels import ChannelSecurity
from gradsync_proto.net.launch import free_port
from gradsync_server.defaults import SHARDED_CHUNK_BYTES
from support.processes import TRAIN_WORKER, run_ranks
from support.shards import (
    FakeShard,
    ShardProcess,
    shard_statuses,
    wait_for_shard_bytes,
    wait_for_shards,
)

TOKEN = "workers-" + "w" * 32
SHARD_TOKEN = "shards-" + "s" * 32
HEARTBEAT = ("--heartbeat-interval", "0.5", "--heartbeat-timeout", "5")
SECRET_ENV = (auth.ENV_TOKEN, auth.ENV_TOKEN_FILE, auth.ENV_SHARD_TOKEN, auth.ENV_SHARD_TOKEN_FILE)


def write_secret(path: Path, value: str) -> str:
    path.write_text(value + "\n")
    path.chmod(0o600)
    return str(path)


@pytest.fixture
def tokens(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[str, str]:
    """Token files for the leader and the shard (the workers get only the first)."""
    for name in SECRET_ENV:
        monkeypatch.delenv(name, raising=False)
    token_file = write_secret(tmp_path / "token", TOKEN)
    shard_token_file = write_secret(tmp_path / "shard-token", SHARD_TOKEN)
    monkeypatch.setenv(auth.ENV_TOKEN_FILE, token_file)
    return token_file, shard_token_file


async def attempt(leader: str, metadata: tuple[tuple[str, str], ...], address: str) -> str:
    """Register a fake shard at `address`; return how the leader ended it ("CODE: details").

    The StreamEnd's code when the leader sent one (a handler's refusal), else the
    call's status (the token check refuses before any handler runs).
    """
    async with grpc.aio.insecure_channel(leader) as channel:
        rogue = FakeShard(channel, metadata)
        # The leader's own chunk size: only the credential and the address are wrong.
        await rogue.register(address=address, chunk_bytes=SHARDED_CHUNK_BYTES, silent=True)
        try:
            while True:
                message = await rogue.recv(timeout=10)
                kind = message.WhichOneof("kind")
                assert kind != "accepted", "the impostor was accepted"
                if kind == "stream_end":
                    end = message.stream_end
                    code = next(c for c in grpc.StatusCode if c.value[0] == end.code)
                    return f"{code.name}: {end.message}"
        except grpc.aio.AioRpcError as exc:
            return f"{exc.code().name}: {exc.details()}"
        finally:
            rogue.close()


@pytest.mark.timeout(180)
def test_a_token_holder_cannot_pose_as_a_live_shard_and_ranks_still_train(
    tokens: tuple[str, str], tmp_path: Path, coordinator_factory
) -> None:
    _token_file, shard_token_file = tokens
    leader = coordinator_factory(
        2, *HEARTBEAT, "--wait-for-shards", "1", "--shard-token-file", shard_token_file
    )
    shard = ShardProcess(
        leader.address,
        free_port(),
        tmp_path / "shard.log",
        "--shard-token-file",
        shard_token_file,
    )
    try:
        security = ChannelSecurity.resolve(token=TOKEN, environ={})
        (_, real) = wait_for_shards(leader.address, 2, 60, security)
        # A worker (it holds the token) naming the live shard's address.
        as_worker = asyncio.run(attempt(leader.address, auth.metadata(TOKEN), real.address))
        assert as_worker.startswith("UNAUTHENTICATED") and "shard token" in as_worker, as_worker
        # Even a holder of the shard token cannot displace a shard that is heard from.
        as_shard = asyncio.run(attempt(leader.address, auth.metadata(SHARD_TOKEN), real.address))
        assert as_shard.startswith("ALREADY_EXISTS") and "shard 1" in as_shard, as_shard
        time.sleep(1.5)  # the old displacement showed within 0.5 s
        (_, after) = shard_statuses(leader.address, security)
        assert after.alive and after.address == real.address, after
        assert "lost the leader" not in shard.log(), shard.log()
        # Two real ranks train through the shard: their streams present the derived session.
        saved = run_ranks(TRAIN_WORKER, leader.address, 2, tmp_path, "--scenario", "parity")
        finals = [name for name in saved[0] if name.startswith("final/")]
        assert finals
        for name in finals:
            np.testing.assert_array_equal(saved[0][name], saved[1][name])
        (_, used) = wait_for_shard_bytes(leader.address, security=security)
        assert used.address == real.address, used
        assert SHARD_TOKEN not in shard.log() and TOKEN not in shard.log()
    finally:
        shard.stop()


def gradsync(*argv: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gradsync.cli", *argv],
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
    )


def test_configurations_that_would_let_a_worker_pose_as_a_shard_are_refused(
    tokens: tuple[str, str], tmp_path: Path
) -> None:
    token_file, _shard_token_file = tokens
    env = {k: v for k, v in os.environ.items() if k not in SECRET_ENV}
    with_token = dict(env, **{auth.ENV_TOKEN_FILE: token_file})
    # A leader waiting for remote shards with only the workers' token.
    leader = gradsync("serve", "--world-size", "1", "--port", "0", "--wait-for-shards", "1",
                      env=with_token)  # fmt: skip
    assert leader.returncode == 2 and "needs a shard token" in leader.stderr, leader.stderr
    # A shard with only the workers' token.
    shard = gradsync("shard", "--leader", "127.0.0.1:1", "--port", "0", env=with_token)
    assert shard.returncode == 2 and "needs the leader's shard token" in shard.stderr
    # A shard token that is the workers' token tells nobody apart.
    same = gradsync("shard", "--leader", "127.0.0.1:1", "--port", "0", "--shard-token-file",
                    token_file, env=with_token)  # fmt: skip
    assert same.returncode == 2 and "same as the workers' token" in same.stderr, same.stderr
    assert TOKEN not in leader.stderr + shard.stderr + same.stderr
