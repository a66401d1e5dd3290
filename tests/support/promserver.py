"""A real Prometheus server for tests: a child process on a free loopback port.

It scrapes the targets the test names every second, keeps its data in the
test's temporary folder, and answers PromQL through its HTTP API, so tests see
exactly what a deployment's Prometheus would see (metric names, label
parsing, histogram series, query syntax).
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

from support.redisserver import free_port

PROMETHEUS = shutil.which("prometheus")
PROMTOOL = shutil.which("promtool")
NO_PROMETHEUS = "prometheus not installed (CI installs Debian's prometheus)"


class PrometheusServer:
    """`prometheus` scraping `targets` ("host:port") every `scrape_interval_s` seconds."""

    def __init__(self, directory: Path, targets: list[str], scrape_interval_s: int = 1) -> None:
        if PROMETHEUS is None:
            raise RuntimeError(NO_PROMETHEUS)
        self.directory = directory
        self.directory.mkdir(parents=True, exist_ok=True)
        self.config_path = directory / "prometheus.yml"
        self.log_path = directory / "prometheus.log"
        interval = f"{scrape_interval_s}s"
        scrape_configs = (
            [{"job_name": "gradsync", "static_configs": [{"targets": targets}]}] if targets else []
        )
        # JSON is YAML: no YAML writer needed to produce the config.
        self.config_path.write_text(
            json.dumps(
                {
                    "global": {"scrape_interval": interval, "evaluation_interval": interval},
                    "scrape_configs": scrape_configs,
                }
            )
        )
        self.process: subprocess.Popen[bytes] | None = None
        self.port = 0
        self.start()

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        """Start on a free port and wait (bounded) for /-/ready; a few tries for port races."""
        assert PROMETHEUS is not None
        for _ in range(3):
            self.port = free_port()
            with open(self.log_path, "ab") as log:
                self.process = subprocess.Popen(
                    [
                        PROMETHEUS,
                        f"--config.file={self.config_path}",
                        f"--storage.tsdb.path={self.directory / 'data'}",
                        f"--web.listen-address=127.0.0.1:{self.port}",
                    ],
                    stdout=log,
                    stderr=subprocess.STDOUT,
                )
            deadline = time.monotonic() + 20
            while self.process.poll() is None and time.monotonic() < deadline:
                if self._ready():
                    return
                time.sleep(0.1)
            self.stop()
        raise RuntimeError(f"prometheus did not become ready:\n{self.log_tail()}")

    def _ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.base_url}/-/ready", timeout=1) as reply:
                return bool(reply.status == 200)
        except OSError:
            return False

    def log_tail(self, chars: int = 3000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:]

    def query(self, expression: str) -> dict[str, Any]:
        """The API's answer to an instant query, whatever its HTTP status (errors are JSON too)."""
        url = f"{self.base_url}/api/v1/query?" + urllib.parse.urlencode({"query": expression})
        try:
            with urllib.request.urlopen(url, timeout=5) as reply:
                answer: dict[str, Any] = json.load(reply)
        except urllib.error.HTTPError as exc:
            with exc:
                answer = json.load(exc)
        return answer

    def values(self, expression: str) -> list[tuple[dict[str, str], float]]:
        """The (labels, value) pairs of an instant vector query; raises if the query fails."""
        answer = self.query(expression)
        if answer.get("status") != "success":
            raise AssertionError(f"query {expression!r} failed: {answer}")
        return [(item["metric"], float(item["value"][1])) for item in answer["data"]["result"]]

    def wait_for_value(self, expression: str, expected: float, timeout_s: float = 30) -> None:
        """Poll until the query's single series equals `expected` (bounded by `timeout_s`)."""
        deadline = time.monotonic() + timeout_s
        seen: list[tuple[dict[str, str], float]] = []
        while time.monotonic() < deadline:
            seen = self.values(expression)
            if len(seen) == 1 and seen[0][1] == expected:
                return
            time.sleep(0.25)
        raise AssertionError(
            f"{expression} never became {expected} within {timeout_s}s (last: {seen});\n"
            f"targets: {self.targets()}\nlog:\n{self.log_tail()}"
        )

    def targets(self) -> Any:
        with urllib.request.urlopen(f"{self.base_url}/api/v1/targets", timeout=5) as reply:
            return json.load(reply)["data"]["activeTargets"]

    def stop(self) -> None:
        """SIGTERM, then SIGKILL if it has not exited within 10 s."""
        if self.process is None:
            return
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.process = None
