"""A live fuzzer: random and mutated messages against a real `gradsync serve` process.

`run_fuzz` starts a coordinator subprocess on loopback (its log goes to a
file, so thousands of warnings never block it on a full pipe), then opens many
concurrent raw Sync streams and Status calls and sends what a hostile or
broken worker might: random bytes, truncated and bit-flipped protobufs, Joins
with mutated fields, gradient chunks with every header field at its edges
(through the coordinator's fast parser and through protobuf), checkpoint,
state, collective, abandon and join() messages with absurd sizes, offsets,
steps, epochs and strings. Pairs of streams join the same fuzz job so that
most messages meet a *running* job rather than the "first message must be a
Join" check. Alongside, a well-behaved two-rank job (`legit`) runs steps and
checks every average bit for bit.

What it records, for the caller to assert: every status code (a histogram),
violations (UNKNOWN, a non-OK status without a message, a stream the
coordinator ended with OK although the client neither left nor half-closed,
a stream that never ended after the client half-closed, a Status call
failing without a message, a forged log line), whether the coordinator is
alive, its RSS (VmRSS) after warm-up, at the end and at its peak, and how
many legit steps completed.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import random
import re
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from gradsync.launch import parse_banner
from gradsync.protocol.codec import ChunkHeader, encode_gradient
from gradsync.v1 import gradsync_pb2 as pb

from support.rawclient import (
    BUCKET_BYTES,
    CHUNK,
    RawWorker,
    assembled_job,
    run_step,
    signature,
)

SYNC = "/gradsync.v1.Coordinator/Sync"
STATUS = "/gradsync.v1.Coordinator/Status"
SHARD_LINK = "/gradsync.v1.Coordinator/ShardLink"
CHUNK_MB = str(CHUNK / (1 << 20))
U64 = 2**64 - 1
CLIENT_ARTIFACT = "Internal error from Core"
FORGED = "forged by h5: rank 0 says all is well"
EDGES = [0, 1, 2, 3, 127, 128, 4095, 4096, 4097, 8320, 2**31 - 1, 2**31, 2**32 - 1, 2**32, U64]
#: Sizes a hostile worker declares (checkpoint totals, collective totals, offsets).
#: 2**31 and above are the "allocate by declared size" holes of issue 11.
DECLARED = [0, 1, 8, 4095, 4096, 4097, 8320, 1 << 20, 1 << 26, 2**31, 2**40, U64]


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
    """`gradsync serve --world-size 2` on a free loopback port, logging to a file."""

    def __init__(self, log_path: Path, *extra: str) -> None:
        self.log_path = log_path
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
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._log.close()
        return self.process.returncode


class Messages:
    """Random and mutated WorkerMessage bytes (see the module docstring)."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng

    def edge(self) -> int:
        return self.rng.choice(EDGES)

    def text(self) -> str:
        return self.rng.choice(
            ["", "ok", "x" * 3000, f"bye\n{FORGED}", "\x00\x1b[2J\u202e", "é" * 50]
        )

    def signature(self) -> pb.ModelSignature:
        sig = signature()
        mutation = self.rng.randrange(8)
        if mutation == 0:
            sig.parameters[0].shape[:] = [self.rng.choice([0, 1, 2**31, 2**40])]
        elif mutation == 1:
            sig.buckets[0].num_elements = self.rng.choice([0, 1, 2**31, 2**32 - 1])
        elif mutation == 2:
            sig.buckets[0].parameter_indices[:] = [self.rng.choice([7, 2**32 - 1])]
        elif mutation == 3:
            sig.parameters[0].dtype = self.rng.choice([0, 99, pb.DTYPE_INT64])
        elif mutation == 4:
            sig.parameters[0].name = "n" * self.rng.choice([0, 5000])
        return sig

    def join(self, job_id: str, rank: int) -> pb.WorkerMessage:
        rng = self.rng
        return pb.WorkerMessage(
            join=pb.Join(
                job_id=job_id if rng.random() < 0.95 else rng.choice(["", "j" * 500, "a\nb"]),
                rank=rank if rng.random() < 0.95 else rng.choice([2, 2**32 - 1]),
                world_size=2 if rng.random() < 0.95 else self.edge() % 2**32,
                signature=signature() if rng.random() < 0.9 else self.signature(),
                incarnation=rng.choice(["fuzz"] * 18 + ["", "i" * 2000]),
            )
        )

    def gradient(self, step: int) -> bytes:
        """A gradient chunk near the job's grid, every header field sometimes at an edge."""
        rng = self.rng
        offset = rng.choice([0, CHUNK, 2 * CHUNK])
        header = ChunkHeader(
            step=step if rng.random() < 0.7 else self.edge() % 2**64,
            membership_epoch=0 if rng.random() < 0.8 else self.edge() % 2**64,
            bucket_index=0 if rng.random() < 0.8 else self.edge() % 2**32,
            offset=offset if rng.random() < 0.8 else self.edge() % 2**64,
            dtype=pb.DTYPE_FLOAT32 if rng.random() < 0.8 else rng.choice([0, 2, 3, 4, 99]),
            encoding=0 if rng.random() < 0.9 else rng.choice([1, 2**31 - 1]),
            contributors=0 if rng.random() < 0.9 else self.edge() % 2**32,
            reply_dtype=0 if rng.random() < 0.9 else rng.choice([1, 3, 99]),
        )
        length = min(CHUNK, BUCKET_BYTES - offset)
        length = length if rng.random() < 0.8 else rng.choice([0, 1, length - 1, length + 1])
        raw = encode_gradient(header, rng.randbytes(max(length, 0)))
        if rng.random() < 0.2:
            raw += b"\xa8\x06\x01"  # an unknown top-level field: the protobuf (slow) path
        return raw

    def other(self, step: int) -> pb.WorkerMessage:
        rng = self.rng
        kind = rng.randrange(10)
        if kind == 0:
            return pb.WorkerMessage(heartbeat=pb.Heartbeat(step=rng.choice([step, U64])))
        if kind == 1:
            return pb.WorkerMessage(
                abandon=pb.AbandonStep(step=rng.choice([step, step + 1, U64]), reason=self.text())
            )
        if kind == 2:
            return pb.WorkerMessage(
                checkpoint=pb.CheckpointChunk(
                    step=rng.choice([step, 0, U64]),
                    offset=rng.choice([0, CHUNK, self.edge()]),
                    total_bytes=rng.choice(DECLARED),
                    payload=rng.randbytes(rng.choice([0, 1, 100, CHUNK])),
                    heal=rng.random() < 0.3,
                )
            )
        if kind == 3:
            return pb.WorkerMessage(
                collective=pb.CollectiveChunk(
                    sequence=rng.choice([0, 1, U64]),
                    op=rng.choice([0, 1, 2, 3, 4, 99]),
                    dtype=rng.choice([0, 1, 5, 99]),
                    total_bytes=rng.choice(DECLARED),
                    offset=rng.choice([0, CHUNK, 3]),
                    payload=rng.randbytes(rng.choice([0, 4, 64])),
                    root=rng.choice([0, 1, 2**32 - 1]),
                )
            )
        if kind == 4:
            return pb.WorkerMessage(out_of_inputs=pb.OutOfInputs(step=rng.choice([step, U64])))
        if kind == 5:
            return pb.WorkerMessage(
                state=pb.StateChunk(
                    offset=rng.choice([0, CHUNK, 2 * CHUNK, self.edge()]),
                    payload=bytes(rng.choice([0, 8, 128, CHUNK, CHUNK + 1])),
                )
            )
        if kind == 6:
            return pb.WorkerMessage(join=pb.Join(job_id="again", rank=0, world_size=2))
        if kind == 7:
            return pb.WorkerMessage(shard_hello=pb.ShardHello(job_id="x"))
        if kind == 8:
            return pb.WorkerMessage()
        return pb.WorkerMessage(leave=pb.Leave(reason=self.text()))

    def garbage(self, raw: bytes) -> bytes:
        """Random bytes, or `raw` truncated, bit-flipped or extended."""
        rng = self.rng
        kind = rng.randrange(4)
        if kind == 0 or not raw:
            return rng.randbytes(rng.choice([0, 1, 2, 7, 60, 600]))
        if kind == 1:
            return raw[: rng.randrange(len(raw))]
        if kind == 2:
            index = rng.randrange(len(raw))
            return raw[:index] + bytes([raw[index] ^ rng.randrange(1, 256)]) + raw[index + 1 :]
        return raw + rng.randbytes(rng.choice([1, 5, 40]))

    def next(self, step: int, joined: bool) -> bytes:
        """One message for a stream that has (or has not yet) joined."""
        rng = self.rng
        roll = rng.random()
        if joined and roll < 0.7:
            return self.gradient(step)
        base = self.other(step).SerializeToString() if roll < 0.93 else self.gradient(step)
        return self.garbage(base) if rng.random() < 0.2 else base


@dataclass
class StreamPlan:
    job_id: str
    rank: int
    count: int
    join: bool
    broadcast: bool = False
    pair: bool = False


class Fuzzer:
    """Runs the streams, Status calls and the legit job against one coordinator."""

    def __init__(self, address: str, report: FuzzReport, seed: int) -> None:
        self.address = address
        self.report = report
        self.rng = random.Random(seed)
        self.messages = Messages(self.rng)
        self._job_counter = 0

    async def stream(self, channel: grpc.aio.Channel, plan: StreamPlan, budget: list[int]) -> None:
        """One Sync stream: send `plan.count` messages fast, then see how it ends."""
        call = channel.stream_stream(
            SYNC, request_serializer=lambda raw: raw, response_deserializer=lambda raw: raw
        )()
        report = self.report
        report.streams += 1
        step = 0

        # The status as the reader saw it end: a write racing the coordinator's end
        # of the stream makes grpc report the call as INTERNAL "Internal error from
        # Core" (a client-side artifact), while the reader still saw the real status.
        ended: list[tuple[grpc.StatusCode, str]] = []

        async def read() -> None:
            with contextlib.suppress(asyncio.CancelledError):
                try:
                    while (message := await call.read()) is not grpc.aio.EOF:
                        assert isinstance(message, bytes)
                except grpc.aio.AioRpcError as error:
                    ended.append((error.code(), error.details() or ""))

        reader = asyncio.ensure_future(read())
        outgoing: list[bytes] = []
        if plan.join:
            outgoing.append(self.messages.join(plan.job_id, plan.rank).SerializeToString())
        if plan.broadcast:
            state = bytes(BUCKET_BYTES + 8)
            outgoing += [
                pb.WorkerMessage(
                    state=pb.StateChunk(offset=offset, payload=state[offset : offset + CHUNK])
                ).SerializeToString()
                for offset in range(0, len(state), CHUNK)
            ]
        left = False
        for index in range(plan.count):
            if index < len(outgoing):
                raw = outgoing[index]
            else:
                if self.rng.random() < 0.02:
                    step += 1
                raw = self.messages.next(step, joined=plan.join)
            if call.done() or budget[0] <= 0:
                break
            try:
                await asyncio.wait_for(call.write(raw), timeout=5)
            except (TimeoutError, grpc.aio.AioRpcError, asyncio.InvalidStateError):
                break
            except Exception as exc:  # grpc's ExecuteBatchError once the call ended
                if call.done():
                    break
                raise exc
            budget[0] -= 1
            report.messages += 1
            if index == 0 and plan.join and plan.pair:
                await asyncio.sleep(0.1)  # let the partner join: most messages meet a running job
            left = left or raw.startswith(b"\x22")  # field 4 (leave), length-delimited
        await asyncio.wait([reader], timeout=0.05)
        half_closed = not call.done()
        if half_closed:
            with contextlib.suppress(Exception):
                await call.done_writing()
            await asyncio.wait([reader], timeout=10)
        if not call.done():
            report.note(
                f"stream of job {plan.job_id} rank {plan.rank}: no status 10 s after half-close"
            )
            call.cancel()
            report.codes["client-cancelled"] += 1
            return
        code = await call.code()
        details = await call.details() or ""
        if ended and details == CLIENT_ARTIFACT:
            code, details = ended[0]
        if details == CLIENT_ARTIFACT:
            report.codes["INTERNAL (client wrote after the end)"] += 1
            return
        report.codes[code.name] += 1
        report.reasons[f"{code.name}: {re.sub(r'[0-9]+', 'N', details)[:70]}"] += 1
        where = f"stream {plan.job_id}/{plan.rank}"
        if code is grpc.StatusCode.UNKNOWN:
            report.note(f"{where}: UNKNOWN status ({details!r})")
        elif code is grpc.StatusCode.INTERNAL:
            # The designed answer to a handler bug (never OK, never silent): still a bug.
            report.note(f"{where}: INTERNAL, a coordinator bug: {details[:300]!r}")
        elif code is not grpc.StatusCode.OK and not details.strip():
            report.note(f"{where}: {code.name} without a message")
        elif code is grpc.StatusCode.OK and not half_closed and not left:
            report.note(
                f"{where}: the coordinator ended the stream with OK ({details!r}) though the "
                "client neither left nor half-closed (a rejected stream must carry its code)"
            )

    async def status_call(self, channel: grpc.aio.Channel) -> None:
        call = channel.unary_unary(
            STATUS, request_serializer=lambda raw: raw, response_deserializer=lambda raw: raw
        )
        rng = self.rng
        request = pb.StatusRequest().SerializeToString()
        if rng.random() < 0.5:
            request = self.messages.garbage(request + b"\x0a\x03abc")
        self.report.status_calls += 1
        try:
            await asyncio.wait_for(call(request, timeout=5), timeout=6)
            self.report.codes["OK"] += 1
        except grpc.aio.AioRpcError as error:
            self.report.codes[error.code().name] += 1
            if error.code() is grpc.StatusCode.UNKNOWN or not (error.details() or "").strip():
                self.report.note(f"Status: {error.code().name} {error.details()!r}")

    async def shard_link_call(self, channel: grpc.aio.Channel) -> None:
        """A ShardLink stream that opens with garbage (a would-be coordinator shard)."""
        call = channel.stream_stream(
            SHARD_LINK, request_serializer=lambda raw: raw, response_deserializer=lambda raw: raw
        )()
        self.report.status_calls += 1
        register = pb.ShardMessage().SerializeToString()
        with contextlib.suppress(grpc.aio.AioRpcError, asyncio.InvalidStateError):
            await asyncio.wait_for(call.write(self.messages.garbage(register + b"\x0a\x01x")), 5)
            await asyncio.wait_for(call.done_writing(), 5)
            while (await asyncio.wait_for(call.read(), 5)) is not grpc.aio.EOF:
                pass
        if not call.done():
            call.cancel()
            return
        code, details = await call.code(), await call.details() or ""
        self.report.codes[code.name] += 1
        if code in (grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL) or (
            code is not grpc.StatusCode.OK and not details.strip()
        ):
            self.report.note(f"ShardLink: {code.name} {details[:200]!r}")

    def plans(self) -> list[StreamPlan]:
        """The next batch: usually a pair that joins one fresh job, sometimes a lone stream."""
        rng = self.rng
        self._job_counter += 1
        job_id = f"fuzz-{self._job_counter % 24}"
        if rng.random() < 0.7:
            count = rng.choice([50, 200, 400])
            return [
                StreamPlan(job_id, 0, count, join=True, broadcast=rng.random() < 0.8, pair=True),
                StreamPlan(job_id, 1, count, join=True, pair=True),
            ]
        return [
            StreamPlan(job_id, rng.choice([0, 1]), rng.choice([1, 3, 20]), join=rng.random() < 0.5)
        ]

    async def lane(self, channel: grpc.aio.Channel, budget: list[int]) -> None:
        """One of the concurrent lanes: batches of streams until the message budget is spent."""
        while budget[0] > 0:
            roll = self.rng.random()
            if roll < 0.05:
                await self.status_call(channel)
                continue
            if roll < 0.06:
                await self.shard_link_call(channel)
                continue
            await asyncio.gather(*(self.stream(channel, plan, budget) for plan in self.plans()))


async def legit_job(address: str, report: FuzzReport, stop: asyncio.Event, steps: int) -> None:
    """A well-behaved two-rank job that must keep producing exact averages."""
    async with grpc.aio.insecure_channel(address) as channel:
        try:
            workers: list[RawWorker] = await assembled_job(channel, job_id="legit")
            for step in range(steps):
                await run_step(workers, step)
                report.legit_steps += 1
                if stop.is_set() and step >= 2:
                    break
                await asyncio.sleep(0.01)
            for worker in workers:
                await worker.leave()
        except Exception as exc:  # recorded: the caller asserts on it
            report.legit_error = f"{type(exc).__name__}: {exc}"


async def fuzz(
    coordinator: LiveCoordinator,
    messages: int,
    seed: int = 0,
    lanes: int = 8,
    legit_steps: int = 1000,
    progress: Callable[[FuzzReport], None] | None = None,
) -> FuzzReport:
    """Send `messages` fuzz messages to `coordinator` (see the module docstring)."""
    report = FuzzReport(log_path=str(coordinator.log_path))
    pid = coordinator.process.pid
    started = time.monotonic()
    options = [("grpc.max_send_message_length", 64 << 20)]
    async with grpc.aio.insecure_channel(coordinator.address, options=options) as channel:
        fuzzer = Fuzzer(coordinator.address, report, seed)
        warmup = [min(1000, messages // 10)]
        await asyncio.gather(*(fuzzer.lane(channel, warmup) for _ in range(lanes)))
        await asyncio.sleep(0.3)
        report.rss_before_kib = report.rss_peak_kib = rss_kib(pid)
        stop = asyncio.Event()
        legit = asyncio.ensure_future(legit_job(coordinator.address, report, stop, legit_steps))
        budget = [messages - report.messages]

        async def sample() -> None:
            while True:
                report.rss_peak_kib = max(report.rss_peak_kib, rss_kib(pid))
                if progress is not None:
                    progress(report)
                await asyncio.sleep(0.2)

        sampler = asyncio.ensure_future(sample())
        try:
            await asyncio.gather(*(fuzzer.lane(channel, budget) for _ in range(lanes)))
        finally:
            stop.set()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(legit, timeout=30)
            sampler.cancel()
    await asyncio.sleep(0.5)
    report.rss_after_kib = rss_kib(pid)
    report.rss_peak_kib = max(report.rss_peak_kib, report.rss_after_kib)
    report.alive = coordinator.process.poll() is None
    report.exit_code = coordinator.process.returncode
    report.duration_s = time.monotonic() - started
    return report


def scan_log(report: FuzzReport, log_path: Path) -> None:
    """Tracebacks and forged lines in the coordinator's log are findings too."""
    text = log_path.read_text(errors="replace")
    report.log_tracebacks = text.count("Traceback (most recent call last)")
    forged = sum(1 for line in text.splitlines() if line.startswith(FORGED))
    if forged:
        report.note(f"log injection: {forged} lines of the coordinator log start with {FORGED!r}")


def run_fuzz(
    log_path: Path, messages: int, seed: int = 0, lanes: int = 8, **kwargs: object
) -> FuzzReport:
    """Start a coordinator, fuzz it with `messages` messages, stop it; return the report."""
    coordinator = LiveCoordinator(log_path)
    try:
        report = asyncio.run(fuzz(coordinator, messages, seed, lanes, **kwargs))  # type: ignore[arg-type]
    finally:
        exit_code = coordinator.stop()
    if report.alive and exit_code not in (0, None):
        report.note(f"coordinator exited {exit_code} on SIGTERM after the run")
    scan_log(report, log_path)
    return report
