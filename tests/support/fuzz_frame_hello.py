"""Fuzz the TLS frame port's opening: the handshake, the HELLO and what follows it.

A `gradsync serve` with TLS (trustme certificates) and a token, its first-message
deadline short, gets many concurrent hostile openings (`OPENINGS`): bytes that are
not TLS, silence, a TLS handshake cut short, and after a handshake HELLOs with no,
wrong, near-miss or oversized tokens, the wrong magic or kind, claimed lengths past
the limit, a frame cut in the middle, messages before the HELLO, the right token
followed by garbage. Every opening must end within the deadline (plus slack) and
never be answered with a MESSAGE frame unless it presented the token; when the
coordinator says why it is a STATUS frame with a code other than OK, UNKNOWN or
INTERNAL and a message, and a HELLO without the right token is told UNAUTHENTICATED.
Afterwards the coordinator is alive, holds no more descriptors than before (give or
take), its log has no traceback and its refusals are a line per period, not one per
connection, and a genuine worker still gets past the token check.
"""

from __future__ import annotations

import asyncio
import collections
import os
import random
import re
import ssl
import time
from dataclasses import dataclass, field
from pathlib import Path

from gradsync_proto.net.frames import (
    HEADER,
    HELLO,
    MAGIC,
    MAX_HELLO_BYTES,
    MESSAGE,
    STATUS,
    decode_status,
    hello_frame,
)
from gradsync_proto.v1 import gradsync_pb2 as pb

from support.fuzz_coordinator import LiveCoordinator, rss_kib

#: The coordinator's first-message deadline in these runs (seconds).
DEADLINE_S = 1.0
#: How long past the deadline an opening may take to end (a loaded machine).
SLACK_S = 8.0
#: Codes a refused opening may end with (by number): never OK, UNKNOWN or INTERNAL.
_REFUSAL_CODES = {3: "INVALID_ARGUMENT", 4: "DEADLINE_EXCEEDED", 8: "RESOURCE_EXHAUSTED",
                  9: "FAILED_PRECONDITION", 16: "UNAUTHENTICATED"}  # fmt: skip
#: What the openings that never shake hands send.
_BEFORE_TLS = {
    "plaintext-hello": hello_frame("x" * 40),
    "silent": b"",
    "cut-handshake": b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03",  # a ClientHello's start
}
OPENINGS = (
    "garbage", "plaintext-hello", "silent", "cut-handshake", "tls-silent", "no-token",
    "wrong-token", "near-miss", "long-token", "bad-magic", "bad-kind", "huge-claim",
    "cut-frame", "message-first", "not-utf8", "tls-garbage", "right-then-garbage",
)  # fmt: skip


@dataclass
class HelloFuzzReport:
    """What a TLS HELLO fuzz run saw."""

    openings: collections.Counter[str] = field(default_factory=collections.Counter)
    endings: collections.Counter[str] = field(default_factory=collections.Counter)
    violations: list[str] = field(default_factory=list)
    alive: bool = True
    genuine: str = ""
    fds_before: int = 0
    fds_after: int = 0
    rss_before_kib: int = 0
    rss_peak_kib: int = 0
    refusal_lines: int = 0
    log_tracebacks: int = 0
    duration_s: float = 0.0

    def note(self, violation: str) -> None:
        if len(self.violations) < 200:
            self.violations.append(violation)

    def summary(self) -> str:
        return "\n".join(
            [
                f"TLS frame openings {sum(self.openings.values())} "
                f"({', '.join(f'{k} {v}' for k, v in sorted(self.openings.items()))})",
                "endings            "
                + ", ".join(f"{k} {v}" for k, v in self.endings.most_common()),
                f"coordinator        {'alive' if self.alive else 'DEAD'}; genuine worker: "
                f"{self.genuine}; tracebacks in its log: {self.log_tracebacks}",
                f"descriptors        before {self.fds_before}, after {self.fds_after}",
                f"RSS                before {self.rss_before_kib / 1024:.1f} MiB, peak "
                f"{self.rss_peak_kib / 1024:.1f} MiB",
                f"refusal log lines  {self.refusal_lines} in {self.duration_s:.1f} s",
                f"violations         {len(self.violations)}",
                *[
                    f"  - {n} x {v}"
                    for v, n in collections.Counter(self.violations).most_common(12)
                ],
            ]
        )


def _frame(kind: int, body: bytes) -> bytes:
    return HEADER.pack(kind, len(body)) + body


def _after_handshake(opening: str, token: str, rng: random.Random) -> bytes:
    """The bytes an opening sends once TLS is up."""
    if opening == "no-token":
        return hello_frame(None)
    if opening == "wrong-token":
        return hello_frame("".join(rng.choice("abcdef0123") for _ in range(len(token))))
    if opening == "near-miss":
        index = rng.randrange(len(token))
        flipped = chr(ord(token[index]) ^ 1)
        return hello_frame(rng.choice([token[:index] + flipped + token[index + 1 :],
                                       token[:-1], token + "x"]))  # fmt: skip
    if opening == "long-token":
        return hello_frame("t" * rng.choice([4096, MAX_HELLO_BYTES - len(MAGIC) + 1, 70_000]))
    if opening == "bad-magic":
        return _frame(HELLO, b"gradsync-frames/9\n" + token.encode())
    if opening == "bad-kind":
        return _frame(rng.choice([STATUS, 7, 255]), MAGIC + token.encode())
    if opening == "huge-claim":
        return HEADER.pack(HELLO, rng.choice([MAX_HELLO_BYTES + 1, 2**31, 2**32 - 1])) + MAGIC
    if opening == "cut-frame":
        whole = hello_frame(token)
        return whole[: rng.randrange(1, len(whole))]
    if opening == "message-first":
        raw = pb.WorkerMessage(heartbeat=pb.Heartbeat(step=1)).SerializeToString()
        return _frame(MESSAGE, raw) + hello_frame(token)
    if opening == "not-utf8":
        return _frame(HELLO, MAGIC + b"\xff\xfe" + os.urandom(8))
    if opening == "tls-garbage":
        return os.urandom(rng.randrange(1, 4096))
    if opening == "right-then-garbage":
        return hello_frame(token) + os.urandom(rng.randrange(1, 512))
    return b""  # tls-silent


async def _read_frames(reader: asyncio.StreamReader, limit_s: float) -> list[tuple[int, bytes]]:
    """Frames until the connection ends (or `limit_s` passes: then a timeout is raised)."""
    frames: list[tuple[int, bytes]] = []
    async with asyncio.timeout(limit_s):
        while True:
            try:
                header = await reader.readexactly(HEADER.size)
                kind, length = HEADER.unpack(header)
                frames.append((kind, await reader.readexactly(length)))
            except (asyncio.IncompleteReadError, ConnectionError, ssl.SSLError):
                return frames


async def _one(
    port: int, opening: str, token: str, context: ssl.SSLContext, rng: random.Random
) -> tuple[str, str | None]:
    """Run one opening: (how it ended, a violation or None)."""
    started = time.monotonic()
    limit_s = DEADLINE_S + SLACK_S
    if opening in ("garbage", "plaintext-hello", "silent", "cut-handshake"):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            writer.write(_BEFORE_TLS[opening] if opening != "garbage" else os.urandom(999))
            async with asyncio.timeout(limit_s):
                while await reader.read(65536):
                    pass  # (a TLS alert, at most)
        except TimeoutError:
            return "hung", f"{opening}: still open {limit_s:.0f}s after connecting"
        except (ConnectionError, OSError):
            pass
        finally:
            writer.close()
        return "closed", None
    try:
        reader, writer = await asyncio.wait_for(
            asyncio.open_connection("127.0.0.1", port, ssl=context, server_hostname="127.0.0.1"),
            limit_s,
        )
    except (ssl.SSLError, ConnectionError, TimeoutError) as exc:
        return "handshake-failed", f"{opening}: the TLS handshake failed: {exc!r:.80}"
    try:
        writer.write(_after_handshake(opening, token, rng))
        frames = await _read_frames(reader, limit_s - (time.monotonic() - started))
    except TimeoutError:
        return "hung", f"{opening}: still open {limit_s:.0f}s after connecting"
    finally:
        writer.close()
    return _judge(opening, frames)


def _judge(opening: str, frames: list[tuple[int, bytes]]) -> tuple[str, str | None]:
    kinds = [kind for kind, _ in frames]
    if MESSAGE in kinds and opening != "right-then-garbage":
        return "answered", f"{opening}: a MESSAGE frame for a connection without the token"
    statuses = [decode_status(body) for kind, body in frames if kind == STATUS]
    if not statuses:
        return "closed", None  # (a frame over the size limit can be cut before its STATUS)
    code, details = statuses[-1]
    name = _REFUSAL_CODES.get(code)
    if name is None or not details.strip():
        return f"code {code}", f"{opening}: ended with status {code} {details!r:.80}"
    if opening in ("no-token", "wrong-token", "near-miss") and name != "UNAUTHENTICATED":
        return name, f"{opening}: a HELLO without the right token ended {name}, not UNAUTHENTICATED"
    return name, None


async def _fuzz(
    port: int, count: int, token: str, ca: Path, seed: int, lanes: int, report: HelloFuzzReport
) -> None:
    context = ssl.create_default_context(cafile=str(ca))
    rng = random.Random(seed)
    queue = [rng.choice(OPENINGS) for _ in range(count)]

    async def lane(index: int) -> None:
        lane_rng = random.Random(seed * 1000 + index)
        while queue:
            opening = queue.pop()
            report.openings[opening] += 1
            ending, violation = await _one(port, opening, token, context, lane_rng)
            report.endings[ending] += 1
            if violation is not None:
                report.note(violation)

    await asyncio.gather(*(lane(index) for index in range(lanes)))


async def _genuine(port: int, token: str, ca: Path) -> str:
    """A worker with the token past the HELLO: its non-Join first message is refused by the
    servicer itself (so the token check let it through)."""
    context = ssl.create_default_context(cafile=str(ca))
    reader, writer = await asyncio.open_connection(
        "127.0.0.1", port, ssl=context, server_hostname="127.0.0.1"
    )
    try:
        raw = pb.WorkerMessage(heartbeat=pb.Heartbeat(step=0)).SerializeToString()
        writer.write(hello_frame(token) + _frame(MESSAGE, raw))
        frames = await _read_frames(reader, 10)
    finally:
        writer.close()
    statuses = [decode_status(body) for kind, body in frames if kind == STATUS]
    return statuses[-1][1][:60] if statuses else "no status"


def run_frame_hello_fuzz(
    folder: Path, count: int, seed: int = 0, lanes: int = 24
) -> HelloFuzzReport:
    """Start a TLS + token coordinator in `folder`, fuzz `count` openings, report."""
    import trustme  # (test dependency)

    ca = trustme.CA()
    ca_path, server_path = folder / "ca.pem", folder / "server.pem"
    ca.cert_pem.write_to_path(str(ca_path))
    ca.issue_cert("127.0.0.1").private_key_and_cert_chain_pem.write_to_path(str(server_path))
    token = "".join(
        random.Random(seed).choice("abcdefghjkmnpqrstuvwxyz23456789") for _ in range(40)
    )
    log_path = folder / "coordinator.log"
    coordinator = LiveCoordinator(
        log_path,
        "--tls-cert", str(server_path), "--tls-key", str(server_path),
        "--first-message-timeout-s", str(DEADLINE_S),
        token=token,
    )  # fmt: skip
    report = HelloFuzzReport()
    pid = coordinator.process.pid
    try:
        match = re.search(r"frames on port (\d+)", log_path.read_text())
        assert match is not None, "the coordinator serves no frame port"
        port = int(match.group(1))
        report.fds_before = len(os.listdir(f"/proc/{pid}/fd"))
        report.rss_before_kib = report.rss_peak_kib = rss_kib(pid)
        started = time.monotonic()

        async def run() -> None:
            fuzz = asyncio.ensure_future(_fuzz(port, count, token, ca_path, seed, lanes, report))
            while not fuzz.done():
                report.rss_peak_kib = max(report.rss_peak_kib, rss_kib(pid))
                await asyncio.wait([fuzz], timeout=0.2)
            await fuzz
            report.genuine = await _genuine(port, token, ca_path)

        asyncio.run(run())
        report.duration_s = time.monotonic() - started
        deadline = time.monotonic() + DEADLINE_S + 5
        while time.monotonic() < deadline:
            report.fds_after = len(os.listdir(f"/proc/{pid}/fd"))
            if report.fds_after <= report.fds_before + 2:
                break
            time.sleep(0.1)
        report.alive = coordinator.process.poll() is None
    finally:
        coordinator.stop()
    text = log_path.read_text(errors="replace")
    report.log_tracebacks = text.count("Traceback (most recent call last)")
    report.refusal_lines = sum("refused" in line for line in text.splitlines())
    if token in text:
        report.note("the token was logged")
    return report
