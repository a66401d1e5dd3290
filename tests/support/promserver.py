"""A real Prometheus server for tests: a child process on a free loopback port.

It scrapes the targets the test names every second, keeps its data in the
test's temporary folder, and answers PromQL through its HTTP API, so tests see
exactly what a deployment's Prometheus would see (metric names, label
parsing, histogram series, query syntax).
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

from support.components import NO_PROMETHEUS, PROMETHEUS, PROMTOOL
from support.servers import ServerProcess

__all__ = ["NO_PROMETHEUS", "PROMETHEUS", "PROMTOOL", "PrometheusServer"]


class PrometheusServer(ServerProcess):
    """`prometheus` scraping `targets` ("host:port") every `scrape_interval_s` seconds."""

    ready_timeout_s = 20.0
    poll_interval_s = 0.1

    def __init__(self, directory: Path, targets: list[str], scrape_interval_s: int = 1) -> None:
        if PROMETHEUS is None:
            raise RuntimeError(NO_PROMETHEUS)
        super().__init__(directory, "prometheus.log")
        self.config_path = directory / "prometheus.yml"
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
        self.start()

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self, port: int) -> list[str]:
        assert PROMETHEUS is not None
        return [
            PROMETHEUS,
            f"--config.file={self.config_path}",
            f"--storage.tsdb.path={self.directory / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ]

    def ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.base_url}/-/ready", timeout=1) as reply:
                return bool(reply.status == 200)
        except OSError:
            return False

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
