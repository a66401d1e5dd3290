"""The checkpoint store under trouble, with a real redis-server.

- A hung Redis (SIGSTOP) must not freeze the coordinator: the load at a Join runs in a
  store thread with a deadline, so another job on the same coordinator keeps training,
  and the job whose store cannot be read is refused (not started from step 0), its
  checkpoint untouched; once Redis is back the job resumes from it.
- The Redis password comes from a file (or the environment) and is never printed.
"""

from __future__ import annotations

import asyncio
import signal
import socket
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest
from gradsync_proto import defaults
from gradsync_proto.v1 import gradsync_pb2 as pb
from gradsync_server.store.stores import open_store
from support.components import REDIS_SERVER
from support.processes import CoordinatorProcess
from support.rawclient import CHUNK, RawWorker, assembled_job, coordinator, run, run_step
from support.redisserver import RedisServer

STORE_TIMEOUT_S = 3.0


@pytest.mark.timeout(60)
def test_a_hung_redis_refuses_its_job_while_another_job_trains_on(
    redis_server: RedisServer,
) -> None:
    async def scenario() -> None:
        async with coordinator(
            checkpoint_store=redis_server.url, store_timeout_s=STORE_TIMEOUT_S
        ) as (running, channel):
            # Job "b" saves a checkpoint of step 1, then finishes.
            job_b = await assembled_job(channel, "b")
            await run_step(job_b, 0)
            blob = bytes(range(256)) * (CHUNK // 256)
            chunk = pb.CheckpointChunk(step=1, offset=0, total_bytes=len(blob), payload=blob)
            await job_b[0].send(pb.WorkerMessage(checkpoint=chunk))
            assert (await job_b[0].expect_kind("checkpoint_saved")).checkpoint_saved.durable
            for worker in job_b:
                await worker.leave()
            job_a = await assembled_job(channel, "a")
            await run_step(job_a, 0)
            assert redis_server.process is not None
            redis_server.process.send_signal(signal.SIGSTOP)
            try:
                restarted = RawWorker(channel)
                await restarted.join(0, job_id="b")
                await asyncio.sleep(0.2)  # its load is now hung in a store thread
                loop = asyncio.get_running_loop()
                started = loop.time()
                for step in range(1, 6):
                    await run_step(job_a, step)
                # Job "a" trained 5 steps while job "b"'s load was still hung.
                assert loop.time() - started < STORE_TIMEOUT_S - 0.5
                assert not restarted.call.done()
                details = await restarted.expect_status(grpc.StatusCode.FAILED_PRECONDITION)
                assert "cannot read the checkpoints of job 'b'" in details, details
                assert "--fresh-start" in details
                assert "b" not in running.servicer.jobs  # not started from step 0
            finally:
                redis_server.process.send_signal(signal.SIGCONT)
            with open_store(redis_server.url) as store:
                assert store.steps("b") == [1]  # nothing deleted
            # Redis is back: job "b" resumes from its checkpoint.
            again = [RawWorker(channel), RawWorker(channel)]
            for rank, worker in enumerate(again):
                await worker.join(rank, job_id="b")
            welcome = (await again[0].expect_kind("welcome")).welcome
            assert (welcome.start_step, welcome.resume_bytes) == (1, len(blob))

    run(scenario, timeout_s=45)


class PasswordRedis(RedisServer):
    """A redis-server that requires a password (its readiness probe is refused politely)."""

    def ready(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=1) as connection:
                connection.sendall(b"PING\r\n")
                return connection.recv(64).startswith((b"+PONG", b"-NOAUTH"))
        except OSError:
            return False


@pytest.mark.timeout(60)
def test_the_redis_password_comes_from_a_file_and_is_never_printed(
    tmp_path: Path,
    redis_server_factory: Callable[..., RedisServer],
    coordinator_factory: Callable[..., CoordinatorProcess],
) -> None:
    secret = "s3cret-redis-pw"
    redis_server_factory()  # the fixture's checks (redis-server, redis package) and cleanup
    server = PasswordRedis(
        tmp_path / "locked",
        *("--appendonly", "yes", "--appendfsync", "always", "--requirepass", secret),
    )
    try:
        password_file = tmp_path / "redis-password"
        password_file.write_text(secret + "\n")
        # The URL carries a wrong password: the file's wins, and neither is printed.
        url = f"redis://:wrong-pw@127.0.0.1:{server.port}/0"
        process = coordinator_factory(
            1,
            "--checkpoint-store",
            url,
            "--redis-password-file",
            str(password_file),
            "--store-timeout",
            "5",
        )
        banner = "".join(process.startup_lines)
        assert "***@127.0.0.1" in banner and "wrong-pw" not in banner and secret not in banner

        async def save_one() -> None:
            channel = grpc.aio.insecure_channel(process.address)
            worker = RawWorker(channel)
            await worker.join(0, world_size=1, job_id="locked")
            await worker.expect_kind("welcome")
            blob = b"x" * 100
            chunk = pb.CheckpointChunk(step=0, offset=0, total_bytes=len(blob), payload=blob)
            await worker.send(pb.WorkerMessage(checkpoint=chunk))
            saved = (await worker.expect_kind("checkpoint_saved")).checkpoint_saved
            assert saved.durable, saved.message
            await worker.leave()
            await channel.close()

        run(save_one, timeout_s=30)
        _, log = process.stop()
        assert secret not in log and "wrong-pw" not in log
        with open_store(f"redis://127.0.0.1:{server.port}/0", password=secret) as store:
            assert store.steps("locked") == [0]
    finally:
        server.stop()
    assert REDIS_SERVER is not None and defaults.ENV_REDIS_PASSWORD == "GRADSYNC_REDIS_PASSWORD"
