"""The processes of the churn soak: a Redis, two leased coordinators and W workers.

`Cluster` starts them in one folder and supervises them: a worker process
that ends (killed, or exited after an error) is started again as a new
incarnation of its rank, which rejoins the running job and is healed; a
coordinator that ends (killed) is started again on its port as a standby (a
demoted one stands by again by itself). The failure schedule (`churn_schedule`)
only injects faults; the restarts are this module's, as a real deployment's supervisor (systemd,
Kubernetes) would do them. Every process gets its own log file.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from gradsync_bench.procs import flag_args, proc_status, stop_process, wait_until

#: Heartbeats fast enough for the soak: a frozen rank is dropped after 2 s.
HEARTBEAT_INTERVAL_S = 0.25
HEARTBEAT_TIMEOUT_S = 2.0
SUPERVISE_POLL_S = 0.1


def free_port(count: int = 1) -> int:
    """A port P with P..P+count-1 free now (a leader with --shards uses P+1..)."""
    for _ in range(200):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = int(probe.getsockname()[1])
        if port + count >= 65535:
            continue
        if all(_is_free(port + offset) for offset in range(1, count)):
            return port
    raise OSError(f"found no {count} consecutive free ports")


def _is_free(port: int) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def rss_mib(pid: int) -> float | None:
    """Resident memory of `pid` in MiB (None once it is gone)."""
    kib = proc_status(pid).get("VmRSS")
    return None if kib is None else kib / 1024


def children(pid: int) -> list[int]:
    """The direct children of `pid` (a leader's local shard processes)."""
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except OSError:
        return []
    return [int(word) for word in text.split()]


@dataclass(frozen=True)
class ClusterConfig:
    """The soak's shape; the defaults are the issue's (W = 4, elastic, a standby)."""

    world_size: int = 4
    shards: int = 2
    lease_ttl_s: float = 1.5
    checkpoint_every: int = 50
    compute_s: float = 0.02
    min_workers: int = 2
    python: str = sys.executable


@dataclass
class Supervised:
    """One supervised slot (a rank, or a coordinator port): its current process."""

    name: str
    command: list[str]
    log: Path
    process: subprocess.Popen[bytes] | None = None
    incarnations: int = 0
    #: While True the supervisor leaves the slot alone (SIGSTOPped, or shutting down).
    held: bool = False
    exits: list[int] = field(default_factory=list)

    def start(self, env: dict[str, str]) -> None:
        self.incarnations += 1
        with self.log.open("ab") as out:
            out.write(f"\n=== {self.name} incarnation {self.incarnations}\n".encode())
            out.flush()
            command = [*self.command, *self.incarnation_flag(self.incarnations)]
            self.process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env)

    def incarnation_flag(self, incarnation: int) -> list[str]:
        """A worker is told which process of its rank it is (its initial weights)."""
        return ["--incarnation", str(incarnation)] if self.name.startswith("rank") else []


class Cluster:
    """Redis, two coordinators (active + standby) and the workers, supervised."""

    def __init__(self, folder: Path, config: ClusterConfig) -> None:
        self.folder = folder
        self.config = config
        folder.mkdir(parents=True, exist_ok=True)
        self.redis_port = free_port()
        self.redis_dir = folder / "redis"
        self.redis_dir.mkdir(exist_ok=True)
        self.redis: subprocess.Popen[bytes] | None = None
        self.ports = [free_port(config.shards + 1), 0]
        self.ports[1] = free_port(config.shards + 1)
        while abs(self.ports[1] - self.ports[0]) <= config.shards:
            self.ports[1] = free_port(config.shards + 1)
        self.addresses = [f"127.0.0.1:{port}" for port in self.ports]
        self.stop_file = folder / "stop"
        self.env = dict(os.environ)
        self.env["GRADSYNC_STATE_DIR"] = str(folder / "state")
        self.coordinators = [self._coordinator(index) for index in range(2)]
        self.workers = [self._worker(rank) for rank in range(config.world_size)]
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def redis_url(self) -> str:
        return f"redis://127.0.0.1:{self.redis_port}/0"

    def _coordinator(self, index: int) -> Supervised:
        port = self.ports[index]
        config = self.config
        command = [
            config.python, "-m", "gradsync.cli", "--log-level", "INFO", "serve",
            *flag_args(world_size=config.world_size, port=port, checkpoint_store=self.redis_url),
            "--standby",
            *flag_args(lease_ttl_s=config.lease_ttl_s, advertise=f"127.0.0.1:{port}"),
            *flag_args(on_failure="elastic", min_workers=config.min_workers),
            *flag_args(heartbeat_interval=HEARTBEAT_INTERVAL_S),
            *flag_args(heartbeat_timeout=HEARTBEAT_TIMEOUT_S),
            *flag_args(checkpoint_every=config.checkpoint_every),
            *flag_args(state_dir=self.folder / f"state{index}"),
            *flag_args(shards=config.shards if config.shards > 1 else None),
        ]  # fmt: skip
        return Supervised(f"coordinator{index}", command, self.folder / f"coordinator{index}.log")

    def _worker(self, rank: int) -> Supervised:
        config = self.config
        command = [
            config.python, "-m", "gradsync_bench.churn_worker",
            *flag_args(coordinator=",".join(self.addresses), rank=rank),
            *flag_args(world_size=config.world_size),
            *flag_args(log=self.folder / f"rank{rank}.jsonl", stop_file=self.stop_file),
            *flag_args(final=self.folder / f"final{rank}.pt", compute_s=config.compute_s),
        ]  # fmt: skip
        return Supervised(f"rank{rank}", command, self.folder / f"rank{rank}.log")

    # Redis --------------------------------------------------------------------------

    def start_redis(self) -> None:
        """redis-server on its port and folder; every write fsynced (a crash loses none)."""
        log = (self.folder / "redis.log").open("ab")
        self.redis = subprocess.Popen(
            [
                "redis-server",
                "--port",
                str(self.redis_port),
                "--bind",
                "127.0.0.1",
                "--dir",
                str(self.redis_dir),
                "--appendonly",
                "yes",
                "--appendfsync",
                "always",
                "--save",
                "",
                "--protected-mode",
                "no",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        log.close()
        deadline = time.monotonic() + 10
        while not self._redis_answers():
            if time.monotonic() > deadline or self.redis.poll() is not None:
                raise RuntimeError(f"redis-server did not start (see {self.folder / 'redis.log'})")
            time.sleep(0.05)

    def _redis_answers(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.redis_port), timeout=0.5) as conn:
                conn.sendall(b"PING\r\n")
                return conn.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    def kill_redis(self) -> None:
        """SIGKILL redis-server (a crash: its append-only file has every write)."""
        if self.redis is not None:
            self.redis.kill()
            self.redis.wait(timeout=10)

    # Start, supervise, stop ---------------------------------------------------------

    def start(self) -> None:
        """Redis, the first coordinator (it takes the lease), the standby, the workers."""
        self.start_redis()
        self.coordinators[0].start(self.env)
        self.wait_active(60)
        self.coordinators[1].start(self.env)
        for worker in self.workers:
            worker.start(self.env)
        self._thread = threading.Thread(target=self._supervise, name="supervisor", daemon=True)
        self._thread.start()

    def _supervise(self) -> None:
        while not self._stopping.wait(SUPERVISE_POLL_S):
            with self._lock:
                for slot in [*self.coordinators, *self.workers]:
                    process = slot.process
                    if slot.held or process is None or process.poll() is None:
                        continue
                    slot.exits.append(int(process.returncode))
                    slot.start(self.env)

    def hold(self, slot: Supervised, held: bool) -> None:
        with self._lock:
            slot.held = held

    def active_index(self) -> int | None:
        """The coordinator that serves now (health SERVING), if any."""
        import grpc
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        for index, address in enumerate(self.addresses):
            try:
                with grpc.insecure_channel(address) as channel:
                    reply = health_pb2_grpc.HealthStub(channel).Check(
                        health_pb2.HealthCheckRequest(service=""), timeout=1
                    )
            except grpc.RpcError:
                continue
            if reply.status == health_pb2.HealthCheckResponse.SERVING:
                return index
        return None

    def wait_active(self, timeout_s: float) -> None:
        failure = f"no coordinator became active within {timeout_s:g}s"
        wait_until(lambda: self.active_index() is not None, timeout_s, failure, interval_s=0.1)

    def shard_pids(self, index: int) -> list[int]:
        process = self.coordinators[index].process
        return [] if process is None else children(process.pid)

    def stop(self) -> None:
        """Stop supervising; end every process (workers first); leave the logs."""
        self._stopping.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        for slot in [*self.workers, *self.coordinators]:
            process = slot.process
            if process is None or process.poll() is not None:
                continue
            os.kill(process.pid, signal.SIGCONT)  # a frozen one cannot die of SIGTERM
            stop_process(process)
        if self.redis is not None and self.redis.poll() is None:
            self.redis.terminate()
            self.redis.wait(timeout=10)
