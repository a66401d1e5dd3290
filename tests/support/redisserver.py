"""A real redis-server for tests: started on a free loopback port, stopped afterwards."""

from __future__ import annotations

import socket
from pathlib import Path

from support.components import REDIS_SERVER
from support.servers import ServerProcess


class RedisServer(ServerProcess):
    """A real redis-server child on a free loopback port, keeping its files in `directory`."""

    def __init__(self, directory: Path, *durability_args: str) -> None:
        super().__init__(directory, "redis.log")
        self.durability_args = durability_args or ("--appendonly", "yes", "--appendfsync", "always")
        self.start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def command(self, port: int) -> list[str]:
        assert REDIS_SERVER is not None
        return [
            REDIS_SERVER,
            *("--port", str(port), "--bind", "127.0.0.1"),
            *("--dir", str(self.directory), "--save", "", "--daemonize", "no"),
            *self.durability_args,
        ]

    def ready(self) -> bool:
        return self.answers_ping()

    def answers_ping(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=1) as connection:
                connection.sendall(b"PING\r\n")
                return connection.recv(64).startswith(b"+PONG")
        except OSError:
            return False
