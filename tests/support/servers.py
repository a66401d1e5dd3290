"""A real server child process for tests: started on a free loopback port, stopped afterwards.

`RedisServer` and `PrometheusServer` are this with their own command line and
readiness probe; both keep their files (and their log) in the test's folder.
"""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path

from gradsync_proto.net.launch import free_port


class ServerProcess:
    """A server child on a free loopback port that logs to `log_path`.

    Subclasses say how to start it on a port (`command`) and when it is ready
    (`ready`); `start` retries on a fresh port, since another process may take a
    free port between the probe and the server's bind.
    """

    #: How long one start may take to become ready.
    ready_timeout_s: float = 10.0
    #: How often readiness is polled.
    poll_interval_s: float = 0.05

    def __init__(self, directory: Path, log_name: str) -> None:
        self.directory = directory
        self.directory.mkdir(parents=True, exist_ok=True)
        self.log_path = directory / log_name
        self.process: subprocess.Popen[bytes] | None = None
        self.port = 0

    def command(self, port: int) -> list[str]:
        """The argv that starts the server listening on 127.0.0.1:`port`."""
        raise NotImplementedError

    def ready(self) -> bool:
        """Whether the server answers on `self.port`."""
        raise NotImplementedError

    def start(self, same_port: bool = False) -> None:
        """Start on a fresh free port (a few tries) and wait, bounded, until it is ready.

        `same_port=True` restarts on the previous port, as a restarted server
        would come back at its old address.

        Raises:
            RuntimeError: it exited or was not ready within `ready_timeout_s`, three times.
        """
        for _ in range(3):
            if not (same_port and self.port):
                self.port = free_port()
            with open(self.log_path, "ab") as log:
                self.process = subprocess.Popen(
                    self.command(self.port), stdout=log, stderr=subprocess.STDOUT
                )
            deadline = time.monotonic() + self.ready_timeout_s
            while self.process.poll() is None and time.monotonic() < deadline:
                if self.ready():
                    return
                time.sleep(self.poll_interval_s)
            self.stop()
        raise RuntimeError(f"{type(self).__name__} did not become ready:\n{self.log_tail()}")

    def log_tail(self, chars: int = 3000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:]

    def stop(self, how: signal.Signals = signal.SIGTERM) -> None:
        """Send `how` (SIGTERM by default), then SIGKILL if it has not exited within 10 s."""
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
