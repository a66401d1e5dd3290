"""A real redis-server for tests: started on a free loopback port, stopped afterwards."""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

REDIS_SERVER = shutil.which("redis-server")
NO_REDIS_SERVER = "redis-server not installed (CI installs Debian's redis-server)"


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


class RedisServer:
    """A real redis-server child on a free loopback port, keeping its files in `directory`."""

    def __init__(self, directory: Path, *durability_args: str) -> None:
        self.directory = directory
        self.directory.mkdir(parents=True, exist_ok=True)
        self.durability_args = durability_args or ("--appendonly", "yes", "--appendfsync", "always")
        self.process: subprocess.Popen[bytes] | None = None
        self.port = 0
        self.start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, same_port: bool = False) -> None:
        """Start on a fresh free port (a few tries: another process may grab the port first).

        `same_port=True` restarts on the previous port, as a restarted server
        would come back at its old address.
        """
        assert REDIS_SERVER is not None
        log_path = self.directory / "redis.log"
        for _ in range(3):
            if not (same_port and self.port):
                self.port = free_port()
            arguments = [REDIS_SERVER, "--port", str(self.port), "--bind", "127.0.0.1"]
            arguments += ["--dir", str(self.directory), "--save", "", "--daemonize", "no"]
            arguments += self.durability_args
            with open(log_path, "ab") as log:
                self.process = subprocess.Popen(
                    arguments,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                )
            deadline = time.monotonic() + 10
            while self.process.poll() is None and time.monotonic() < deadline:
                if self.answers_ping():
                    return
                time.sleep(0.02)
            self.stop()
        raise RuntimeError(f"redis-server did not answer PING: {log_path.read_text()[-2000:]}")

    def answers_ping(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=1) as connection:
                connection.sendall(b"PING\r\n")
                return connection.recv(64).startswith(b"+PONG")
        except OSError:
            return False

    def stop(self, how: signal.Signals = signal.SIGTERM) -> None:
        if self.process is None:
            return
        if self.process.poll() is None:
            self.process.send_signal(how)
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.process = None
