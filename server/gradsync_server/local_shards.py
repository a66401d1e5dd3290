"""`gradsync serve --shards S`: the leader's S-1 local shard processes, supervised.

One Python process aggregates at most one core's worth of bytes, so a host
with several cores runs the leader plus S-1 `gradsync shard` child processes
that register with it over loopback. The leader owns them: it starts them
after it listens, restarts one that dies at the same port (the workers'
shard map names that port, and a shard that comes back at its address keeps
its index), logs every restart, and stops them all on shutdown, so none is
left behind. A child that keeps dying is restarted after a short delay, not
in a tight loop.

A child must not outlive its leader either: a leader that is SIGKILLed (or
OOM-killed) runs no cleanup, so its children would go on holding their ports,
and a leader restarted on the same port could not start its own shards there
(they would find the port taken, and the orphan would keep knocking on the new
leader with an old shard token). So each child runs `watch_parent`, two
mechanisms because neither is enough alone:

- on Linux, `prctl(PR_SET_PDEATHSIG, SIGTERM)`: the kernel sends the signal
  the moment the parent dies, and the shard's own SIGTERM handler drains and
  exits;
- everywhere, a watcher that compares `os.getppid()` with the parent's pid
  every `PARENT_POLL_S` (a reparented child has a new parent), covering other
  systems, a failed prctl, and a parent that died before the prctl ran (then
  the signal never comes: the check right after the prctl catches that).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import ctypes.util
import logging
import os
import signal
import sys
from collections.abc import Mapping, Sequence

from gradsync_proto import auth
from gradsync_proto.net.launch import free_port, gradsync_argv

from gradsync_server import defaults
from gradsync_server.config import CoordinatorConfig
from gradsync_server.defaults import MIB

log = logging.getLogger("gradsync.server")

#: How long a stopping child gets after SIGTERM before it is killed.
_STOP_GRACE_S = 10.0
#: Hosts that mean "every interface": the children reach the leader over loopback then.
_ANY_HOST = ("", "0.0.0.0", "::", "[::]")


#: How often the fallback watcher checks that the parent is still there.
PARENT_POLL_S = 0.5
#: linux/prctl.h: PR_SET_PDEATHSIG.
_PR_SET_PDEATHSIG = 1


def set_parent_death_signal(signum: int = signal.SIGTERM) -> bool:
    """Ask the kernel to send `signum` to this process when its parent dies (Linux only).

    Returns:
        True if the kernel accepted it; False elsewhere or when the call failed (the
        watcher of `watch_parent` then does the job alone, a poll period later).
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        result = int(libc.prctl(_PR_SET_PDEATHSIG, signum, 0, 0, 0))
    except (OSError, AttributeError) as exc:
        log.warning("cannot ask for a parent-death signal (%s); polling the parent instead", exc)
        return False
    if result != 0:
        error = ctypes.get_errno()
        log.warning(
            "prctl(PR_SET_PDEATHSIG) failed (%s); polling the parent instead", os.strerror(error)
        )
        return False
    return True


async def watch_parent(parent_pid: int, poll_s: float = PARENT_POLL_S) -> None:
    """Return when `parent_pid` is no longer this process's parent (it died).

    Also arms the parent-death signal first (`set_parent_death_signal`), so on Linux the
    process usually hears of it at once, through its SIGTERM handler, before this returns.
    """
    set_parent_death_signal()
    while os.getppid() == parent_pid:  # (a reparented child has another parent)
        await asyncio.sleep(poll_s)
    log.warning(
        "the parent process %d is gone (now the child of %d): stopping", parent_pid, os.getppid()
    )


def shard_ports(config: CoordinatorConfig, leader_port: int) -> list[int]:
    """Ports of shards 1..S-1: the leader's port + i, or free ports when it bound port 0."""
    if config.port == 0:
        return [free_port() for _ in range(config.shard_count - 1)]
    return [leader_port + index for index in range(1, config.shard_count)]


def shard_command(
    config: CoordinatorConfig, leader_port: int, port: int, index: int, log_level: str
) -> list[str]:
    """The argv of local shard `index` (its address is advertised as ":port")."""
    leader_host = "127.0.0.1" if config.host in _ANY_HOST else config.host
    flags = {
        "--leader": f"{leader_host}:{leader_port}",
        "--host": config.host,
        "--port": port,
        "--advertise": f":{port}",
        "--max-buffered-mb": f"{config.max_buffered_bytes / MIB:g}",
        # The leader's limits on hostile or slow peers hold on its shards too.
        "--max-outbox-mb": repr(config.max_outbox_bytes / MIB),
        "--max-connections": config.max_connections,
        "--first-message-timeout-s": repr(config.first_message_timeout_s),
        # A SIGKILLed leader runs no cleanup: the child must notice alone (`watch_parent`).
        "--parent-pid": os.getpid(),
    }
    argv = gradsync_argv("gradsync", "--log-level", log_level, "shard", flags=flags)
    if config.checkpoint_store:
        # Each shard saves its range of the DiLoCo outer state next to the leader's.
        argv += ["--checkpoint-store", config.checkpoint_store]
        argv += ["--store-timeout", repr(config.store_timeout_s)]
    if config.metrics_port:
        argv += ["--metrics-port", str(config.metrics_port + index)]
    if config.metrics_host:
        argv += ["--metrics-host", config.metrics_host]
    if config.tls_cert and config.tls_key:
        # The children serve workers with the leader's certificate, ask for the same
        # client certificates, and verify the leader with its CA (or the certificate).
        argv += ["--tls-cert", config.tls_cert, "--tls-key", config.tls_key]
        argv += ["--tls-ca", config.tls_ca or config.tls_cert]
        if config.tls_client_ca:
            argv += ["--tls-client-ca", config.tls_client_ca]
    if config.insecure:
        argv.append("--insecure")
    return argv


def shard_environment(config: CoordinatorConfig, environ: Mapping[str, str]) -> dict[str, str]:
    """The children's environment: the leader's, with the tokens in $GRADSYNC_(SHARD_)TOKEN
    and the Redis password (if any) in $GRADSYNC_REDIS_PASSWORD.

    The tokens go by environment, never argv: the process list shows every
    argument to every user of the host, a process's environment only to its owner.
    """
    own = (auth.ENV_TOKEN, auth.ENV_TOKEN_FILE, auth.ENV_SHARD_TOKEN, auth.ENV_SHARD_TOKEN_FILE)
    env = {key: value for key, value in environ.items() if key not in own}
    if config.token is not None:
        env[auth.ENV_TOKEN] = config.token
    if config.shard_token is not None:
        env[auth.ENV_SHARD_TOKEN] = config.shard_token
    env.pop(defaults.ENV_REDIS_PASSWORD, None)
    if config.redis_password is not None:
        env[defaults.ENV_REDIS_PASSWORD] = config.redis_password
    return env


class LocalShards:
    """The leader's local shard children.

    Args:
        config: the leader's configuration (`shard_count`, host, chunk size).
        leader_port: the port the leader listens on.
        restart_delay_s: pause before restarting a child that died.
    """

    def __init__(
        self,
        config: CoordinatorConfig,
        leader_port: int,
        restart_delay_s: float = defaults.LOCAL_SHARD_RESTART_DELAY_S,
    ) -> None:
        self._config = config
        self._leader_port = leader_port
        self._restart_delay_s = restart_delay_s
        self.ports = shard_ports(config, leader_port)
        self._processes: dict[int, asyncio.subprocess.Process] = {}
        self._supervisors: list[asyncio.Task[None]] = []
        self._stopping = False
        #: How often each child was restarted, by shard index.
        self.restarts: dict[int, int] = {}

    def commands(self) -> Sequence[list[str]]:
        """The argv of every child, by index 1..S-1."""
        level = logging.getLevelName(logging.getLogger().getEffectiveLevel())
        return [
            shard_command(self._config, self._leader_port, port, index, level)
            for index, port in enumerate(self.ports, start=1)
        ]

    def pids(self) -> dict[int, int]:
        """Process ids of the running children, by index."""
        return {
            index: process.pid
            for index, process in self._processes.items()
            if process.returncode is None
        }

    async def start(self) -> None:
        """Start every child and a supervisor for each."""
        for index, argv in enumerate(self.commands(), start=1):
            self._supervisors.append(asyncio.create_task(self._supervise(index, argv)))
        ports = ", ".join(f"{i} on :{p}" for i, p in enumerate(self.ports, start=1))
        log.info("started %d local shard process(es): %s", len(self.ports), ports)

    async def _supervise(self, index: int, argv: list[str]) -> None:
        while not self._stopping:
            process = await asyncio.create_subprocess_exec(
                *argv, env=shard_environment(self._config, os.environ)
            )
            self._processes[index] = process
            code = await process.wait()
            if self._stopping:
                return
            self.restarts[index] = self.restarts.get(index, 0) + 1
            log.warning(
                "local shard %d (port %d, pid %d) exited with code %s; restarting it at the "
                "same port in %gs (restart %d)",
                index,
                self.ports[index - 1],
                process.pid,
                code,
                self._restart_delay_s,
                self.restarts[index],
            )
            await asyncio.sleep(self._restart_delay_s)

    async def stop(self) -> None:
        """Stop every child (SIGTERM, then SIGKILL after a grace) and the supervisors."""
        self._stopping = True
        for process in self._processes.values():
            if process.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    process.terminate()
        for index, process in self._processes.items():
            try:
                await asyncio.wait_for(process.wait(), timeout=_STOP_GRACE_S)
            except TimeoutError:
                log.warning(
                    "local shard %d did not stop within %gs; killing it", index, _STOP_GRACE_S
                )
                with contextlib.suppress(ProcessLookupError):
                    process.kill()
                await process.wait()
        for supervisor in self._supervisors:
            supervisor.cancel()
        await asyncio.gather(*self._supervisors, return_exceptions=True)
