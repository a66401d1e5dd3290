"""The live fuzzer's target and its findings: the coordinator process and the report.

`LiveCoordinator` runs `gradsync serve --world-size 2` as a subprocess on a
free loopback port (optionally with a token in its environment), its log
going to a file so thousands of warnings never block it on a full pipe.
`FuzzReport` is what a fuzz run saw (status codes, violations, RSS, the legit
job, unauthenticated calls in token mode) with its printed `summary`;
`rss_kib` samples the coordinator's memory and `scan_log` turns tracebacks
and forged lines in its log into findings.
"""

from __future__ import annotations

import collections
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from gradsync_bench.procs import stop_process
from gradsync_proto import auth
from gradsync_proto.net.launch import parse_banner

from support.fuzz_messages import FORGED
from support.rawclient import CHUNK

CHUNK_MB = str(CHUNK / (1 << 20))


@dataclass
class FuzzReport:
    """What a fuzz run saw (see the module docstring)."""

    messages: int = 0
    streams: int = 0
    #: Status and ShardLink calls.
    status_calls: int = 0
    codes: collections.Counter[str] = field(default_factory=collections.Counter)
    #: (code, the status message with numbers blanked, cut to 70 characters): how often.
    reasons: collections.Counter[str] = field(default_factory=collections.Counter)
    violations: list[str] = field(default_factory=list)
    rss_before_kib: int = 0
    rss_after_kib: int = 0
    rss_peak_kib: int = 0
    duration_s: float = 0.0
    legit_steps: int = 0
    legit_error: str = ""
    alive: bool = True
    exit_code: int | None = None
    log_path: str = ""
    log_tracebacks: int = 0
    #: Token mode: the coordinator required a token.
    token: bool = False
    #: Token mode: calls (Sync, Status, ShardLink) made with no token or a wrong one ...
    unauth_calls: int = 0
    #: ... and how many of them ended UNAUTHENTICATED without a reply message.
    unauth_refused: int = 0

    def summary(self) -> str:
        codes = ", ".join(f"{code} {count}" for code, count in self.codes.most_common())
        lines = [
            f"messages sent      {self.messages}",
            f"streams            {self.streams} Sync (+ {self.status_calls} Status / ShardLink)",
            f"status codes       {codes}",
            f"coordinator        {'alive' if self.alive else f'DEAD (exit {self.exit_code})'}",
            f"crashes            {0 if self.alive else 1} "
            f"(tracebacks in its log: {self.log_tracebacks})",
            f"violations         {len(self.violations)}",
            *[
                f"  - {count} x {line}"
                for line, count in collections.Counter(self.violations).most_common(12)
            ],
            f"RSS                before {self.rss_before_kib / 1024:.1f} MiB, after "
            f"{self.rss_after_kib / 1024:.1f} MiB, peak {self.rss_peak_kib / 1024:.1f} MiB "
            f"(growth {(self.rss_after_kib - self.rss_before_kib) / 1024:+.1f} MiB)",
            *(
                [
                    f"unauthenticated    {self.unauth_calls} calls without the token, "
                    f"{self.unauth_refused} refused UNAUTHENTICATED"
                ]
                if self.token
                else []
            ),
            f"legit job          {self.legit_steps} steps"
            + (f", FAILED: {self.legit_error}" if self.legit_error else ", all averages exact"),
            f"duration           {self.duration_s:.1f} s",
            f"coordinator log    {self.log_path}",
        ]
        return "\n".join(lines)

    def note(self, violation: str) -> None:
        if len(self.violations) < 200:
            self.violations.append(violation)


def rss_kib(pid: int) -> int:
    """VmRSS of `pid` in KiB (0 once it is gone)."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return 0
    match = re.search(r"^VmRSS:\s+(\d+) kB", text, re.MULTILINE)
    return int(match.group(1)) if match else 0


class LiveCoordinator:
    """`gradsync serve --world-size 2` on a free loopback port, logging to a file.

    With `token`, the coordinator gets it as $GRADSYNC_TOKEN (and no
    $GRADSYNC_TOKEN_FILE) and refuses every call that does not present it;
    `shard_token` likewise as $GRADSYNC_SHARD_TOKEN, for ShardLink.
    """

    def __init__(
        self,
        log_path: Path,
        *extra: str,
        token: str | None = None,
        shard_token: str | None = None,
    ) -> None:
        self.log_path = log_path
        self.token = token
        env = {
            key: value
            for key, value in os.environ.items()
            if key not in (auth.ENV_TOKEN_FILE, auth.ENV_SHARD_TOKEN_FILE)
        }
        if token is not None:
            env[auth.ENV_TOKEN] = token
        if shard_token is not None:
            env[auth.ENV_SHARD_TOKEN] = shard_token
        self._log = log_path.open("w")
        self.process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "gradsync.cli",
                "serve",
                "--world-size",
                "2",
                "--host",
                "127.0.0.1",
                "--port",
                "0",
                "--chunk-mb",
                CHUNK_MB,
                *extra,
            ],
            stdout=subprocess.DEVNULL,
            stderr=self._log,
            text=True,
            env=env,
        )
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            for line in log_path.read_text().splitlines():
                banner = parse_banner(line)
                if banner is not None:
                    self.address = f"127.0.0.1:{banner[1]}"
                    return
            if self.process.poll() is not None:
                break
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"coordinator did not start: {log_path.read_text()[-2000:]}")

    def stop(self) -> int | None:
        stop_process(self.process)
        self._log.close()
        return self.process.returncode


def scan_log(report: FuzzReport, log_path: Path) -> None:
    """Tracebacks and forged lines in the coordinator's log are findings too."""
    text = log_path.read_text(errors="replace")
    report.log_tracebacks = text.count("Traceback (most recent call last)")
    forged = sum(1 for line in text.splitlines() if line.startswith(FORGED))
    if forged:
        report.note(f"log injection: {forged} lines of the coordinator log start with {FORGED!r}")
